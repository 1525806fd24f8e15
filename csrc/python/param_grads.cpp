// nanfast._C.ParamGrads: the parameters a watch's step-end pass reads, with their gradients and names.
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "../ops.h"
#include "bindings.h"

namespace nanfast::python {
namespace {

// NOTE: [The pass's parameters in C++]
// At each step's end the watch lists the optimizer's parameters, their names and the stored values of
// their gradients. In Python that was four comprehensions over every parameter (a dict lookup by id, a
// .grad, a sparse test each), run right after backward, when every line pays cold caches: 40-90 us a
// step on the watch suite's models, more than the kernel that reads a small model's gradients. Here it
// is one loop. The names do not change while the parameters and which of them have a gradient stay the
// same, so the tuples of names are kept and handed out again (the same objects: what reads them may
// key caches on them); the parameters are kept alive with them, so an address seen again is the same
// parameter. The names come from the model as it is when the list changes (`names()`), not as it was
// when the watch began: a head replaced after watch() has its own names, and an address a dropped
// parameter left, taken by a new one, cannot lend it the old one's name.
//
// NOTE: [Each parameter's gradient, prefetched]
// Reaching a gradient is a chain of objects each found through the one before: the parameter's
// TensorImpl, its autograd metadata, the gradient's TensorImpl. After backward all of them are cold, so
// the loop waited on three cache misses a parameter, one after another: 29 us for the 27 parameters of
// the watch suite's small transformer, 52 us for ResNet-18's 62, timed inside their steps (2-4 us
// warm). The loop now requests each link some entries ahead, the first link furthest (the same idea
// as NOTE: [Thousands of small tensors' metadata] in csrc/ops.h): 27 and 44 us in the same steps; after
// a 128 MB write, 25 -> 17-20 us and 37 -> 23-33 us. What stays cold (the code, the param_groups'
// Python objects, the page tables) is most of the rest. Prefetches are hints: nothing read changes.
class ParamGrads {
 public:
  // names(): id(parameter) -> its name in the model now; others are named "param[i]" (i: position in
  // the list).
  explicit ParamGrads(py::object names) : names_(std::move(names)) {}

  // The parameters of `source` (optimizer.param_groups, a list of dicts with "params", when `groups`;
  // else a list of parameters) as (parameters, their names, the stored values of the gradients that
  // are set, those gradients' parameter names). A sparse gradient gives its stored values, which
  // scaling in place scales (Watch.clip_grad_norm_); a COO one stays uncoalesced (coalescing syncs the
  // host on CUDA), so every non-finite entry is counted.
  // The next gather asks for the names again, even if the parameters are the same (a parametrization
  // moved one to `parametrizations.weight.original`).
  void forget() {
    kept_.clear();
  }

  py::tuple gather(py::handle source, bool groups) {
    py::list params;
    if (groups) {
      for (const py::handle group : source) {
        for (const py::handle p : group["params"]) {
          params.append(p);
        }
      }
    } else {
      for (const py::handle p : source) {
        params.append(p);
      }
    }
    const size_t n = params.size();
    bool same = n == kept_.size();
    for (size_t i = 0; same && i < n; ++i) {
      same = params[i].ptr() == kept_[i].ptr();
    }
    if (!same) {
      rename(params);
    }
    py::list grads;
    std::vector<bool> with_grad(n, false);
    for (size_t i = 0; i < n; ++i) {
      prefetch_links(params, i);
      TORCH_CHECK(THPVariable_Check(params[i].ptr()), "nanfast.watch: parameter ", i, " of ",
                  groups ? "the optimizer's param_groups" : "the model", " is a ",
                  Py_TYPE(params[i].ptr())->tp_name, ", not a torch.Tensor");
      const at::Tensor& grad = THPVariable_Unpack(params[i].ptr()).grad();
      if (!grad.defined()) {
        continue;
      }
      with_grad[i] = true;
      if (grad.layout() == at::kStrided) {
        grads.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));
      } else if (grad.layout() == at::kSparse) {
        grads.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad._values())));
      } else {  // CSR, CSC, BSR, BSC
        grads.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad.values())));
      }
    }
    if (!same || with_grad != with_grad_) {
      py::list grad_names;
      for (size_t i = 0; i < n; ++i) {
        if (with_grad[i]) {
          grad_names.append(param_names_[i]);
        }
      }
      grad_names_ = py::tuple(grad_names);
      with_grad_ = std::move(with_grad);
    }
    return py::make_tuple(params, param_names_, grads, grad_names_);
  }

 private:
  void rename(const py::list& params) {
    kept_.clear();
    const py::dict current = names_();
    py::list names;
    for (size_t i = 0; i < params.size(); ++i) {
      kept_.push_back(py::reinterpret_borrow<py::object>(params[i]));
      const py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(params[i].ptr()));
      PyObject* name = PyDict_GetItemWithError(current.ptr(), id.ptr());  // borrowed
      if (name == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      names.append(name != nullptr && PyObject_IsTrue(name) == 1 ? py::reinterpret_borrow<py::object>(name)
                                                                  : py::str("param[" + std::to_string(i) + "]"));
    }
    param_names_ = py::tuple(names);
    with_grad_.clear();
  }

  // Requests the links of the entries ahead of `i` (NOTE: [Each parameter's gradient, prefetched]), each
  // read from the link requested for that entry a few iterations before: the parameter's TensorImpl,
  // its autograd metadata, the gradient's TensorImpl.
  static void prefetch_links(const py::list& params, size_t i) {
    constexpr size_t kImplAhead = 12;
    constexpr size_t kMetaAhead = 8;
    constexpr size_t kGradAhead = 4;
    const size_t n = params.size();
    if (i + kImplAhead < n) {
      if (const c10::TensorImpl* impl = impl_at(params, i + kImplAhead)) {
        __builtin_prefetch(impl);
      }
    }
    if (i + kMetaAhead < n) {
      if (const c10::TensorImpl* impl = impl_at(params, i + kMetaAhead); impl != nullptr && impl->autograd_meta()) {
        __builtin_prefetch(impl->autograd_meta());
      }
    }
    if (i + kGradAhead < n) {
      if (const c10::TensorImpl* impl = impl_at(params, i + kGradAhead); impl != nullptr && impl->autograd_meta()) {
        if (const at::Tensor& grad = impl->autograd_meta()->grad(); grad.defined()) {
          prefetch_impl(grad);
        }
      }
    }
  }

  // The TensorImpl of entry i of `params`, or null for an entry that is not a tensor (gather's check
  // names it when it gets there).
  static const c10::TensorImpl* impl_at(const py::list& params, size_t i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), static_cast<Py_ssize_t>(i));
    return THPVariable_Check(p) ? THPVariable_Unpack(p).unsafeGetTensorImpl() : nullptr;
  }

  const py::object names_;
  std::vector<py::object> kept_;  // the parameters named by param_names_, kept alive (see the NOTE)
  py::tuple param_names_;
  std::vector<bool> with_grad_;  // which of them had a gradient when grad_names_ was made
  py::tuple grad_names_;
};

}  // namespace

void bind_param_grads(py::module_& m) {
  py::class_<ParamGrads>(m, "ParamGrads",
                         "The parameters a watch's step-end pass reads, with their gradients and names (see NOTE: [The "
                         "pass's parameters in C++]).")
      .def(py::init<py::object>(), py::arg("names"))
      .def("gather", &ParamGrads::gather, py::arg("source"), py::arg("groups"))
      .def("forget", &ParamGrads::forget,
           "Asks for the names again at the next gather (the model changed: NOTE: [A model changed after watch()]).");
}

}  // namespace nanfast::python

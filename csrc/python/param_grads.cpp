// nanfast._C.ParamGrads: the parameters a watch's step-end pass reads, with their gradients and names.
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

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
// parameter.
class ParamGrads {
 public:
  // names: id(parameter) -> its name in the model; others are named "param[i]" (i: position in the list).
  explicit ParamGrads(py::dict names) : names_(std::move(names)) {}

  // The parameters of `source` (optimizer.param_groups, a list of dicts with "params", when `groups`;
  // else a list of parameters) as (parameters, their names, the stored values of the gradients that
  // are set, those gradients' parameter names). A sparse gradient gives its stored values, which
  // scaling in place scales (Watch.clip_grad_norm_); a COO one stays uncoalesced (coalescing syncs the
  // host on CUDA), so every non-finite entry is counted.
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
    py::list names;
    for (size_t i = 0; i < params.size(); ++i) {
      kept_.push_back(py::reinterpret_borrow<py::object>(params[i]));
      const py::object id = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(params[i].ptr()));
      PyObject* name = PyDict_GetItemWithError(names_.ptr(), id.ptr());  // borrowed
      if (name == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      names.append(name != nullptr && PyObject_IsTrue(name) == 1 ? py::reinterpret_borrow<py::object>(name)
                                                                  : py::str("param[" + std::to_string(i) + "]"));
    }
    param_names_ = py::tuple(names);
    with_grad_.clear();
  }

  const py::dict names_;
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
      .def(py::init<py::dict>(), py::arg("names"))
      .def("gather", &ParamGrads::gather, py::arg("source"), py::arg("groups"));
}

}  // namespace nanfast::python

// nanfast._C.BufferSlots: a model's buffers, by (module, name), read in one loop; and
// nanfast._C.copy_tensors, which copies them to and from their twins.
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/_foreach_copy.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include "bindings.h"

namespace nanfast::python {
namespace {

// NOTE: [Buffers read in one loop]
// The watch's undo of a bad step (nanfast/watcher/restore.py) notes every module buffer with its
// version counter when a step begins and looks again when it ends: two walks over the model's buffers
// a step (60 on ResNet-18), each a dict lookup and a version read per buffer, in Python 0.1-0.3 ms a
// step at the step's boundaries, where every line pays cold caches. The walks are these loops.
class BufferSlots {
 public:
  // modules[i]: the module holding slot i; names[i]: the buffer's name in its `_buffers` (looked up anew
  // at each walk, as the Python it replaces did).
  BufferSlots(std::vector<py::object> modules, std::vector<py::str> names)
      : modules_(std::move(modules)), names_(std::move(names)) {
    TORCH_CHECK(modules_.size() == names_.size(), "nanfast._C.BufferSlots: ", modules_.size(), " modules for ",
                names_.size(), " names");
  }

  // Each slot's object now (None where the name is missing) and its version counter (-1 for anything
  // but a tensor with one: None, an inference tensor).
  std::pair<py::list, std::vector<int64_t>> state() const {
    py::list objects;
    std::vector<int64_t> versions;
    versions.reserve(modules_.size());
    Walk walk;
    for (size_t i = 0; i < modules_.size(); ++i) {
      const py::handle now = lookup(i, walk);
      objects.append(now);
      versions.push_back(version(now));
    }
    return {objects, versions};
  }

  // Against a state() taken earlier (`objects`, `versions`): the slots whose buffer is now another
  // object (re-assigned, or removed), and those changed in place since (same tensor, another version).
  std::pair<std::vector<int64_t>, std::vector<int64_t>> changed(const py::list& objects,
                                                                 const std::vector<int64_t>& versions) const {
    TORCH_CHECK(objects.size() == modules_.size() && versions.size() == modules_.size(),
                "nanfast._C.BufferSlots.changed: a state of ", objects.size(), " slots for ", modules_.size());
    std::vector<int64_t> reassigned;
    std::vector<int64_t> in_place;
    Walk walk;
    for (size_t i = 0; i < modules_.size(); ++i) {
      const py::handle now = lookup(i, walk);
      if (now.ptr() != objects[i].ptr()) {
        reassigned.push_back(static_cast<int64_t>(i));
      } else if (versions[i] >= 0 && version(now) != versions[i]) {
        in_place.push_back(static_cast<int64_t>(i));
      }
    }
    return {reassigned, in_place};
  }

 private:
  // One walk's module whose `_buffers` was read last: a module's slots are consecutive (a BatchNorm has
  // three), so its dict is read once per walk, not once per buffer.
  struct Walk {
    PyObject* module = nullptr;
    py::object buffers;
  };

  // modules[i]._buffers.get(names[i]): borrowed, valid while the dict holds it (the walk keeps no
  // reference past its loop but in the list it returns).
  py::handle lookup(size_t i, Walk& walk) const {
    if (walk.module != modules_[i].ptr()) {
      walk.buffers = modules_[i].attr("_buffers");
      walk.module = modules_[i].ptr();
    }
    PyObject* found = PyDict_GetItemWithError(walk.buffers.ptr(), names_[i].ptr());
    if (found == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return found != nullptr ? py::handle(found) : py::none();
  }

  static int64_t version(py::handle obj) {
    if (!THPVariable_Check(obj.ptr())) {
      return -1;
    }
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    return t.is_inference() ? -1 : static_cast<int64_t>(t._version());
  }

  const std::vector<py::object> modules_;
  const std::vector<py::str> names_;
};

// NOTE: [Small copies without the dispatcher]
// The undo copies the model's buffers into their twins at every step's start (nanfast/watcher/restore.py):
// on ResNet-18, 60 tensors of a few hundred bytes (BatchNorm statistics and counters). _foreach_copy_ on
// a CPU copies them one by one through the dispatcher and a TensorIterator each, 79 us a step inside a
// ResNet-18 step. A pair of small dense CPU tensors with one dtype and shape is a memcpy here (the
// target's version bumped, as copy_ would); the other pairs go to one _foreach_copy_ (one launch on CUDA;
// on a CPU, a tensor of a grain or more is copied by several threads, as a rollback's snapshot is).
bool plain_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t.is_neg() && !t.is_conj() &&
      !t.is_quantized() && t.numel() < at::internal::GRAIN_SIZE;
}

void copy_tensors(py::handle targets, py::handle sources, bool non_blocking) {
  const BorrowedTensors dst("nanfast._C.copy_tensors", targets);
  const BorrowedTensors src("nanfast._C.copy_tensors", sources);
  TORCH_CHECK(dst.list().size() == src.list().size(), "nanfast._C.copy_tensors: ", dst.list().size(),
              " targets for ", src.list().size(), " sources");
  std::vector<at::Tensor> other_dst;
  std::vector<at::Tensor> other_src;
  // Named lists: an element's reference taken through a temporary ArrayRef makes GCC 13 and later warn
  // (-Wdangling-reference), an error under NANFAST_WERROR.
  const at::TensorList dsts = dst.list();
  const at::TensorList srcs = src.list();
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& d = dsts[i];
    const at::Tensor& s = srcs[i];
    if (plain_cpu(d) && plain_cpu(s) && d.scalar_type() == s.scalar_type() && d.sizes() == s.sizes()) {
      if (d.nbytes() > 0 && !d.is_same(s)) {
        std::memcpy(d.data_ptr(), s.const_data_ptr(), d.nbytes());
      }
      torch::autograd::impl::bump_version(d);
    } else {
      other_dst.push_back(d);
      other_src.push_back(s);
    }
  }
  if (!other_dst.empty()) {
    at::_foreach_copy_(other_dst, other_src, non_blocking);
  }
}

}  // namespace

void bind_buffer_slots(py::module_& m) {
  m.def("copy_tensors", &copy_tensors,
        "targets[i].copy_(sources[i]) for each i: a memcpy for dense CPU tensors of one dtype and shape, "
        "_foreach_copy_ for the others (see NOTE: [Small copies without the dispatcher]).",
        py::arg("targets"), py::arg("sources"), py::arg("non_blocking") = false);
  py::class_<BufferSlots>(m, "BufferSlots",
                          "A model's buffers by (module, name), read in one loop (see NOTE: [Buffers read in one "
                          "loop]).")
      .def(py::init<std::vector<py::object>, std::vector<py::str>>(), py::arg("modules"), py::arg("names"))
      .def("state", &BufferSlots::state)
      .def("changed", &BufferSlots::changed, py::arg("objects"), py::arg("versions"));
}

}  // namespace nanfast::python

// nanfast._C.BufferSlots: a model's buffers, by (module, name), read in one loop.
#include <utility>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

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
    for (size_t i = 0; i < modules_.size(); ++i) {
      const py::handle now = lookup(i);
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
    for (size_t i = 0; i < modules_.size(); ++i) {
      const py::handle now = lookup(i);
      if (now.ptr() != objects[i].ptr()) {
        reassigned.push_back(static_cast<int64_t>(i));
      } else if (versions[i] >= 0 && version(now) != versions[i]) {
        in_place.push_back(static_cast<int64_t>(i));
      }
    }
    return {reassigned, in_place};
  }

 private:
  // modules[i]._buffers.get(names[i]): borrowed, valid while the dict holds it (the walk keeps no
  // reference past its loop but in the list it returns).
  py::handle lookup(size_t i) const {
    const py::object buffers = modules_[i].attr("_buffers");
    PyObject* found = PyDict_GetItemWithError(buffers.ptr(), names_[i].ptr());
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

}  // namespace

void bind_buffer_slots(py::module_& m) {
  py::class_<BufferSlots>(m, "BufferSlots",
                          "A model's buffers by (module, name), read in one loop (see NOTE: [Buffers read in one "
                          "loop]).")
      .def(py::init<std::vector<py::object>, std::vector<py::str>>(), py::arg("modules"), py::arg("names"))
      .def("state", &BufferSlots::state)
      .def("changed", &BufferSlots::changed, py::arg("objects"), py::arg("versions"));
}

}  // namespace nanfast::python

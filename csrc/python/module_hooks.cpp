// The bindings of nanfast._C.ModuleHooks and nanfast._C.WatchSite (module_hooks.h), and
// nanfast._C.plain_floating_tensors.
#include "module_hooks.h"

namespace nanfast::python {

// The floating and complex strided tensors in `obj` when it is a plain Tensor (or Parameter), or a
// tuple or list of those and None: what most modules take and return. None for anything else (a
// subclass, a dict, a nesting, a floating sparse tensor: read through its values), which
// nanfast.watcher.inputs.walked_tensors walks in Python with the one container walker; the same
// tensors in the same order either way. The watch calls it twice per module call, right after the
// module's own kernels, where each Python line pays cold caches.
py::object plain_floating_tensors(py::handle obj) {
  enum class Kind { skipped, wanted, walked };
  auto kind = [](PyObject* item) {
    const at::Tensor& t = THPVariable_Unpack(item);
    if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
      return Kind::skipped;
    }
    switch (t.layout()) {
      case at::kStrided:
        return Kind::wanted;
      case at::kSparse:
      case at::kSparseCsr:
      case at::kSparseCsc:
      case at::kSparseBsr:
      case at::kSparseBsc:
        return Kind::walked;
      default:
        return Kind::skipped;
    }
  };
  py::list found;
  if (THPVariable_CheckExact(obj.ptr())) {
    const Kind k = kind(obj.ptr());
    if (k == Kind::walked) {
      return py::none();
    }
    if (k == Kind::wanted) {
      found.append(obj);
    }
    return found;
  }
  const bool tuple = PyTuple_CheckExact(obj.ptr());
  if (!tuple && !PyList_CheckExact(obj.ptr())) {
    return py::none();
  }
  const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(obj.ptr()) : PyList_GET_SIZE(obj.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = tuple ? PyTuple_GET_ITEM(obj.ptr(), i) : PyList_GET_ITEM(obj.ptr(), i);
    if (item == Py_None) {
      continue;
    }
    if (!THPVariable_CheckExact(item)) {
      return py::none();
    }
    const Kind k = kind(item);
    if (k == Kind::walked) {
      return py::none();
    }
    if (k == Kind::wanted) {
      found.append(item);
    }
  }
  return found;
}

void bind_module_hooks(py::module_& m) {
  m.def("transformed", &transformed,
        "Whether a torch.func transform is running (NOTE: [The watch under torch.func]).");
  m.def("plain_floating_tensors", &plain_floating_tensors,
        "The floating and complex strided tensors of a Tensor, or of a tuple or list of Tensors and None; None for "
        "any other object.",
        py::arg("obj"));
  py::class_<Site>(m, "WatchSite", "A place nanfast.watch records slots for: a module, the input, the output, a loss.")
      .def(py::init<std::string, std::string, bool, bool>(), py::arg("name"), py::arg("module_class"),
           py::arg("ignored"), py::arg("keeps_in_place") = false)
      .def_readonly("name", &Site::name)
      .def_readonly("module_class", &Site::module_class)
      .def_readonly("ignored", &Site::ignored)
      .def_readwrite("calls", &Site::calls)
      .def_readwrite("forward_id", &Site::forward_id);
  py::class_<ModuleHooks>(m, "ModuleHooks",
                          "What nanfast.watch's module hooks do at each call (see NOTE: [Module hooks in C++]).")
      .def(py::init<py::object, py::object, py::object, py::object, bool, bool>(), py::arg("recorder"),
           py::arg("walk"), py::arg("recomputation"), py::arg("outside"), py::arg("check_grads"),
           py::arg("profiled") = false)
      .def(
          "enter",
          [](ModuleHooks& hooks, py::handle site, py::handle args, bool recomputed) {
            hooks.enter(site, site.cast<Site&>(), args, recomputed);
          },
          py::arg("site"), py::arg("args"), py::arg("recomputed") = false)
      .def("hook_grads", &ModuleHooks::hook_grads, py::arg("obj"), py::arg("phase"), py::arg("site"), py::arg("call"))
      .def(
          "check_output",
          [](ModuleHooks& hooks, py::str phase, py::handle site, py::handle output, py::handle walked) {
            return hooks.check_output(phase, site, site.cast<const Site&>(), output, walked);
          },
          py::arg("phase"), py::arg("site"), py::arg("output"), py::arg("walked") = py::none())
      .def("slot", &ModuleHooks::slot, py::arg("phase"), py::arg("site"), py::arg("call"))
      .def("forget", &ModuleHooks::forget)
      .def("new_step", &ModuleHooks::new_step, py::arg("slots"), py::arg("outputs"), py::arg("checked"))
      .def_readonly("seconds", &ModuleHooks::seconds)
      .def_readwrite("active", &ModuleHooks::active)
      .def_readwrite("in_forward", &ModuleHooks::in_forward)
      .def("enter_forward", &ModuleHooks::enter_forward)
      .def_readwrite("forward_id", &ModuleHooks::forward_id)
      .def_readwrite("microbatch", &ModuleHooks::microbatch)
      .def_readwrite("slots", &ModuleHooks::slots);
}

}  // namespace nanfast::python

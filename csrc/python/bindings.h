#pragma once
// What the Python bindings of nanfast._C share (csrc/python/): borrowed input lists and the unboxed
// operator handles.

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

namespace nanfast::python {

namespace py = pybind11;

// pybind11's types are hidden: so must be the classes that hold them.
#if defined(__GNUC__)
#define NANFAST_HIDDEN __attribute__((visibility("hidden")))
#else
#define NANFAST_HIDDEN
#endif

// NOTE: [Borrowed inputs]
// Copying a Tensor that has a Python object increfs that object too (PyObject preservation, a
// GIL-guarded call), and releasing the copy decrefs it: with thousands of small tensors the copies
// cost more than reading the data. The bindings hold the entries in a tuple for the whole call (no
// other thread can drop them while the GIL is released) and give the kernels borrowed Tensors,
// which touch no reference count.
class NANFAST_HIDDEN BorrowedTensors {
 public:
  BorrowedTensors(const char* api, py::handle sequence);
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;
  ~BorrowedTensors();

  at::TensorList list() const {
    return tensors_;
  }

  // Raises ValueError naming the first entry that is a lazy module's parameter or buffer before its
  // first forward (see NOTE: [Lazy modules' uninitialized parameters]).
  void refuse_uninitialized(const char* api) const;

 private:
  py::tuple owner_;
  std::vector<at::Tensor> tensors_;
};

using StatsOp = c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList)>;

// torch.ops.nanfast.stats, called unboxed (see NOTE: [Unboxed entry points]).
const StatsOp& stats_op();

// torch.ops.nanfast.stats over tensors on any number of devices: one call per device, rows in input
// order, results on `device`. Needs at least one tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_on(at::TensorList tensors, at::Device device);

// The plain tensors holding the values of `tensors` in `out` and, for each, the index of the entry of
// `tensors` it belongs to in `owners`, and true, where one of them is a Python tensor subclass or a
// strided nested tensor (see NOTE: [Tensor subclasses read through their plain tensors]); false, nothing
// written and no GIL taken, where none is.
bool plain_parts(at::TensorList tensors, std::vector<at::Tensor>& out, std::vector<int64_t>& owners);

// The rows (counts, norm, max |x|) of `n` entries from those of their parts, part k of entry owners[k]
// (csrc/python/plain_parts.cpp); also nanfast._C.merge_rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_rows(const at::Tensor& counts, const at::Tensor& norm,
                                                          const at::Tensor& absmax, const at::Tensor& owners,
                                                          int64_t n);

// Whether `tensors` hold a tensor subclass that names the plain tensors holding its values; with the GIL.
bool holds_wrapper_subclass(at::TensorList tensors);

// nanfast.stats of such a list, for `api`: each entry through its plain parts, every one of which must
// be readable (NOTE: [Entries read through their parts must all be readable]); with the GIL.
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_through_parts(const char* api, at::TensorList tensors);

// Defines nanfast._C.BufferSlots (csrc/python/buffer_slots.cpp).
void bind_buffer_slots(py::module_& m);

// Defines nanfast._C.ParamGrads (csrc/python/param_grads.cpp).
void bind_param_grads(py::module_& m);

// Defines nanfast._C.SpikeWindows (csrc/python/spike_windows.cpp).
void bind_spike_windows(py::module_& m);

// Defines nanfast._C.WatchRecorder (csrc/python/watch_recorder.cpp).
void bind_watch_recorder(py::module_& m);

// The floating and complex strided tensors of a Tensor, or of a tuple or list of Tensors and None; None
// for any other object (csrc/python/module_hooks.cpp).
py::object plain_floating_tensors(py::handle obj);

// Defines nanfast._C.WatchSite, nanfast._C.ModuleHooks (csrc/python/module_hooks.h) and
// nanfast._C.plain_floating_tensors (csrc/python/module_hooks.cpp).
void bind_module_hooks(py::module_& m);

// Defines nanfast._C.module_pre_hook, module_hook, hook_module, unhook_module and module_hooked
// (csrc/python/hooked_modules.cpp).
void bind_hooked_modules(py::module_& m);

}  // namespace nanfast::python

// The Python extension module nanfast._C: importing it registers the operators (torch.ops.nanfast)
// and exposes the CPU instruction-set switch used by tests and benchmarks.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "cpu/run_kernels.h"

namespace {

namespace py = pybind11;

// NOTE: [Unboxed entry points]
// torch.ops.nanfast.* goes through the boxed call path: every list entry becomes an IValue, then a
// Tensor again. These bindings make the same dispatcher call, unboxed (dispatch modes, fake tensors
// and the fallthroughs all apply as usual); nanfast.stats and nanfast.any_nonfinite use them in eager
// mode and torch.ops.nanfast.* under torch.compile.
//
// NOTE: [Borrowed inputs]
// Copying a Tensor that has a Python object increfs that object too (PyObject preservation, a
// GIL-guarded call), and releasing the copy decrefs it: with thousands of small tensors the copies
// cost more than reading the data. The bindings hold the entries in a tuple for the whole call (no
// other thread can drop them while the GIL is released) and give the kernels borrowed Tensors,
// which touch no reference count.
class BorrowedTensors {
 public:
  BorrowedTensors(const char* api, py::handle sequence)
      : owner_(py::reinterpret_steal<py::tuple>(PySequence_Tuple(sequence.ptr()))) {
    if (!owner_) {
      throw py::error_already_set();
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(owner_.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(owner_.ptr(), i);
      if (!THPVariable_Check(item)) {
        throw py::type_error(std::string(api) + ": entry " + std::to_string(i) + " is of type " +
                             Py_TYPE(item)->tp_name + ", not a Tensor");
      }
    }
    // Nothing below throws once the space is reserved: a borrow must never reach the vector's own
    // destructor, which would release a reference it does not hold.
    tensors_.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      tensors_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(PyTuple_GET_ITEM(owner_.ptr(), i))));
    }
  }
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;
  ~BorrowedTensors() {
    for (at::Tensor& t : tensors_) {
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
  }

  at::TensorList list() const {
    return tensors_;
  }

 private:
  py::tuple owner_;
  std::vector<at::Tensor> tensors_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_stats(py::handle tensors) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("nanfast::stats", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList)>();
  const BorrowedTensors inputs("nanfast.stats", tensors);
  py::gil_scoped_release no_gil;
  return op.call(inputs.list());
}

at::Tensor call_any_nonfinite(py::handle tensors) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("nanfast::any_nonfinite", "").typed<at::Tensor(at::TensorList)>();
  const BorrowedTensors inputs("nanfast.any_nonfinite", tensors);
  py::gil_scoped_release no_gil;
  return op.call(inputs.list());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("stats", &call_stats, "torch.ops.nanfast.stats without the boxed call (see NOTE: [Unboxed entry points]).",
        py::arg("tensors"));
  m.def("any_nonfinite", &call_any_nonfinite, "torch.ops.nanfast.any_nonfinite without the boxed call.",
        py::arg("tensors"));
  m.def("cpu_isa", [] { return std::string(nanfast::cpu::simd_kernels().isa); },
        "The instruction set of the CPU kernels in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", [](const std::string& isa) { return std::string(nanfast::cpu::set_cpu_isa(isa.c_str())); },
        "Caps the CPU kernels' instruction set (never above what the processor has); returns the one in use.",
        py::arg("isa"));
}

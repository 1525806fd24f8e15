// The Python extension module nanfast._C: importing it registers the operators (torch.ops.nanfast)
// and exposes the CPU instruction-set switch used by tests and benchmarks.
#include <torch/extension.h>

#include "cpu/run_kernels.h"

namespace {

// NOTE: [Unboxed entry points]
// torch.ops.nanfast.* goes through the boxed call path: every list entry becomes an IValue, then a
// Tensor again, and each copy's release takes the GIL-guarded PyObject path; with thousands of small
// tensors that costs more than reading them. These bindings make the same dispatcher call, unboxed
// (dispatch modes, fake tensors and the fallthroughs all apply as usual); nanfast.stats and
// nanfast.any_nonfinite use them in eager mode and torch.ops.nanfast.* under torch.compile.
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_stats(const std::vector<at::Tensor>& tensors) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("nanfast::stats", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList)>();
  pybind11::gil_scoped_release no_gil;
  return op.call(tensors);
}

at::Tensor call_any_nonfinite(const std::vector<at::Tensor>& tensors) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("nanfast::any_nonfinite", "").typed<at::Tensor(at::TensorList)>();
  pybind11::gil_scoped_release no_gil;
  return op.call(tensors);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("stats", &call_stats, "torch.ops.nanfast.stats without the boxed call (see NOTE: [Unboxed entry points]).",
        pybind11::arg("tensors"));
  m.def("any_nonfinite", &call_any_nonfinite, "torch.ops.nanfast.any_nonfinite without the boxed call.",
        pybind11::arg("tensors"));
  m.def("cpu_isa", [] { return std::string(nanfast::cpu::simd_kernels().isa); },
        "The instruction set of the CPU kernels in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", [](const std::string& isa) { return std::string(nanfast::cpu::set_cpu_isa(isa.c_str())); },
        "Caps the CPU kernels' instruction set (never above what the processor has); returns the one in use.",
        pybind11::arg("isa"));
}

// The Python extension module nanfast._C: importing it registers the operators (torch.ops.nanfast)
// and exposes the CPU instruction-set switch used by tests and benchmarks.
#include <torch/extension.h>

#include "cpu/run_kernels.h"

PYBIND11_MODULE(_C, m) {
  m.def("cpu_isa", [] { return std::string(nanfast::cpu::simd_kernels().isa); },
        "The instruction set of the CPU kernels in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", [](const std::string& isa) { return std::string(nanfast::cpu::set_cpu_isa(isa.c_str())); },
        "Caps the CPU kernels' instruction set (never above what the processor has); returns the one in use.",
        pybind11::arg("isa"));
}

// Picks the SIMD kernel table at run time (see NOTE: [One SIMD body, several ISAs]).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

#include "simd_kernels.h"

namespace nanfast::cpu {
namespace {

const SimdKernels* best_supported() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return &avx512_kernels();
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return &avx2_kernels();
  }
#endif
  return &baseline_kernels();
}

const SimdKernels* capped(const char* isa) {
  const SimdKernels* best = best_supported();
  const SimdKernels* order[] = {&avx512_kernels(), &avx2_kernels(), &baseline_kernels()};
  const char* names[] = {"avx512", "avx2", "baseline"};
  for (int k = 0; k < 3; ++k) {
    if (std::strcmp(isa, names[k]) == 0) {
      // The cap only lowers: asking for more than the processor has keeps the best it has.
      for (int j = 0; j < 3; ++j) {
        if (order[j] == best) {
          return order[j < k ? k : j];
        }
      }
    }
  }
  TORCH_CHECK(false, "nanfast: unknown CPU instruction set '", isa, "' (expected avx512, avx2 or baseline)");
}

std::atomic<const SimdKernels*>& current() {
  static std::atomic<const SimdKernels*> kernels{[] {
    const char* env = std::getenv("NANFAST_CPU_ISA");
    return env != nullptr && *env != '\0' ? capped(env) : best_supported();
  }()};
  return kernels;
}

}  // namespace

const SimdKernels& simd_kernels() {
  return *current().load(std::memory_order_relaxed);
}

const char* set_cpu_isa(const char* isa) {
  current().store(capped(isa), std::memory_order_relaxed);
  return simd_kernels().isa;
}

}  // namespace nanfast::cpu

// Picks the SIMD kernel table at run time (see NOTE: [One SIMD body, several ISAs]).
#include <atomic>
#include <cstdlib>
#include <cstring>

#include <strings.h>

#include <c10/util/Exception.h>

#include "simd_kernels.h"

namespace nanfast::cpu {
namespace {

constexpr int kNumIsas = 3;
const char* const kIsaNames[kNumIsas] = {"avx512", "avx2", "baseline"};  // best first

const SimdKernels& kernels_of(int isa, bool prefetch) {
  switch (isa) {
#if defined(__x86_64__)  // elsewhere best_supported() and capped() give the baseline only
    case 0:
      return avx512::kernels(prefetch);
    case 1:
      return avx2::kernels(prefetch);
#endif
    default:
      return baseline::kernels(prefetch);
  }
}

// `where` names what gave `isa` (the environment variable, or the function) in the error.
int isa_index(const char* isa, const char* where) {
  for (int k = 0; k < kNumIsas; ++k) {
    if (strcasecmp(isa, kIsaNames[k]) == 0) {
      return k;
    }
  }
  TORCH_CHECK(false, "nanfast: ", where, " is '", isa, "', not a CPU instruction set (expected avx512, avx2 or baseline)");
}

int best_supported() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return 0;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return 1;
  }
#endif
  return 2;
}

// The index of `isa`, capped: asking for more than the processor has keeps the best it has.
int capped(const char* isa, const char* where) {
  const int asked = isa_index(isa, where);
  const int best = best_supported();
  return asked < best ? best : asked;
}

// See NOTE: [Prefetching the next page]: on unless NANFAST_CPU_PREFETCH=0.
bool default_prefetch() {
  const char* env = std::getenv("NANFAST_CPU_PREFETCH");
  if (env != nullptr && *env != '\0') {
    TORCH_CHECK(
        std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, "nanfast: NANFAST_CPU_PREFETCH is '", env,
        "' (expected 0 or 1)");
    return *env == '1';
  }
  return true;
}

std::atomic<const SimdKernels*>& current() {
  static std::atomic<const SimdKernels*> kernels{[] {
    const char* env = std::getenv("NANFAST_CPU_ISA");
    return &kernels_of(env != nullptr && *env != '\0' ? capped(env, "NANFAST_CPU_ISA") : best_supported(),
                       default_prefetch());
  }()};
  return kernels;
}

}  // namespace

const SimdKernels& simd_kernels() {
  return *current().load(std::memory_order_relaxed);
}

const char* set_cpu_isa(const char* isa) {
  current().store(&kernels_of(capped(isa, "set_cpu_isa's isa"), simd_kernels().prefetch), std::memory_order_relaxed);
  return simd_kernels().isa;
}

bool set_cpu_prefetch(bool on) {
  current().store(&kernels_of(isa_index(simd_kernels().isa, "the current table's"), on), std::memory_order_relaxed);
  return simd_kernels().prefetch;
}

}  // namespace nanfast::cpu

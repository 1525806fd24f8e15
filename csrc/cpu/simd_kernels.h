#pragma once
// Kernels over one run of elements (contiguous, or a fixed stride), the unit of work of the CPU path.

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../bit_cast.h"  // for simd_body.h, which must include no header of inline code
#include "../nonfinite.h"

namespace nanfast::cpu {

// Exact path: the shared per-element code of nonfinite.h, one element at a time. It handles every
// dtype and stride; the SIMD kernels hand it whatever their fast path cannot take as it is.
template <typename T>
Partial precise_stats(const T* data, int64_t n, int64_t stride);
template <typename T>
bool precise_any_nonfinite(const T* data, int64_t n, int64_t stride);

#define NANFAST_FOR_EACH_SIMD_TYPE(_) \
  _(double)                           \
  _(float)                            \
  _(c10::Half)                        \
  _(c10::BFloat16)

#define NANFAST_DECLARE_PRECISE(T)                                          \
  extern template Partial precise_stats<T>(const T*, int64_t, int64_t); \
  extern template bool precise_any_nonfinite<T>(const T*, int64_t, int64_t);
NANFAST_FOR_EACH_SIMD_TYPE(NANFAST_DECLARE_PRECISE)
#undef NANFAST_DECLARE_PRECISE

// Contiguous-run kernels of one instruction set (see NOTE: [One SIMD body, several ISAs]).
struct SimdKernels {
  const char* isa;
  bool prefetch;  // see NOTE: [Prefetching the next page]
  Partial (*stats_f64)(const double*, int64_t);
  Partial (*stats_f32)(const float*, int64_t);
  Partial (*stats_f16)(const c10::Half*, int64_t);
  Partial (*stats_bf16)(const c10::BFloat16*, int64_t);
  bool (*any_f64)(const double*, int64_t);
  bool (*any_f32)(const float*, int64_t);
  bool (*any_f16)(const c10::Half*, int64_t);
  bool (*any_bf16)(const c10::BFloat16*, int64_t);
};

// Each ISA's table (simd_body.h compiled in simd_<isa>.cpp); avx2 and avx512 exist on x86-64 only.
namespace baseline {
const SimdKernels& kernels(bool prefetch);
}
namespace avx2 {
const SimdKernels& kernels(bool prefetch);
}
namespace avx512 {
const SimdKernels& kernels(bool prefetch);
}

// The kernels in use: the best the processor supports, capped by NANFAST_CPU_ISA or set_cpu_isa(),
// prefetching or not as NANFAST_CPU_PREFETCH, set_cpu_prefetch() or the processor's vendor says.
const SimdKernels& simd_kernels();
// Caps the instruction set ("avx512", "avx2" or "baseline"); returns the one now in use.
const char* set_cpu_isa(const char* isa);
// Turns the software prefetches on or off; returns the setting now in use.
bool set_cpu_prefetch(bool on);

}  // namespace nanfast::cpu

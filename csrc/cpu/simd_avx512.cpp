// AVX-512 build of simd_body.h (see NOTE: [One SIMD body, several ISAs]).
#include "simd_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

#define NANFAST_ISA avx512
#define NANFAST_ISA_NAME "avx512"
#define NANFAST_VEC_BYTES 64
#include "simd_body.h"

namespace nanfast::cpu::avx512 {
namespace {
// GCC's _mm512_cvtph_ps passes an undefined vector as its (unused) merge source.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
vfloat load_half(const c10::Half* p) {
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
vfloat load_bf16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
}
#pragma GCC diagnostic pop
}  // namespace
}  // namespace nanfast::cpu::avx512

#pragma GCC pop_options

#endif  // __x86_64__

// AVX2 build of simd_body.h (see NOTE: [One SIMD body, several ISAs]).
#include "simd_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define NANFAST_ISA avx2
#define NANFAST_ISA_NAME "avx2"
#define NANFAST_VEC_BYTES 32
#include "simd_body.h"

namespace nanfast::cpu::avx2 {
namespace {
vfloat load_half(const c10::Half* p) {
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
vfloat load_bf16(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16);
}
}  // namespace
}  // namespace nanfast::cpu::avx2

#pragma GCC pop_options

#endif  // __x86_64__

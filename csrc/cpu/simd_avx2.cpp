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
// Element j goes to the top half of lane j (float's bits of a bfloat16) in one byte shuffle: both
// 128-bit halves hold the 8 elements (a broadcast load), each half picks its 4; the bottom halves
// are zeroed (index bit 7).
vfloat load_bf16(const c10::BFloat16* p) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i to_top = _mm256_setr_epi8(
      -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  return (vfloat)_mm256_shuffle_epi8(both, to_top);
}
}  // namespace
}  // namespace nanfast::cpu::avx2

#pragma GCC pop_options

#endif  // __x86_64__

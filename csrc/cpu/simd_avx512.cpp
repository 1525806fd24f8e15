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
// Element j goes to the top half of lane j (float's bits of a bfloat16) in one word permutation; the
// bottom halves are zeroed by the mask.
vfloat load_bf16(const c10::BFloat16* p) {
  const __m512i bits = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i to_top = _mm512_set_epi16(
      15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
  return (vfloat)_mm512_maskz_permutexvar_epi16(0xAAAAAAAA, to_top, bits);
}
#pragma GCC diagnostic pop
}  // namespace
}  // namespace nanfast::cpu::avx512

#pragma GCC pop_options

#endif  // __x86_64__

// Baseline build of simd_body.h: 16-byte vectors, which every x86-64 (SSE2) and ARMv8 (NEON) has.
#include "simd_kernels.h"

#define NANFAST_ISA baseline
#define NANFAST_ISA_NAME "baseline"
#define NANFAST_VEC_BYTES 16
#include "simd_body.h"

namespace nanfast::cpu::baseline {
namespace {
// No conversion instructions to count on: lane by lane.
template <typename T>
vfloat widen(const T* p) {
  vfloat v;
  for (int k = 0; k < kLanes<float>; ++k) {
    v[k] = static_cast<float>(p[k]);
  }
  return v;
}
vfloat load_half(const c10::Half* p) {
  return widen(p);
}
vfloat load_bf16(const c10::BFloat16* p) {
  return widen(p);
}
}  // namespace
}  // namespace nanfast::cpu::baseline

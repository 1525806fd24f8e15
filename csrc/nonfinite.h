#pragma once
// Per-element classification and accumulation, shared by the CPU and CUDA kernels.
// Everything here compiles for host and device; keep it free of ATen.

#include <cmath>
#include <cstdint>

#include <c10/macros/Macros.h>

#include "dtypes.h"

namespace nanfast {

// NOTE: [Partial statistics]
// Every kernel reduces a piece of a tensor to a Partial; pieces are merged in a fixed order, so
// results do not depend on the number of threads or blocks. The sum of squares is kept as
// `scale^2 * sumsq` with `scale` a power of two: float32/16/bf16 values square into double without
// overflow or loss, so for them scale stays 1. Only float64 values beyond 2^±kRescaleExponent can
// overflow (or underflow) a double square; a piece whose absmax is out of that range is summed a
// second time as (x / scale)^2 with scale = 2^exponent(absmax) (see needs_rescale()).
struct Partial {
  int64_t nan;
  int64_t posinf;
  int64_t neginf;
  double sumsq;
  double scale;
  double absmax;
};

constexpr int kRescaleExponent = 400;

C10_HOST_DEVICE inline Partial empty_partial() {
  return Partial{0, 0, 0, 0.0, 1.0, 0.0};
}

// NOTE: [Values of an element]
// The kernels read a tensor as torch counts it, in elements of its dtype, and reduce the values each
// element holds, widened to double (exactly, for every dtype but int64 and uint64 beyond 2^53). An
// element holds one value, except a float4_e2m1fn_x2 element: one byte packing two fp4 (e2m1) values,
// the first in bits 0-3 and the second in bits 4-7 (c10/util/Float4_e2m1fn_x2.h), both read. Its
// statistics are those of the unpacked values; numel stays the bytes torch counts.
template <typename T>
inline constexpr int kValuesPerElement = 1;

// Calls fn(v) for each value v of element x.
template <typename T, typename Fn>
C10_HOST_DEVICE inline void for_each_value(const T& x, const Fn& fn) {
  fn(static_cast<double>(x));
}

// One fp4 e2m1 value from its 4 bits (sign, 2 exponent bits with bias 1, 1 mantissa bit): 0, 0.5
// (subnormal), 1, 1.5, 2, 3, 4, 6 and their negatives; no NaN, no infinity.
C10_HOST_DEVICE inline double e2m1_value(unsigned bits) {
  const unsigned exponent = (bits >> 1) & 3;
  const unsigned mantissa = bits & 1;
  const double magnitude = exponent == 0 ? 0.5 * mantissa : 0.25 * ((2 + mantissa) << exponent);
  return bits & 8 ? -magnitude : magnitude;
}

template <>
inline constexpr int kValuesPerElement<c10::Float4_e2m1fn_x2> = 2;

template <typename Fn>
C10_HOST_DEVICE inline void for_each_value(const c10::Float4_e2m1fn_x2& x, const Fn& fn) {
  fn(e2m1_value(x.val_ & 0xFu));
  fn(e2m1_value(static_cast<unsigned>(x.val_) >> 4));
}

// First pass over a piece (scale is 1). x is a value of an element (see NOTE: [Values of an element]).
C10_HOST_DEVICE inline void accumulate(Partial& p, double x) {
  if (x != x) {
    ++p.nan;
  } else if (x == INFINITY) {
    ++p.posinf;
  } else if (x == -INFINITY) {
    ++p.neginf;
  } else {
    p.sumsq += x * x;
    const double a = fabs(x);
    p.absmax = a > p.absmax ? a : p.absmax;  // x is finite here: no fmax (a libm call on the host)
  }
}

C10_HOST_DEVICE inline bool is_nonfinite(double x) {
  return !(fabs(x) < INFINITY);
}

C10_HOST_DEVICE inline bool needs_rescale(const Partial& p) {
  return p.scale == 1.0 && p.absmax > 0.0 &&
      (p.absmax > ldexp(1.0, kRescaleExponent) || p.absmax < ldexp(1.0, -kRescaleExponent));
}

// Prepare p for the second pass over its piece: squares are re-summed relative to 2^exponent(absmax).
C10_HOST_DEVICE inline void begin_rescaled_pass(Partial& p) {
  int exponent = 0;
  frexp(p.absmax, &exponent);
  // The scale and its reciprocal must be finite normal doubles (absmax may be near DBL_MAX or subnormal).
  exponent = exponent > 1022 ? 1022 : (exponent < -1021 ? -1021 : exponent);
  p.scale = ldexp(1.0, exponent);
  p.sumsq = 0.0;
}

C10_HOST_DEVICE inline void accumulate_rescaled(Partial& p, double x) {
  if (fabs(x) < INFINITY) {
    const double y = x * (1.0 / p.scale);
    p.sumsq += y * y;
  }
}

C10_HOST_DEVICE inline void merge(Partial& a, const Partial& b) {
  a.nan += b.nan;
  a.posinf += b.posinf;
  a.neginf += b.neginf;
  a.absmax = b.absmax > a.absmax ? b.absmax : a.absmax;
  if (b.sumsq == 0.0) {
    // nothing to add; a keeps its scale
  } else if (a.sumsq == 0.0) {
    a.sumsq = b.sumsq;  // an empty a must not impose its scale (it would underflow b's squares)
    a.scale = b.scale;
  } else if (b.scale == a.scale) {
    a.sumsq += b.sumsq;
  } else if (b.scale < a.scale) {
    const double r = b.scale / a.scale;
    a.sumsq += b.sumsq * r * r;
  } else {
    const double r = a.scale / b.scale;
    a.sumsq = a.sumsq * r * r + b.sumsq;
    a.scale = b.scale;
  }
}

C10_HOST_DEVICE inline double l2_norm(const Partial& p) {
  return p.scale * sqrt(p.sumsq);
}

}  // namespace nanfast

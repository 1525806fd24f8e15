// NOTE: [One SIMD body, several ISAs]
// This file is included once per instruction set, by simd_<isa>.cpp, with NANFAST_ISA (a namespace
// name) and NANFAST_VEC_BYTES (the register width) defined, after its `#pragma GCC target(...)`.
// It is written with GCC vector extensions, so the same body compiles to AVX-512, AVX2 or SSE2 code
// although the build passes no -m flags; simd_kernels() picks a table by cpuid at run time. Include
// it only after every header with inline code: functions defined under the target pragma must not
// be emitted where another translation unit could link to them. The includer defines load_half()
// and load_bf16() (bfloat16 is the top half of a float32) with its ISA's conversions.
//
// NOTE: [Fast path and exact fallback]
// A run is scanned in segments of kSegment elements. The fast path reads registers, keeps a
// lane-wise absmax and sums squares: float-like inputs square in float 32 registers at a time,
// pairwise, and widen that sum to double (5 roundings: relative error below 3e-7); float64 squares
// in double.
// A non-finite value makes a sum of squares (or of x * 0) NaN or inf, so it is detected from the
// segment's sums rather than tested register by register. The fast sums are exact enough only
// while no square overflows or turns subnormal. A segment that holds a non-finite value, or whose
// absmax is above Simd<T>::kAbove, is summed again by precise_stats(), and so is every tail shorter
// than a register; a float-like segment whose absmax is in (0, kBelow) is summed again with squares
// in double lanes (a float64 one needs precise_stats' rescaling). The decision is per segment, so
// results stay deterministic.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace nanfast::cpu::NANFAST_ISA {
namespace {

constexpr int64_t kSegment = 4096;

typedef float vfloat __attribute__((vector_size(NANFAST_VEC_BYTES)));
typedef double vdouble __attribute__((vector_size(NANFAST_VEC_BYTES)));

vfloat load_half(const c10::Half* p);
vfloat load_bf16(const c10::BFloat16* p);

template <typename V>
inline V load_raw(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename T>
struct Simd;

template <>
struct Simd<double> {
  using vec = vdouble;
  static constexpr double kAbove = 0x1p400;
  static constexpr double kBelow = 0x1p-400;
  static vec load(const double* p) {
    return load_raw<vdouble>(p);
  }
};

struct FloatLike {
  using vec = vfloat;
  // Up to 32 squares are summed per lane in float: 32 * kAbove^2 = 2^125 < FLT_MAX, and kBelow^2 is
  // far from subnormal.
  static constexpr float kAbove = 0x1p60f;
  static constexpr float kBelow = 0x1p-40f;
};

template <>
struct Simd<float> : FloatLike {
  static vec load(const float* p) {
    return load_raw<vfloat>(p);
  }
};

template <>
struct Simd<c10::BFloat16> : FloatLike {
  static vec load(const c10::BFloat16* p) {
    return load_bf16(p);
  }
  static constexpr uint16_t kInfBits = 0x7f80;
  static uint32_t float_bits(uint16_t bits) {
    return uint32_t{bits} << 16;
  }
};

template <>
struct Simd<c10::Half> : FloatLike {
  static vec load(const c10::Half* p) {
    return load_half(p);
  }
  static constexpr uint16_t kInfBits = 0x7c00;
  static uint32_t float_bits(uint16_t bits) {
    return nanfast::bit_cast<uint32_t>(static_cast<float>(c10::Half(bits, c10::Half::from_bits())));
  }
};

template <typename T>
constexpr int kLanes = sizeof(typename Simd<T>::vec) / sizeof(typename Simd<T>::vec{}[0]);

// The signed integer vector with V's lane width.
template <typename V>
using Bits = decltype(V{} < V{});

// 16-bit lanes over a register's width: bfloat16 or float16 elements as they lie in memory.
typedef int16_t vbits16 __attribute__((vector_size(NANFAST_VEC_BYTES)));

// bfloat16 and float16, whose elements are read as vbits16 for their magnitudes (see narrow_abs_bits()).
template <typename T>
constexpr bool kNarrow = sizeof(T) == 2;

// |x| as bits: for non-negative floats (NaN included, above inf) integer order is float order, so
// magnitudes are compared with integer max, one instruction where a float compare-and-select is two.
template <typename V>
inline Bits<V> abs_bits(V x) {
  return (Bits<V>)x & ~(Bits<V>)(-V{});  // -V{} is -0.0 in every lane: the sign bits
}

template <typename V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

// NOTE: [16-bit floats read as 16-bit patterns]
// bfloat16 and float16 take their magnitudes (a segment's max |x|, hence the fast-or-precise decision
// and absmax) and any_nonfinite its NaN/inf from the 16-bit patterns in memory: sign bit cleared,
// integer max, two registers' worth of elements per instruction; only the squares use widened float
// registers. Cleared patterns order as magnitudes do (NaN above inf above every finite value), so the
// maxima, decisions and results are those of the widened registers, bit for bit. On the AMD EPYC of
// issue 19 (1 thread, 512 KB in L2), with the one-shuffle load_bf16 and to_doubles(): bfloat16 stats
// from 23 to 30 GB/s (AVX2) and 27 to 35 GB/s (AVX-512), any_nonfinite from 24-41 to 63-66 GB/s; GPT-2
// in bfloat16, 2 threads: see benchmarks/results/cpu-kernels-19.md.
//
// The magnitudes of 2 * kLanes<T> elements of a narrow type from p, as abs_bits() gives them for the
// same type, read without widening: one integer max per two registers of elements where abs_bits() of
// the widened ones takes four.
template <typename T>
inline vbits16 narrow_abs_bits(const T* p) {
  static_assert(kNarrow<T>);
  return load_raw<vbits16>(p) & 0x7fff;
}

template <size_t kShift, typename V, size_t... I>
inline V rotate_lanes(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, ((I + kShift) % sizeof...(I))...);
}

// The largest lane of the integer vector m: max over halves, log2(lanes) steps where a scalar loop
// would compare every lane (a cost per small tensor).
template <typename B, size_t kShift = sizeof(B) / sizeof(B{}[0]) / 2>
inline auto max_bits(B m) {
  if constexpr (kShift == 0) {
    return m[0];
  } else {
    return max_bits<B, kShift / 2>(vmax(m, rotate_lanes<kShift>(m, std::make_index_sequence<sizeof(B) / sizeof(B{}[0])>{})));
  }
}

// The largest of the magnitudes m (abs_bits() of vectors of V), as a double.
template <typename V>
inline double max_lane(Bits<V> m) {
  return nanfast::bit_cast<std::remove_cv_t<std::remove_reference_t<decltype(V{}[0])>>>(max_bits(m));
}

// A segment's largest magnitude: of its widened registers (wide), and for a narrow type of the 16-bit
// magnitudes of its blocks (narrow, unused otherwise).
template <typename T>
inline double segment_top(Bits<typename Simd<T>::vec> wide, vbits16 narrow) {
  if constexpr (kNarrow<T>) {
    const uint32_t widened = Simd<T>::float_bits(static_cast<uint16_t>(max_bits(narrow)));
    return nanfast::bit_cast<float>(std::max(static_cast<uint32_t>(max_bits(wide)), widened));
  } else {
    return max_lane<typename Simd<T>::vec>(wide);
  }
}

template <typename V>
inline double sum_lanes(V v) {
  double acc = v[0];
  for (unsigned k = 1; k < sizeof(V) / sizeof(v[0]); ++k) {
    acc += v[k];
  }
  return acc;
}

typedef double vdouble2 __attribute__((vector_size(2 * NANFAST_VEC_BYTES)));

// The lanes of s as doubles: its low half in lo, its high half in hi. The whole register is converted
// at once: GCC 12 converts half a register as two quarters and a merge, and spilled the accumulator
// of the AVX2 loop that calls it.
template <size_t... I>
inline void to_doubles(vfloat s, vdouble& lo, vdouble& hi, std::index_sequence<I...>) {
  const vdouble2 d = __builtin_convertvector(s, vdouble2);
  lo = __builtin_shufflevector(d, d, I...);
  hi = __builtin_shufflevector(d, d, (I + sizeof...(I))...);
}

inline void widen_add(vdouble& acc, vfloat s) {
  vdouble lo, hi;
  to_doubles(s, lo, hi, std::make_index_sequence<sizeof(vdouble) / sizeof(double)>{});
  acc += lo;
  acc += hi;
}

inline void widen_add_squares(vdouble& acc, vfloat x) {
  vdouble lo, hi;
  to_doubles(x, lo, hi, std::make_index_sequence<sizeof(vdouble) / sizeof(double)>{});
  acc += lo * lo + hi * hi;
}

// Squares in double: exact for any finite float, for segments whose magnitudes are too small to
// square in float (vanishing gradients) but need no rescaling.
template <typename T>
inline vdouble widened_sumsq(const T* p, int64_t vec_len) {
  vdouble acc = {};
  for (int64_t i = 0; i < vec_len; i += kLanes<T>) {
    widen_add_squares(acc, Simd<T>::load(p + i));
  }
  return acc;
}

inline void add_squares(vdouble& acc, vdouble s) {
  acc += s;
}

inline void add_squares(vdouble& acc, vfloat s) {
  widen_add(acc, s);
}

// The squares of 8 registers from p, summed pairwise (short dependency chains, 3 roundings); their
// magnitudes go into seg_max, or for a narrow type into seg_max16.
template <typename T>
inline typename Simd<T>::vec block_squares(const T* p, Bits<typename Simd<T>::vec>& seg_max, vbits16& seg_max16) {
  using S = Simd<T>;
  using vec = typename S::vec;
  constexpr int L = kLanes<T>;
  vec x[8];
  for (int k = 0; k < 8; ++k) {
    x[k] = S::load(p + k * L);
  }
  if constexpr (kNarrow<T>) {
    const vbits16 m01 = vmax(narrow_abs_bits(p), narrow_abs_bits(p + 2 * L));
    const vbits16 m23 = vmax(narrow_abs_bits(p + 4 * L), narrow_abs_bits(p + 6 * L));
    seg_max16 = vmax(seg_max16, vmax(m01, m23));
  } else {
    const Bits<vec> m01 = vmax(abs_bits(x[0]), abs_bits(x[1])), m23 = vmax(abs_bits(x[2]), abs_bits(x[3]));
    const Bits<vec> m45 = vmax(abs_bits(x[4]), abs_bits(x[5])), m67 = vmax(abs_bits(x[6]), abs_bits(x[7]));
    seg_max = vmax(seg_max, vmax(vmax(m01, m23), vmax(m45, m67)));
  }
  return ((x[0] * x[0] + x[1] * x[1]) + (x[2] * x[2] + x[3] * x[3])) +
      ((x[4] * x[4] + x[5] * x[5]) + (x[6] * x[6] + x[7] * x[7]));
}

// NOTE: [Prefetching the next page]
// The hardware prefetchers follow a stream only within a 4 KB page and restart at every new page;
// asking for the lines a page or two ahead keeps the next pages' reads in flight. Measured (4 KB
// ahead) on a 2-core Cascade Lake VM, 2 threads: stats over 500 MB of float32 went from 16.3-17.2
// to 18.5-19.0 GB/s, over bfloat16 from 13 to 19 GB/s; any_nonfinite from 18.2-18.6 to 20.5 GB/s.
// Prefetches past the end of the data are hints and never fault.
// On AMD they cost instead. On a 2-vCPU AMD EPYC (Zen 4) KVM guest, 2 threads, machine shared,
// seven runs of benchmarks/isa_ab.py: GPT-2 float32 stats with AVX2 read at 0.58-0.73x the read
// ceiling with them (median 0.66x) and 0.69-0.98x without (0.84x), AVX-512 likewise; bfloat16 showed
// no consistent difference; 5000 tensors of 1024 floats took 17% less CPU time without (median); the
// prefetch loop held a quarter of the kernel's perf samples (prefetches wait for miss buffers that
// the hardware prefetchers, which need no help there, keep busy). Details:
// benchmarks/results/cpu-isa-prefetch.md. So every kernel is compiled with and without them, and
// SimdKernels::prefetch says which. They were off by default on AMD processors until an idle VM of the
// same kind (session 27), timed with the same tensors read with and without them in turn in one
// process (12 alternating repeats), read faster with them everywhere it could tell: 498 MB of GPT-2
// float32 at 76 against 53 GB/s with AVX-512 and 52 against 49 GB/s with AVX2, 1 GB of float32 at 79
// against 56 and 51 against 49 GB/s, GPT-2 in bfloat16 at 74 against 69 and 55 against 51 GB/s;
// tensors of 0.1-4 MB just written, and 5000 of 1024 floats, within +-10% either way. The slowdown
// above was measured on a machine loaded 3-9x its two cores, where a prefetch waits for miss buffers
// that other processes hold; a machine shared so heavily can turn them off. So they are on by default
// everywhere; NANFAST_CPU_PREFETCH=0|1 or set_cpu_prefetch() decide otherwise. Results do not depend
// on it. How far ahead: two pages, not one. On the same kind of VM in a faster-memory phase (a read
// ceiling of 74-78 GB/s; session 29), builds with 4096, 8192 and 16384 bytes loaded in turn, one
// process each, nine alternating runs of `benchmarks/bench.py --workloads gpt2-fp32,gpt2-bf16` per
// instruction set, `stats` against the read ceiling (medians, lowest run): AVX2 float32 0.87x (0.77x)
// with 4096 against 0.94x (0.92x) with 8192, bfloat16 0.91x (0.87x) against 0.97x (0.88x); AVX-512
// float32 0.89x (0.79x) against 0.90x (0.84x), bfloat16 0.95x (0.80x) against 0.97x (0.87x); 16384
// (four runs) below 8192 everywhere. 5000 tensors of 1024 floats: 1.04 against 1.09 ms (four runs
// each, within their spread). Details: benchmarks/results/cpu-isa-prefetch.md, last section.
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kCacheLine = 64;

template <typename T>
inline void prefetch_ahead(const T* p, int64_t elements) {
  const char* ahead = reinterpret_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t b = 0; b < elements * static_cast<int64_t>(sizeof(T)); b += kCacheLine) {
    __builtin_prefetch(ahead + b);
  }
}

template <typename T, bool kPrefetch>
Partial stats_run(const T* data, int64_t n) {
  using S = Simd<T>;
  using vec = typename S::vec;
  constexpr int L = kLanes<T>;
  if (n < L) {
    return precise_stats(data, n, 1);  // a tail only: skip the registers' horizontal reductions
  }
  Partial result = empty_partial();
  vdouble sumsq = {};
  double absmax = 0.0;  // of the segments summed fast: all finite
  for (int64_t start = 0; start < n; start += kSegment) {
    const T* p = data + start;
    const int64_t len = n - start < kSegment ? n - start : kSegment;
    const int64_t vec_len = len / L * L;
    Bits<vec> seg_max = {};
    vbits16 seg_max16 = {};
    vdouble seg_sumsq = {};
    int64_t i = 0;
    for (; i + 32 * L <= vec_len; i += 32 * L) {
      if constexpr (kPrefetch) {
        prefetch_ahead(p + i, 32 * L);
      }
      add_squares(seg_sumsq, (block_squares(p + i, seg_max, seg_max16) + block_squares(p + i + 8 * L, seg_max, seg_max16)) +
                                 (block_squares(p + i + 16 * L, seg_max, seg_max16) + block_squares(p + i + 24 * L, seg_max, seg_max16)));
    }
    for (; i + 8 * L <= vec_len; i += 8 * L) {
      add_squares(seg_sumsq, block_squares(p + i, seg_max, seg_max16));
    }
    for (; i < vec_len; i += L) {
      const vec x = S::load(p + i);
      seg_max = vmax(seg_max, abs_bits(x));
      add_squares(seg_sumsq, x * x);
    }
    const double top = segment_top<T>(seg_max, seg_max16);
    const bool tiny = top > 0 && top < S::kBelow;
    if (!(sum_lanes(seg_sumsq) < INFINITY) || top > S::kAbove || (tiny && std::is_same_v<vec, vdouble>)) {
      merge(result, precise_stats(p, vec_len, 1));
    } else {
      if constexpr (std::is_same_v<vec, vfloat>) {
        if (tiny) {
          seg_sumsq = widened_sumsq(p, vec_len);
        }
      }
      sumsq += seg_sumsq;
      absmax = std::max(absmax, top);
    }
    if (vec_len < len) {
      merge(result, precise_stats(p + vec_len, len - vec_len, 1));
    }
  }
  Partial fast = empty_partial();
  fast.sumsq = sum_lanes(sumsq);
  fast.absmax = absmax;
  merge(result, fast);
  return result;
}

// A narrow type's NaN and inf are the 16-bit patterns with every exponent bit set: found by an
// integer max over the patterns, without widening.
template <typename T, bool kPrefetch>
bool any_run_narrow(const T* data, int64_t n) {
  constexpr int W = 2 * kLanes<T>;  // elements per vbits16
  const int64_t vec_len = n / W * W;
  for (int64_t start = 0; start < vec_len; start += kSegment) {
    const T* p = data + start;
    const int64_t len = vec_len - start < kSegment ? vec_len - start : kSegment;
    vbits16 acc0 = {}, acc1 = {};
    int64_t i = 0;
    for (; i + 2 * W <= len; i += 2 * W) {
      if constexpr (kPrefetch) {
        prefetch_ahead(p + i, 2 * W);
      }
      acc0 = vmax(acc0, narrow_abs_bits(p + i));
      acc1 = vmax(acc1, narrow_abs_bits(p + i + W));
    }
    for (; i < len; i += W) {
      acc0 = vmax(acc0, narrow_abs_bits(p + i));
    }
    if (max_bits(vmax(acc0, acc1)) >= Simd<T>::kInfBits) {
      return true;
    }
  }
  return precise_any_nonfinite(data + vec_len, n - vec_len, 1);
}

template <typename T, bool kPrefetch>
bool any_run(const T* data, int64_t n) {
  using S = Simd<T>;
  using vec = typename S::vec;
  constexpr int L = kLanes<T>;
  const int64_t vec_len = n / L * L;
  const vec zero = {};
  for (int64_t start = 0; start < vec_len; start += kSegment) {
    const T* p = data + start;
    const int64_t len = vec_len - start < kSegment ? vec_len - start : kSegment;
    vec acc0 = {}, acc1 = {};
    int64_t i = 0;
    for (; i + 2 * L <= len; i += 2 * L) {
      if constexpr (kPrefetch) {
        prefetch_ahead(p + i, 2 * L);
      }
      acc0 += S::load(p + i) * zero;  // x * 0 is NaN exactly when x is not finite
      acc1 += S::load(p + i + L) * zero;
    }
    for (; i < len; i += L) {
      acc0 += S::load(p + i) * zero;
    }
    if (!(sum_lanes(acc0 + acc1) < INFINITY)) {
      return true;
    }
  }
  return precise_any_nonfinite(data + vec_len, n - vec_len, 1);
}

template <bool kPrefetch>
const SimdKernels& table() {
  static const SimdKernels kernels{
      NANFAST_ISA_NAME,
      kPrefetch,
      stats_run<double, kPrefetch>,
      stats_run<float, kPrefetch>,
      stats_run<c10::Half, kPrefetch>,
      stats_run<c10::BFloat16, kPrefetch>,
      any_run<double, kPrefetch>,
      any_run<float, kPrefetch>,
      any_run_narrow<c10::Half, kPrefetch>,
      any_run_narrow<c10::BFloat16, kPrefetch>,
  };
  return kernels;
}

}  // namespace

const SimdKernels& kernels(bool prefetch) {
  return prefetch ? table<true>() : table<false>();
}

}  // namespace nanfast::cpu::NANFAST_ISA

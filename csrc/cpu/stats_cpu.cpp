// CPU implementation of nanfast::stats and nanfast::any_nonfinite.
#include <algorithm>
#include <array>
#include <atomic>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../bit_cast.h"
#include "../dtypes.h"
#include "../ops.h"
#include "../parallel_items.h"
#include "simd_kernels.h"

namespace nanfast::cpu {

// Calls fn(v) for each value v of one element (see NOTE: [Values of an element]). A one-byte floating
// element (float8, float4_e2m1fn_x2) goes through a 256-entry table of its values: c10's float8
// conversions are several ns each, and that path is the only one these dtypes take.
template <typename T, bool kByteFloat = sizeof(T) == 1 && !std::is_integral_v<T>>
struct Widen {
  template <typename Fn>
  void operator()(T x, const Fn& fn) const {
    for_each_value(x, fn);
  }
};

template <typename T>
struct Widen<T, true> {
  using Values = std::array<double, kValuesPerElement<T>>;
  const std::array<Values, 256>& table = make_table();

  template <typename Fn>
  void operator()(T x, const Fn& fn) const {
    for (const double v : table[nanfast::bit_cast<uint8_t>(x)]) {
      fn(v);
    }
  }

  static const std::array<Values, 256>& make_table() {
    static const std::array<Values, 256> values = [] {
      std::array<Values, 256> v{};
      for (int bits = 0; bits < 256; ++bits) {
        size_t k = 0;
        for_each_value(nanfast::bit_cast<T>(static_cast<uint8_t>(bits)), [&](double x) { v[bits][k++] = x; });
      }
      return v;
    }();
    return values;
  }
};

template <typename T>
Partial precise_stats(const T* data, int64_t n, int64_t stride) {
  const Widen<T> widen;
  Partial p = empty_partial();
  for (int64_t i = 0; i < n; ++i) {
    widen(data[i * stride], [&](double x) { accumulate(p, x); });
  }
  if (needs_rescale(p)) {
    begin_rescaled_pass(p);
    for (int64_t i = 0; i < n; ++i) {
      widen(data[i * stride], [&](double x) { accumulate_rescaled(p, x); });
    }
  }
  return p;
}

template <typename T>
bool precise_any_nonfinite(const T* data, int64_t n, int64_t stride) {
  const Widen<T> widen;
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    widen(data[i * stride], [&](double x) { bad |= is_nonfinite(x); });
  }
  return bad;
}

#define NANFAST_INSTANTIATE_PRECISE(T)                               \
  template Partial precise_stats<T>(const T*, int64_t, int64_t); \
  template bool precise_any_nonfinite<T>(const T*, int64_t, int64_t);
NANFAST_FOR_EACH_SIMD_TYPE(NANFAST_INSTANTIATE_PRECISE)
#undef NANFAST_INSTANTIATE_PRECISE

namespace {

// NOTE: [CPU work list]
// All inputs are laid end to end in one logical index space cut into items of kItemElements, so a
// huge tensor spreads over every thread and thousands of tiny ones share items. An item yields one
// Partial per tensor it touches (a piece); pieces are merged per tensor in index order. Neither the
// cut nor the merge order depends on the thread count, so results are identical for any thread count.
constexpr int64_t kItemElements = int64_t{1} << 14;
// Two items (128 KB of float32) already go to two threads: a tensor that multi-threaded ATen ops just
// wrote (an activation, a gradient) lies spread over the cores' caches, and each thread reading the
// part near it runs about 3x faster than one thread reading all of it (measured at 0.5-1 MB). One
// thread reading all of it also slows the model's next op: on the 2-vCPU EPYC of issue 19, an addmm
// reading a 512x128 float32 activation that another addmm had just written took 97 us, and 110 us when
// this kernel had read the activation in between on one thread (items of 64K elements); with items of
// 16K, 90 and 90 us. The watch suite's small transformer's backward went from 0.29 to 0.10 ms a step
// slower than without the watch. A thread takes one item at a time (see NOTE: [Threads that wake late]).
constexpr int64_t kItemsPerChunk = 1;
// Rows of results (one per tensor) a thread merges and writes at least: thousands of small tensors' rows
// are split over the threads (the 5000 x 1024 floats of bench.py, 10 alternating process pairs on the
// 2-vCPU AMD EPYC of issue 19: stats a median 6% faster per pair, any_nonfinite, which has no rows, 2%
// slower, within its spread). Each tensor's pieces are merged in index order either way.
constexpr int64_t kRowsPerThread = 1024;

struct WorkList {
  std::vector<int64_t> offsets;     // offsets[t]: first logical index of tensor t; back() is the total
  std::vector<int64_t> piece_base;  // piece_base[t]: index of tensor t's first piece; back() is the count
  int64_t num_items = 0;

  explicit WorkList(const std::vector<InputRun>& runs) : offsets(runs.size() + 1, 0), piece_base(runs.size() + 1, 0) {
    for (size_t t = 0; t < runs.size(); ++t) {
      offsets[t + 1] = offsets[t] + runs[t].numel;
      const int64_t pieces = runs[t].numel == 0 ? 0 : (offsets[t + 1] - 1) / kItemElements - offsets[t] / kItemElements + 1;
      piece_base[t + 1] = piece_base[t] + pieces;
    }
    num_items = (offsets.back() + kItemElements - 1) / kItemElements;
  }

  // Calls fn(tensor, piece, begin, end) for each tensor piece of item `item`; stops when fn returns false.
  template <typename Fn>
  void for_each_piece(int64_t item, const Fn& fn) const {
    const int64_t lo = item * kItemElements;
    const int64_t hi = std::min(lo + kItemElements, offsets.back());
    size_t t = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
    for (; t + 1 < offsets.size() && offsets[t] < hi; ++t) {
      const int64_t begin = std::max(lo, offsets[t]);
      const int64_t end = std::min(hi, offsets[t + 1]);
      if (begin == end) {
        continue;
      }
      const int64_t piece = piece_base[t] + item - offsets[t] / kItemElements;
      if (!fn(t, piece, begin - offsets[t], end - offsets[t])) {
        return;
      }
    }
  }
};

// NOTE: [Prefetching the next small tensors]
// Thousands of small tensors lie wherever the allocator put them, each a few pages that the
// hardware prefetchers meet cold: reading one starts with a wait on memory. While tensor t is read,
// the lines of tensor t + kPrefetchTensorsAhead are requested into L2 (prefetcht2), for dense
// tensors of at most kPrefetchTensorBytes; bigger ones stream well on their own. On the 2-vCPU AMD
// EPYC (Zen 4) of issue 19, 5000 x 1024 float32 in bench.py's order, 2 threads: stats from a median
// of 1.61 ms to 1.16 ms over six alternating pairs of processes (the per-tensor assert takes 58 ms:
// 36x -> 51x), and in one process with the variants interleaved 1.35-1.41 ms without, 0.93-1.01 ms
// with 1 to 4 tensors ahead, 1.29 ms prefetching into L1 (prefetcht0) instead.
// Details: benchmarks/results/cpu-kernels-19.md. Prefetches are hints: results do not change.
constexpr size_t kPrefetchTensorsAhead = 4;
constexpr int64_t kPrefetchTensorBytes = 16384;
constexpr int64_t kCacheLineBytes = 64;

void prefetch_input(const std::vector<InputRun>& runs, size_t t) {
  if (t >= runs.size() || !runs[t].dense) {
    return;
  }
  const int64_t bytes = runs[t].numel * static_cast<int64_t>(c10::elementSize(runs[t].dtype));
  if (bytes > kPrefetchTensorBytes) {
    return;
  }
  const char* data = static_cast<const char*>(runs[t].data);
  for (int64_t b = 0; b < bytes; b += kCacheLineBytes) {
    __builtin_prefetch(data + b, /*rw=*/0, /*locality=*/1);
  }
}

// Calls fn(ptr, n, stride) for the runs covering logical elements [begin, end) of `run`.
template <typename T, typename Fn>
void for_each_run(const InputRun& run, int64_t begin, int64_t end, const Fn& fn) {
  const T* data = static_cast<const T*>(run.data);
  if (run.dense) {
    fn(data + begin, end - begin, int64_t{1});
    return;
  }
  const int64_t ndim = static_cast<int64_t>(run.sizes.size());
  c10::SmallVector<int64_t, 6> index(ndim, 0);
  int64_t rest = begin;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    index[d] = rest % run.sizes[d];
    rest /= run.sizes[d];
  }
  const int64_t row = run.sizes[ndim - 1];
  for (int64_t pos = begin; pos < end;) {
    int64_t offset = 0;
    for (int64_t d = 0; d < ndim; ++d) {
      offset += index[d] * run.strides[d];
    }
    const int64_t len = std::min(row - index[ndim - 1], end - pos);
    fn(data + offset, len, run.strides[ndim - 1]);
    pos += len;
    index[ndim - 1] += len;
    for (int64_t d = ndim - 1; d > 0 && index[d] == run.sizes[d]; --d) {
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

template <typename T>
Partial piece_stats(const InputRun& run, int64_t begin, int64_t end, Partial (*simd)(const T*, int64_t)) {
  Partial p = empty_partial();
  for_each_run<T>(run, begin, end, [&](const T* ptr, int64_t n, int64_t stride) {
    merge(p, simd != nullptr && stride == 1 ? simd(ptr, n) : precise_stats(ptr, n, stride));
  });
  return p;
}

template <typename T>
bool piece_any(const InputRun& run, int64_t begin, int64_t end, bool (*simd)(const T*, int64_t)) {
  bool bad = false;
  for_each_run<T>(run, begin, end, [&](const T* ptr, int64_t n, int64_t stride) {
    bad = bad || (simd != nullptr && stride == 1 ? simd(ptr, n) : precise_any_nonfinite(ptr, n, stride));
  });
  return bad;
}

// The contiguous-run kernels of T in `k`; none for the dtypes without SIMD kernels.
template <typename T>
struct SimdOf {
  Partial (*stats)(const T*, int64_t) = nullptr;
  bool (*any)(const T*, int64_t) = nullptr;
};

template <typename T>
SimdOf<T> simd_of(const SimdKernels& k) {
  if constexpr (std::is_same_v<T, double>) {
    return {k.stats_f64, k.any_f64};
  } else if constexpr (std::is_same_v<T, float>) {
    return {k.stats_f32, k.any_f32};
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return {k.stats_f16, k.any_f16};
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return {k.stats_bf16, k.any_bf16};
  } else {
    return {};
  }
}

Partial stats_of_piece(const InputRun& run, int64_t begin, int64_t end) {
  return visit_dtype(run.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return piece_stats<T>(run, begin, end, simd_of<T>(simd_kernels()).stats);
  });
}

bool any_of_piece(const InputRun& run, int64_t begin, int64_t end) {
  return visit_dtype</*kFloatingOnly=*/true>(run.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return piece_any<T>(run, begin, end, simd_of<T>(simd_kernels()).any);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_cpu(at::TensorList tensors) {
  const std::vector<InputRun> runs = describe_inputs("nanfast.stats", tensors);
  const int64_t n = static_cast<int64_t>(runs.size());
  at::Tensor counts = at::empty({n, 3}, at::kLong);
  at::Tensor norm = at::empty({n}, at::kDouble);
  at::Tensor absmax = at::empty({n}, at::kDouble);

  const WorkList work(runs);
  std::vector<Partial> pieces(work.piece_base.back());
  parallel_items(work.num_items, kItemsPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      work.for_each_piece(item, [&](size_t t, int64_t piece, int64_t lo, int64_t hi) {
        if (lo == 0) {  // a tensor's first piece (a big tensor's others need no hint)
          prefetch_input(runs, t + kPrefetchTensorsAhead);
        }
        pieces[piece] = stats_of_piece(runs[t], lo, hi);
        return true;
      });
    }
  });

  int64_t* counts_out = counts.data_ptr<int64_t>();
  double* norm_out = norm.data_ptr<double>();
  double* absmax_out = absmax.data_ptr<double>();
  at::parallel_for(0, n, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Partial p = empty_partial();
      for (int64_t k = work.piece_base[t]; k < work.piece_base[t + 1]; ++k) {
        merge(p, pieces[k]);
      }
      counts_out[3 * t] = p.nan;
      counts_out[3 * t + 1] = p.posinf;
      counts_out[3 * t + 2] = p.neginf;
      norm_out[t] = l2_norm(p);
      absmax_out[t] = p.absmax;
    }
  });
  fix_negated_counts(runs, counts);
  apply_repeats(runs, counts, norm);
  return {counts, norm, absmax};
}

at::Tensor any_nonfinite_cpu(at::TensorList tensors) {
  std::vector<InputRun> runs = describe_inputs("nanfast.any_nonfinite", tensors);
  // Integer and bool tensors are finite by definition: leave them out of the work list.
  runs.erase(std::remove_if(runs.begin(), runs.end(), [](const InputRun& r) { return !can_be_nonfinite(r.dtype); }), runs.end());
  const WorkList work(runs);
  std::atomic<bool> found{false};
  parallel_items(work.num_items, kItemsPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end && !found.load(std::memory_order_relaxed); ++item) {
      work.for_each_piece(item, [&](size_t t, int64_t /*piece*/, int64_t lo, int64_t hi) {
        if (lo == 0) {
          prefetch_input(runs, t + kPrefetchTensorsAhead);
        }
        if (any_of_piece(runs[t], lo, hi)) {
          found.store(true, std::memory_order_relaxed);
        }
        return !found.load(std::memory_order_relaxed);
      });
    }
  });
  at::Tensor out = at::empty({}, at::kBool);
  *out.data_ptr<bool>() = found.load();
  return out;
}

}  // namespace nanfast::cpu

TORCH_LIBRARY_IMPL(nanfast, CPU, m) {
  m.impl("stats", &nanfast::cpu::stats_cpu);
  m.impl("any_nonfinite", &nanfast::cpu::any_nonfinite_cpu);
}

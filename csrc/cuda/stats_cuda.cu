// CUDA implementation of nanfast::stats, nanfast::any_nonfinite and nanfast::step_summary (one file: the
// CPU emulation of CUDA rewrites this file's text, and the summary shares its block_reduce).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../dtypes.h"
#include "../nonfinite.h"
#include "../ops.h"

namespace nanfast::cuda {
namespace {

// NOTE: [CUDA multi-tensor chunks]
// Every tensor is cut into chunks of kChunkElements elements (the last one may be shorter). A block
// of kThreads threads reduces one chunk to a Partial, the chunk's piece, stored at
// piece_base[tensor] + chunk. The dense tensors of one dtype are batched into launches of a kernel
// templated on the dtype: a ChunkBatch, the kernel argument itself (under the 4 KB limit, so no
// metadata is copied to the device and nothing waits for the host), holds up to kBatchTensors whole
// tensors and the first block of each; a launch has one block per chunk of its tensors, and a block
// finds its tensor by a binary search over those first blocks (uniform in the block, in the
// argument's constant bank). Unlike PyTorch's multi-tensor apply, which lists one (tensor, chunk)
// entry per block and so caps a launch at a few hundred blocks, the grid is as large as the tensors:
// on an H200, 352 blocks a launch kept only ~31% of the SMs' warp slots busy and stats read at 0.44x
// the read ceiling (ncu, benchmarks/results/cuda-h200.md, section 5). Thousands of small tensors take
// a few launches. Threads read a dense chunk with 16-byte loads where its start is aligned for them. A view
// that is not dense gets a launch of its own that reads it in place through its sizes and strides,
// with the same chunks. Threads accumulate with the shared code of nonfinite.h, a block merges its
// threads' Partials in a fixed tree in shared memory, and a finishing kernel (one block per tensor,
// piece_base in its argument, kFinishTensors tensors a launch) merges each tensor's pieces in a
// fixed order: no atomics, and the results depend neither on the batching nor on the order in which
// blocks run. A float64 chunk whose absmax calls for it is summed a second time, rescaled (see the
// note on Partial statistics in nonfinite.h); every thread of the block decides on the block's
// Partial, so the branch is uniform. any_nonfinite makes the same launches with a flag kernel: no
// norms, integer and bool tensors left out, and a block that finds a non-finite value stores true
// into the output (every writer stores the same value); blocks that start after that skip their
// reads.

constexpr int kThreads = 256;
constexpr int64_t kChunkElements = int64_t{1} << 16;
constexpr int kBatchTensors = 128;
constexpr int64_t kMaxGridBlocks = std::numeric_limits<int32_t>::max();  // CUDA's limit on gridDim.x
constexpr int64_t kFinishTensors = 480;
constexpr int kMaxDims = 16;

static_assert((kThreads & (kThreads - 1)) == 0, "block_reduce needs a power-of-two block");

// ---------------------------------------------------------------------------------------------
// Device side: reading a chunk, reducing it in a block.

// Reduces the threads' values in a fixed tree order; every thread of the block gets the result.
template <typename V, typename Combine>
__device__ V block_reduce(V value, const Combine& combine) {
  __shared__ V shared[kThreads];
  const int tid = threadIdx.x;
  shared[tid] = value;
  __syncthreads();
#pragma unroll
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (tid < width) {
      combine(shared[tid], shared[tid + width]);
    }
    __syncthreads();
  }
  const V result = shared[0];
  __syncthreads();  // the buffer is reused by the next call
  return result;
}

struct MergePartials {
  __device__ void operator()(Partial& a, const Partial& b) const {
    merge(a, b);
  }
};

template <typename T>
struct alignas(16) Packet {
  T values[16 / sizeof(T)];
};

// One chunk of a dense tensor; read with 16-byte loads where its start is aligned for them.
template <typename T>
struct DenseChunk {
  using scalar_t = T;
  const T* data;  // the chunk's first element
  int len;

  // Calls fn(x) with each value of the elements this thread reads (see NOTE: [Values of an element]).
  template <typename Fn>
  __device__ __forceinline__ void for_each(const Fn& fn) const {
    constexpr int kPacked = sizeof(Packet<T>) / sizeof(T);
    int scalar_begin = 0;
    if (reinterpret_cast<uintptr_t>(data) % sizeof(Packet<T>) == 0) {
      const Packet<T>* packets = reinterpret_cast<const Packet<T>*>(data);
      const int num_packets = len / kPacked;
#pragma unroll 4
      for (int k = threadIdx.x; k < num_packets; k += kThreads) {
        const Packet<T> packet = packets[k];
#pragma unroll
        for (int j = 0; j < kPacked; ++j) {
          for_each_value(packet.values[j], fn);
        }
      }
      scalar_begin = num_packets * kPacked;
    }
    for (int i = scalar_begin + threadIdx.x; i < len; i += kThreads) {
      for_each_value(data[i], fn);
    }
  }
};

// A view that is not dense: its coalesced sizes and strides, innermost dimension first.
struct Geometry {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

__device__ __forceinline__ int64_t offset_of(const Geometry& geometry, int64_t index) {
  int64_t offset = 0;
#pragma unroll
  for (int d = 0; d < kMaxDims; ++d) {
    if (d < geometry.ndim) {
      offset += index % geometry.sizes[d] * geometry.strides[d];
      index /= geometry.sizes[d];
    }
  }
  return offset;
}

// One chunk of a view that is not dense, read in place.
template <typename T>
struct StridedChunk {
  using scalar_t = T;
  const T* data;  // the view's first element
  const Geometry& geometry;
  int64_t begin;  // index of the chunk's first element, in the view's logical order
  int len;

  template <typename Fn>
  __device__ __forceinline__ void for_each(const Fn& fn) const {
    for (int i = threadIdx.x; i < len; i += kThreads) {
      for_each_value(data[offset_of(geometry, begin + i)], fn);
    }
  }
};

template <typename Chunk>
__device__ Partial chunk_stats(const Chunk& chunk) {
  Partial mine = empty_partial();
  chunk.for_each([&](double x) { accumulate(mine, x); });
  Partial total = block_reduce(mine, MergePartials{});
  // Only float64 values can square out of the range of a double (see NOTE: [Partial statistics]).
  if constexpr (std::is_same_v<typename Chunk::scalar_t, double>) {
    if (needs_rescale(total)) {  // every thread holds the same total: the branch is uniform
      begin_rescaled_pass(total);
      Partial mine_rescaled = total;
      chunk.for_each([&](double x) { accumulate_rescaled(mine_rescaled, x); });
      total.sumsq = block_reduce(mine_rescaled.sumsq, [](double& a, const double& b) { a += b; });
    }
  }
  return total;
}

// What a block does with its chunk, for stats: store the chunk's Partial as its piece.
struct StatsOfChunk {
  Partial* pieces;

  template <typename Chunk>
  __device__ void operator()(const Chunk& chunk, int64_t piece) const {
    const Partial total = chunk_stats(chunk);
    if (threadIdx.x == 0) {
      pieces[piece] = total;
    }
  }
};

// What a block does with its chunk, for any_nonfinite: set *found if the chunk holds NaN or inf.
struct FlagNonfinite {
  bool* found;

  template <typename Chunk>
  __device__ void operator()(const Chunk& chunk, int64_t /*piece*/) const {
    if (*static_cast<volatile bool*>(found)) {
      return;  // another block has found one: the answer is known
    }
    bool nonfinite = false;
    chunk.for_each([&](double x) { nonfinite |= is_nonfinite(x); });
    if (nonfinite) {
      *static_cast<volatile bool*>(found) = true;  // volatile, as the read: blocks race on it by design
    }
  }
};

struct BatchTensor {
  const void* data;
  int64_t numel;
  int64_t piece_base;
};

struct ChunkBatch {
  BatchTensor tensors[kBatchTensors];
  int32_t first_block[kBatchTensors];  // tensors[t]'s chunks are blocks first_block[t], first_block[t] + 1, ...
  int32_t num_tensors;
};

static_assert(
    sizeof(ChunkBatch) + std::max(sizeof(StatsOfChunk), sizeof(FlagNonfinite)) <= 4096,
    "kernel arguments are limited to 4 KB");

__device__ __forceinline__ int chunk_length(int64_t numel, int64_t begin) {
  return static_cast<int>(numel - begin < kChunkElements ? numel - begin : kChunkElements);
}

template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads) dense_chunks_kernel(ChunkBatch batch, Op op) {
  // This block's tensor: the last one whose first block is at or before it (first_block[0] is 0, and
  // first blocks increase: no tensor in a batch is empty).
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  int lo = 0;
  int hi = batch.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const BatchTensor& tensor = batch.tensors[lo];
  const int64_t chunk = block - batch.first_block[lo];
  const int64_t begin = chunk * kChunkElements;
  op(DenseChunk<T>{static_cast<const T*>(tensor.data) + begin, chunk_length(tensor.numel, begin)},
     tensor.piece_base + chunk);
}

template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads)
    strided_chunks_kernel(const T* data, int64_t numel, Geometry geometry, int64_t piece_base, Op op) {
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kChunkElements;
  op(StridedChunk<T>{data, geometry, begin, chunk_length(numel, begin)}, piece_base + chunk);
}

struct FinishBatch {
  int64_t first_tensor;
  // The pieces of tensor first_tensor + i are [piece_base[i], piece_base[i + 1]).
  int64_t piece_base[kFinishTensors + 1];
};

static_assert(sizeof(FinishBatch) + 4 * sizeof(void*) <= 4096, "kernel arguments are limited to 4 KB");

// One block per tensor: merges the tensor's pieces and writes its row of the outputs.
__global__ void __launch_bounds__(kThreads) finish_stats_kernel(
    FinishBatch batch, const Partial* pieces, int64_t* counts, double* norm, double* absmax) {
  Partial mine = empty_partial();
  const int64_t end = batch.piece_base[blockIdx.x + 1];
  for (int64_t k = batch.piece_base[blockIdx.x] + threadIdx.x; k < end; k += kThreads) {
    merge(mine, pieces[k]);
  }
  const Partial total = block_reduce(mine, MergePartials{});
  if (threadIdx.x == 0) {
    const int64_t t = batch.first_tensor + blockIdx.x;
    counts[3 * t] = total.nan;
    counts[3 * t + 1] = total.posinf;
    counts[3 * t + 2] = total.neginf;
    norm[t] = l2_norm(total);
    absmax[t] = total.absmax;
  }
}

// ---------------------------------------------------------------------------------------------
// nanfast.step_summary (see NOTE: [The step's summary in one call]): one launch of one block. Every sum
// runs in a fixed order (deterministic).

constexpr int kMaxLossNames = 64;
// The losses' means read where they lie (one per Watch.loss call of the step); more are stacked first.
// A stack of them was the fourth launch of every fused step given its loss (Watch.loss).
constexpr int kMaxLossValues = 32;
// The records' parts read where they lie (a fused step's calls: a few); more are joined by one cat first.
constexpr int kMaxRecordedParts = 16;

// A one-value float32 or float64 tensor's data; data == nullptr: absent.
struct Scalar {
  const void* data;
  bool is_double;
};

struct SummaryArgs {
  const int64_t* recorded[kMaxRecordedParts];  // each part's rows, [rows, 3]
  int64_t recorded_rows[kMaxRecordedParts];
  int recorded_parts;
  const int64_t* recorded_counted;  // 0/1 per cell of the parts' rows, in order; nullptr: every cell counts
  const int64_t* counts;  // the fused pass's rows: n_params parameters, then gradients
  const double* norm;
  const double* absmax;
  const int64_t* counted;  // nullptr: every row counts
  int64_t rows;
  int64_t n_params;
  const int64_t* groups;  // each gradient's module number; numbers outside [0, n_groups) match none
  int64_t n_groups;
  const double* losses[kMaxLossValues];  // the means of every Watch.loss call, name after name
  const double* stacked_losses;  // all of them, where there are more than kMaxLossValues; else nullptr
  int64_t loss_first[kMaxLossNames + 1];  // name j's calls are losses[loss_first[j], loss_first[j + 1])
  int loss_names;
  Scalar found_inf, grad_scale, scale;
  bool nan_only;
};

static_assert(sizeof(SummaryArgs) + sizeof(void*) <= 4096, "kernel arguments are limited to 4 KB");

__device__ double scalar_value(const Scalar& s) {
  return s.is_double ? *static_cast<const double*>(s.data) : static_cast<double>(*static_cast<const float*>(s.data));
}

struct Sum3 {
  int64_t v[3];
};

struct AddSum3 {
  __device__ void operator()(Sum3& a, const Sum3& b) const {
    for (int k = 0; k < 3; ++k) {
      a.v[k] += b.v[k];
    }
  }
};

struct AddDouble {
  __device__ void operator()(double& a, const double& b) const {
    a += b;
  }
};

// As torch.amax: NaN if either is NaN.
__device__ double max_or_nan(double a, double b) {
  return (a != a || b != b) ? NAN : (a > b ? a : b);
}

struct MaxOrNan {
  __device__ void operator()(double& a, const double& b) const {
    a = max_or_nan(a, b);
  }
};

// nanfast.combine_norms over x[0, n), by the whole block (see NOTE: [Combining norms]).
__device__ double block_combine_norms(const double* x, int64_t n) {
  if (n == 0) {  // uniform: every thread sees the same n
    return 0.0;
  }
  double top = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    top = max_or_nan(top, x[i]);
  }
  top = block_reduce(top, MaxOrNan{});
  const double scale = (fabs(top) < INFINITY && top > 0) ? top : 1.0;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const double r = x[i] / scale;
    sum += r * r;
  }
  return scale * sqrt(block_reduce(sum, AddDouble{}));
}

__global__ void __launch_bounds__(kThreads) step_summary_kernel(SummaryArgs a, double* out) {
  const int tid = threadIdx.x;
  Sum3 mine{{0, 0, 0}};
  const int64_t* weights = a.recorded_counted;
  for (int p = 0; p < a.recorded_parts; ++p) {
    for (int64_t i = tid; i < a.recorded_rows[p]; i += kThreads) {
      for (int k = 0; k < 3; ++k) {
        mine.v[k] += a.recorded[p][3 * i + k] * (weights != nullptr ? weights[3 * i + k] : 1);
      }
    }
    if (weights != nullptr) {
      weights += 3 * a.recorded_rows[p];
    }
  }
  for (int64_t i = tid; i < a.rows; i += kThreads) {
    const int64_t weight = a.counted != nullptr ? a.counted[i] : 1;
    for (int k = 0; k < 3; ++k) {
      mine.v[k] += a.counts[3 * i + k] * weight;
    }
  }
  const Sum3 totals = block_reduce(mine, AddSum3{});
  const int64_t grads = a.rows - a.n_params;
  const double param_norm = block_combine_norms(a.norm, a.n_params);
  double grad_norm = 0.0, grad_max = 0.0, inverse = 1.0;
  if (grads > 0) {
    grad_norm = block_combine_norms(a.norm + a.n_params, grads);
    double top = -INFINITY;
    for (int64_t i = tid; i < grads; i += kThreads) {
      top = max_or_nan(top, a.absmax[a.n_params + i]);
    }
    grad_max = block_reduce(top, MaxOrNan{});
    if (a.grad_scale.data != nullptr) {  // a fused optimizer under a GradScaler: its gradients are still scaled
      inverse = 1.0 / scalar_value(a.grad_scale);
    }
  }
  // One thread per module: its gradients' squares summed in their order.
  const int64_t modules_at = 8 + a.loss_names + (a.scale.data != nullptr ? 1 : 0);
  for (int64_t g = tid; g < a.n_groups; g += kThreads) {
    double squares = 0.0;
    for (int64_t i = 0; i < grads; ++i) {
      if (a.groups[i] == g) {
        const double x = a.norm[a.n_params + i];
        squares += x * x;
      }
    }
    out[modules_at + g] = sqrt(squares) * inverse;
  }
  if (tid == 0) {
    out[0] = static_cast<double>(a.nan_only ? totals.v[0] : totals.v[0] + totals.v[1] + totals.v[2]);
    for (int k = 0; k < 3; ++k) {
      out[1 + k] = static_cast<double>(totals.v[k]);
    }
    out[4] = grad_norm * inverse;
    out[5] = grad_max * inverse;
    out[6] = param_norm;
    out[7] = a.found_inf.data != nullptr ? scalar_value(a.found_inf) : 0.0;
    for (int j = 0; j < a.loss_names; ++j) {
      double sum = 0.0;
      for (int64_t i = a.loss_first[j]; i < a.loss_first[j + 1]; ++i) {
        sum += a.stacked_losses != nullptr ? a.stacked_losses[i] : *a.losses[i];
      }
      out[8 + j] = sum / static_cast<double>(a.loss_first[j + 1] - a.loss_first[j]);
    }
    if (a.scale.data != nullptr) {
      out[8 + a.loss_names] = scalar_value(a.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: planning and launching.

int64_t chunks_of(int64_t numel) {
  return (numel + kChunkElements - 1) / kChunkElements;
}

// piece_base[t]: the index of tensor t's first piece; piece_base.back() is the number of pieces.
std::vector<int64_t> piece_bases(const std::vector<InputRun>& runs) {
  std::vector<int64_t> piece_base(runs.size() + 1, 0);
  for (size_t t = 0; t < runs.size(); ++t) {
    piece_base[t + 1] = piece_base[t] + chunks_of(runs[t].numel);
  }
  return piece_base;
}

// The non-empty inputs of one dtype: dense ones are batched, views get launches of their own.
struct DtypeGroup {
  std::vector<size_t> dense;
  std::vector<std::pair<size_t, Geometry>> views;
};

// Groups the inputs whose dtype passes `keep`, checking everything a launch could refuse up front.
std::map<at::ScalarType, DtypeGroup> group_by_dtype(
    const char* op, const std::vector<InputRun>& runs, bool (*keep)(at::ScalarType)) {
  std::map<at::ScalarType, DtypeGroup> groups;
  for (size_t i = 0; i < runs.size(); ++i) {
    const InputRun& run = runs[i];
    if (run.numel == 0 || !keep(run.dtype)) {
      continue;
    }
    TORCH_CHECK(
        chunks_of(run.numel) <= std::numeric_limits<int32_t>::max(), op, ": tensors[", i, "] has ", run.numel,
        " elements, more than the CUDA kernels can index");
    DtypeGroup& group = groups[run.dtype];
    if (run.dense) {
      group.dense.push_back(i);
      continue;
    }
    const int ndim = static_cast<int>(run.sizes.size());
    TORCH_CHECK(
        ndim <= kMaxDims, op, ": tensors[", i, "] is a view whose strides leave ", ndim,
        " dimensions after merging; the CUDA kernels read views of at most ", kMaxDims,
        " (pass a .contiguous() copy)");
    Geometry geometry{};
    geometry.ndim = ndim;
    for (int d = 0; d < ndim; ++d) {
      geometry.sizes[d] = run.sizes[ndim - 1 - d];
      geometry.strides[d] = run.strides[ndim - 1 - d];
    }
    group.views.emplace_back(i, geometry);
  }
  return groups;
}

// Launches `op` over every chunk of `group`, whose dtype is T (see NOTE: [CUDA multi-tensor chunks]).
template <typename T, typename Op>
void launch_chunks(
    const std::vector<InputRun>& runs, const DtypeGroup& group, const std::vector<int64_t>& piece_base,
    const Op& op, cudaStream_t stream) {
  ChunkBatch batch{};
  int64_t num_blocks = 0;
  const auto flush = [&] {
    if (batch.num_tensors > 0) {
      dense_chunks_kernel<T, Op><<<static_cast<unsigned>(num_blocks), kThreads, 0, stream>>>(batch, op);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    batch.num_tensors = 0;
    num_blocks = 0;
  };
  for (size_t i : group.dense) {
    // group_by_dtype checked that one tensor's chunks fit a grid; a batch takes whole tensors.
    const int64_t chunks = chunks_of(runs[i].numel);
    TORCH_INTERNAL_ASSERT(chunks >= 1 && chunks <= kMaxGridBlocks);
    if (batch.num_tensors == kBatchTensors || num_blocks + chunks > kMaxGridBlocks) {
      flush();
    }
    batch.first_block[batch.num_tensors] = static_cast<int32_t>(num_blocks);
    batch.tensors[batch.num_tensors++] = BatchTensor{runs[i].data, runs[i].numel, piece_base[i]};
    num_blocks += chunks;
  }
  flush();
  for (const auto& [i, geometry] : group.views) {
    const InputRun& run = runs[i];
    strided_chunks_kernel<T, Op><<<static_cast<unsigned>(chunks_of(run.numel)), kThreads, 0, stream>>>(
        static_cast<const T*>(run.data), run.numel, geometry, piece_base[i], op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void launch_finish(
    const std::vector<int64_t>& piece_base, const Partial* pieces, at::Tensor& counts, at::Tensor& norm,
    at::Tensor& absmax, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(piece_base.size()) - 1;
  for (int64_t first = 0; first < n; first += kFinishTensors) {
    const int64_t count = std::min(kFinishTensors, n - first);
    FinishBatch batch{};
    batch.first_tensor = first;
    std::copy(piece_base.begin() + first, piece_base.begin() + first + count + 1, batch.piece_base);
    finish_stats_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
        batch, pieces, counts.mutable_data_ptr<int64_t>(), norm.mutable_data_ptr<double>(),
        absmax.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

bool any_dtype(at::ScalarType /*dtype*/) {
  return true;
}

// What one op call launches: its inputs, those read grouped by dtype (`reads` picks the dtypes), and
// where each tensor's pieces start.
struct LaunchPlan {
  LaunchPlan(const char* op, at::TensorList tensors, bool (*reads)(at::ScalarType))
      : runs(describe_inputs(op, tensors)), groups(group_by_dtype(op, runs, reads)), piece_base(piece_bases(runs)) {}

  const std::vector<InputRun> runs;
  const std::map<at::ScalarType, DtypeGroup> groups;
  const std::vector<int64_t> piece_base;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_cuda(at::TensorList tensors) {
  const LaunchPlan plan("nanfast.stats", tensors, any_dtype);
  const c10::cuda::CUDAGuard device_guard(tensors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions options = tensors[0].options();
  const int64_t n = static_cast<int64_t>(plan.runs.size());
  at::Tensor counts = at::empty({n, 3}, options.dtype(at::kLong));
  at::Tensor norm = at::empty({n}, options.dtype(at::kDouble));
  at::Tensor absmax = at::empty({n}, options.dtype(at::kDouble));
  at::Tensor pieces = at::empty({plan.piece_base.back() * static_cast<int64_t>(sizeof(Partial))}, options.dtype(at::kByte));
  Partial* pieces_data = static_cast<Partial*>(pieces.mutable_data_ptr());

  for (const auto& entry : plan.groups) {
    visit_dtype(entry.first, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_chunks<T>(plan.runs, entry.second, plan.piece_base, StatsOfChunk{pieces_data}, stream);
    });
  }
  launch_finish(plan.piece_base, pieces_data, counts, norm, absmax, stream);
  fix_negated_counts(plan.runs, counts);
  apply_repeats(plan.runs, counts, norm);
  return {counts, norm, absmax};
}

at::Tensor any_nonfinite_cuda(at::TensorList tensors) {
  // Integer and bool tensors are finite by definition: they are not read.
  const LaunchPlan plan("nanfast.any_nonfinite", tensors, can_be_nonfinite);
  const c10::cuda::CUDAGuard device_guard(tensors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor found = at::zeros({}, tensors[0].options().dtype(at::kBool));
  const FlagNonfinite flag{found.mutable_data_ptr<bool>()};
  for (const auto& entry : plan.groups) {
    visit_dtype</*kFloatingOnly=*/true>(entry.first, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_chunks<T>(plan.runs, entry.second, plan.piece_base, flag, stream);
    });
  }
  return found;
}

// The data of an optional one-value tensor as the kernel reads it (float32 or float64; another
// floating dtype is converted, its copy kept alive in `keep`).
Scalar scalar_of(const std::optional<at::Tensor>& t, at::Tensor& keep) {
  if (!t.has_value()) {
    return {nullptr, false};
  }
  const bool kept = t->scalar_type() == at::kDouble || t->scalar_type() == at::kFloat;
  keep = kept ? t->contiguous() : t->to(at::kFloat);
  return {keep.const_data_ptr(), keep.scalar_type() == at::kDouble};
}

at::Tensor step_summary_cuda(at::TensorList recorded, const std::optional<at::Tensor>& recorded_counted,
                             const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& norm,
                             const std::optional<at::Tensor>& absmax, int64_t n_params,
                             const std::optional<at::Tensor>& counted, bool nan_only,
                             const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_scale,
                             at::TensorList losses, at::IntArrayRef loss_calls, const std::optional<at::Tensor>& scale,
                             const std::optional<at::Tensor>& groups, int64_t n_groups) {
  check_step_summary_inputs(recorded, recorded_counted, counts, norm, absmax, n_params, counted, found_inf, grad_scale,
                            losses, loss_calls, scale, groups, n_groups);
  TORCH_CHECK(static_cast<int64_t>(loss_calls.size()) <= kMaxLossNames, "nanfast.step_summary: at most ",
              kMaxLossNames, " loss names on CUDA, got ", loss_calls.size());
  const c10::cuda::CUDAGuard device_guard(recorded[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  SummaryArgs args{};
  std::vector<at::Tensor> parts;  // kept alive until the launch
  if (recorded.size() > static_cast<size_t>(kMaxRecordedParts)) {
    parts.push_back(at::cat(recorded));
  } else {
    for (const at::Tensor& part : recorded) {
      parts.push_back(part.contiguous());
    }
  }
  args.recorded_parts = static_cast<int>(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    args.recorded[p] = parts[p].const_data_ptr<int64_t>();
    args.recorded_rows[p] = parts[p].size(0);
  }
  at::Tensor recorded_mask, c, nm, am, mask, g, means, found_keep, grad_scale_keep, scale_keep;
  if (recorded_counted.has_value()) {
    recorded_mask = recorded_counted->contiguous();
    args.recorded_counted = recorded_mask.const_data_ptr<int64_t>();
  }
  if (counts.has_value()) {
    c = counts->contiguous();
    nm = norm->contiguous();
    am = absmax->contiguous();
    args.counts = c.const_data_ptr<int64_t>();
    args.norm = nm.const_data_ptr<double>();
    args.absmax = am.const_data_ptr<double>();
    args.rows = c.size(0);
    args.n_params = n_params;
  }
  if (counted.has_value()) {
    mask = counted->contiguous();
    args.counted = mask.const_data_ptr<int64_t>();
  }
  if (groups.has_value()) {
    g = groups->contiguous();
    args.groups = g.const_data_ptr<int64_t>();
    args.n_groups = n_groups;
  }
  if (losses.size() > static_cast<size_t>(kMaxLossValues)) {
    means = at::stack(losses).reshape({-1});
    args.stacked_losses = means.const_data_ptr<double>();
  } else {
    for (size_t i = 0; i < losses.size(); ++i) {
      args.losses[i] = losses[i].const_data_ptr<double>();  // one float64 value each (checked)
    }
  }
  args.loss_names = static_cast<int>(loss_calls.size());
  for (size_t j = 0; j < loss_calls.size(); ++j) {
    args.loss_first[j + 1] = args.loss_first[j] + loss_calls[j];
  }
  args.found_inf = scalar_of(found_inf, found_keep);
  args.grad_scale = scalar_of(grad_scale, grad_scale_keep);
  args.scale = scalar_of(scale, scale_keep);
  args.nan_only = nan_only;
  at::Tensor out = at::empty({step_summary_size(loss_calls, scale.has_value(), n_groups)},
                             recorded[0].options().dtype(at::kDouble));
  step_summary_kernel<<<1, kThreads, 0, stream>>>(args, out.mutable_data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace nanfast::cuda

TORCH_LIBRARY_IMPL(nanfast, CUDA, m) {
  m.impl("stats", &nanfast::cuda::stats_cuda);
  m.impl("any_nonfinite", &nanfast::cuda::any_nonfinite_cuda);
  m.impl("step_summary", &nanfast::cuda::step_summary_cuda);
}

// Operator schemas (the one TORCH_LIBRARY of nanfast) and the host-side input handling that the
// CPU and CUDA implementations share.
#include "ops.h"
#include "parallel_items.h"

#include <algorithm>
#include <atomic>
#include <numeric>

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace nanfast {

namespace {

// NOTE: [Data pointers on every thread]
// A tensor's data pointer is the one thing describe_inputs reads from its StorageImpl, and in a long list
// of small tensors every StorageImpl is a cache miss of its own (each lies next to its tensor's data, a
// page apart): two thirds of describe_inputs' samples, on one thread while the others waited. So the
// entries are checked and described from their TensorImpls first, and their data pointers read after,
// split over the threads when there are at least kThreadedPointers of them. On the 2-vCPU AMD EPYC VM of
// issue 19, bench.py's 5000 x 1024 float32, nine alternating pairs of processes: stats from a median of
// 1.00 to 0.89 ms (faster in 8 of 9 pairs; 41x to 46x the per-tensor assert), any_nonfinite 0.93 to 0.75
// ms; describe_inputs from 2.8% to 0.8% of a cold loop's samples. They are read in chunks, which a thread
// done with its own takes from a late one (see NOTE: [Threads that wake late]). A data pointer that
// cannot be read (a storage that refuses access) raises torch's own error for the first such entry, as
// reading them in order would.
constexpr size_t kThreadedPointers = 1024;
constexpr int64_t kPointersPerChunk = 64;

// NOTE: [A storage smaller than its tensor]
// FSDP (1) and parameter offloading free a tensor's memory between its uses by resizing its storage to
// 0 bytes, leaving the tensor's sizes as they were; reading it then reads freed memory (torch's own ops
// crash on it too). Its storage's size is read with its data pointer, and one that cannot hold the
// tensor's extent is refused, naming the entry.
void read_data_pointers(const char* op, at::TensorList tensors, std::vector<InputRun>& runs) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  // Reads entries [i, end) in order; on a refusal `i` is the entry that refused.
  auto read = [&](int64_t& i, int64_t end) {
    for (; i < end; ++i) {
      if (i + static_cast<int64_t>(kStorageAhead) < end) {
        // See NOTE: [Thousands of small tensors' metadata]; a tensor without storage prefetches null, a no-op.
        __builtin_prefetch(tensors[i + kStorageAhead].unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
      }
      const at::Tensor& t = tensors[i];
      runs[i].data = t.const_data_ptr();  // a complex tensor's real view starts at the same byte
      if (t.numel() > 0) {
        const size_t extent = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.itemsize(),
                                                               static_cast<size_t>(t.storage_offset()));
        TORCH_CHECK(t.storage().nbytes() >= extent, op, ": tensors[", i, "] reaches ", extent,
                    " bytes into its storage, which holds ", t.storage().nbytes(),
                    " (freed or shrunk, as FSDP and offloading do between uses): it has no values to read");
        // A wrapper subclass's own TensorImpl reached the kernel (its __torch_dispatch__ passed itself on):
        // its storage claims bytes at no address (a probe, session 45: a crash, as in torch's own ops).
        TORCH_CHECK(runs[i].data != nullptr, op, ": tensors[", i, "] holds ", t.numel(),
                    " elements at no address (a tensor subclass's wrapper, not the tensor holding its values)");
      }
    }
  };
  int64_t i = 0;
  if (tensors.size() < kThreadedPointers || at::in_parallel_region()) {
    read(i, n);
    return;
  }
  std::atomic<int64_t> first_refused{n};
  parallel_items(n, kPointersPerChunk, [&](int64_t begin, int64_t end) {
    int64_t k = begin;
    try {
      read(k, end);
    } catch (const c10::Error&) {
      int64_t seen = first_refused.load();
      while (k < seen && !first_refused.compare_exchange_weak(seen, k)) {
      }
    }
  });
  i = first_refused.load();
  if (i < n) {
    read(i, i + 1);  // throws that entry's error, the first in order
    TORCH_INTERNAL_ASSERT(false, "a data pointer refused on one thread was read on another");
  }
}

}  // namespace

std::vector<InputRun> describe_inputs(const char* op, at::TensorList tensors) {
  std::vector<InputRun> runs;
  runs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& input = tensors[i];
    TORCH_CHECK(input.defined(), op, ": tensors[", i, "] is undefined");
    TORCH_CHECK(
        input.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", input.layout(),
        "; only strided tensors are supported (check a sparse tensor's .values(), or .to_dense() it)");
    TORCH_CHECK(
        input.device() == tensors[0].device(), op, ": tensors[", i, "] is on ", input.device(), " but tensors[0] is on ",
        tensors[0].device(), "; pass the tensors of one device per call");
    InputRun& run = runs.emplace_back();
    // Only a complex input needs a new (real) view; copying a Tensor costs refcount traffic per entry.
    TORCH_INTERNAL_ASSERT(!input.is_conj(), "the Conjugate fallback resolves conjugated views");
    const at::Tensor real_view = input.is_complex() ? at::view_as_real(input) : at::Tensor();
    const at::Tensor& t = input.is_complex() ? real_view : input;
    TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": tensors[", i, "] has unsupported dtype ", t.scalar_type());
    TORCH_CHECK(
        !t.is_neg() || at::isFloatingType(t.scalar_type()) || at::isSignedType(t.scalar_type()), op, ": tensors[", i,
        "] is a negative view of an unsigned ", t.scalar_type(), " tensor (its values wrap around); pass .resolve_neg()");
    run.dtype = t.scalar_type();
    run.numel = t.numel();
    run.negated = t.is_neg();
    if (run.numel == 0 || t.is_non_overlapping_and_dense()) {
      continue;
    }
    run.dense = false;
    // Expanded dimensions out, memory order (largest stride first), then merge dimensions that are
    // contiguous with each other.
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.stride(d) == 0) {
        run.repeats *= t.size(d);
      } else if (t.size(d) != 1) {
        dims.push_back(d);
      }
    }
    run.numel /= run.repeats;
    if (dims.empty()) {
      run.dense = true;  // one element, repeated
      continue;
    }
    std::stable_sort(dims.begin(), dims.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
    for (int64_t d : dims) {
      if (!run.sizes.empty() && run.strides.back() == t.stride(d) * t.size(d)) {
        run.sizes.back() *= t.size(d);
        run.strides.back() = t.stride(d);
      } else {
        run.sizes.push_back(t.size(d));
        run.strides.push_back(t.stride(d));
      }
    }
  }
  read_data_pointers(op, tensors, runs);
  return runs;
}

void fix_negated_counts(const std::vector<InputRun>& runs, at::Tensor& counts) {
  std::vector<int64_t> negated;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].negated) {
      negated.push_back(static_cast<int64_t>(i));
    }
  }
  if (negated.empty()) {
    return;
  }
  // Built on the host and copied without blocking: no sync on CUDA.
  const at::Tensor rows = at::tensor(negated, at::kLong).to(counts.device(), /*non_blocking=*/true);
  const at::Tensor swapped = at::tensor({0, 2, 1}, at::kLong).to(counts.device(), /*non_blocking=*/true);
  counts.index_copy_(0, rows, counts.index_select(0, rows).index_select(1, swapped));
}

void apply_repeats(const std::vector<InputRun>& runs, at::Tensor& counts, at::Tensor& norm) {
  if (std::all_of(runs.begin(), runs.end(), [](const InputRun& r) { return r.repeats == 1; })) {
    return;
  }
  std::vector<int64_t> repeats(runs.size());
  std::transform(runs.begin(), runs.end(), repeats.begin(), [](const InputRun& r) { return r.repeats; });
  // Built on the host and copied without blocking: no sync on CUDA.
  const at::Tensor factor = at::tensor(repeats, at::kLong).to(counts.device(), /*non_blocking=*/true);
  counts.mul_(factor.unsqueeze(1));
  norm.mul_(factor.to(at::kDouble).sqrt());
}

TORCH_LIBRARY(nanfast, m) {
  m.def(
      "stats(Tensor[] tensors) -> (Tensor counts, Tensor norm, Tensor absmax)",
      {at::Tag::pt2_compliant_tag});
  m.def("any_nonfinite(Tensor[] tensors) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("combine_norms(Tensor norms) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def(
      "step_summary(Tensor[] recorded, Tensor? recorded_counted, Tensor? counts, Tensor? norm, Tensor? absmax, "
      "int n_params, Tensor? counted, bool nan_only, Tensor? found_inf, Tensor? grad_scale, Tensor[] losses, "
      "int[] loss_calls, Tensor? scale, Tensor? groups, int n_groups) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

// The outputs are statistics, not differentiable functions of the inputs.
TORCH_LIBRARY_IMPL(nanfast, Autograd, m) {
  m.impl("stats", torch::CppFunction::makeFallthrough());
  m.impl("any_nonfinite", torch::CppFunction::makeFallthrough());
  m.impl("step_summary", torch::CppFunction::makeFallthrough());
}

// NOTE: [A list with no kernel to dispatch to]
// The dispatcher picks a kernel by the devices of the tensors; an empty list has none, and
// torch.ops.nanfast.stats([]) raised "no fallback function is registered" (a probe, session 42) where
// nanfast.stats([]) and the fake kernel give empty results. These kernels take what no backend's does:
// the empty list, whose results they give, and a device without a kernel, which they name.
namespace {

void check_no_tensors(const char* op, at::TensorList tensors) {
  TORCH_CHECK(tensors.empty(), op, ": no kernel for ", tensors[0].device().type(),
              " tensors (nanfast reads CPU and CUDA tensors)");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_of_no_tensors(at::TensorList tensors) {
  check_no_tensors("nanfast.stats", tensors);
  return {at::empty({0, 3}, at::kLong), at::empty({0}, at::kDouble), at::empty({0}, at::kDouble)};
}

at::Tensor any_nonfinite_of_no_tensors(at::TensorList tensors) {
  check_no_tensors("nanfast.any_nonfinite", tensors);
  return at::zeros({}, at::kBool);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfast, CompositeExplicitAutograd, m) {
  m.impl("stats", &stats_of_no_tensors);
  m.impl("any_nonfinite", &any_nonfinite_of_no_tensors);
}

// See NOTE: [Inputs as the kernels see them]: negative views are read in place.
TORCH_LIBRARY_IMPL(nanfast, Negative, m) {
  m.impl("stats", torch::CppFunction::makeFallthrough());
  m.impl("any_nonfinite", torch::CppFunction::makeFallthrough());
}

}  // namespace nanfast

#pragma once
// Host-side code shared by every backend: how an input list is validated and described to kernels.

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtypes.h"

namespace nanfast {

// NOTE: [Inputs as the kernels see them]
// A complex tensor is read as its real view (real and imaginary parts are counted separately). A
// tensor with the negative bit is read through its memory, with +inf and -inf swapped afterwards
// (the Negative key falls through to the kernels). A conjugated view is resolved by PyTorch's
// Conjugate fallback before the kernels run (a copy): conjugation flips the sign of the imaginary
// parts only, which the per-tensor counts cannot express. A tensor that is
// non-overlapping and dense (contiguous, or a permutation such as a transposed weight) is read as
// one run in memory order: counts and norms do not depend on element order. Any other view
// (slices, overlapping strides) keeps coalesced sizes and strides and is read in place, one row at a
// time. Expanded dimensions (stride 0) repeat the same elements: they are left out of the read, and
// the counts and squares of what is read are multiplied by their sizes (see apply_repeats()).
struct InputRun {
  const void* data = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;  // elements read: twice the tensor's numel for complex, over `repeats`
  int64_t repeats = 1;  // how many of the tensor's elements each element read stands for
  bool negated = false;
  bool dense = true;
  // Only for views that are not dense, outermost first. Heap vectors keep a run small: thousands of
  // dense runs are described per call.
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

// NOTE: [Thousands of small tensors' metadata]
// A list of thousands of small tensors (5000 x 1024 float32 in bench.py; biases and norms of a big
// model) spends as long on the tensors' metadata as on their data: the Python objects, then each
// TensorImpl (read by the dispatcher for the list's dispatch keys and by describe_inputs), then each
// StorageImpl (the data pointer), every one a cache miss when the list comes cold after a training
// step. Each loop over the list requests the next loop's object ahead of time: BorrowedTensors the
// TensorImpl of the entry kMetadataAhead ahead, describe_inputs' data pointer reads the StorageImpl
// kStorageAhead ahead (see NOTE: [Data pointers on every thread] in ops.cpp).
// On the 2-vCPU AMD EPYC (Zen 4) VM of issue 19, with the caches flushed before each call (a 64 MB
// sum), _C.stats over 5000 one-element tensors took a median of 356 us without and 262 us with them
// (4 processes each, alternating), over 5000 x 1024 floats 686 vs 626 us; with warm caches 5% slower
// (150 -> 160 us, 370 -> 385 us). The core benchmark's 5000-tensor workload does not show it (its
// other methods have just walked the same list, so its metadata is warm): 0.98-1.16 ms against
// 1.02-1.08 ms without, three processes each. Prefetches are hints: nothing read changes.
constexpr size_t kMetadataAhead = 64;
constexpr size_t kStorageAhead = 32;

// Requests `t`'s TensorImpl (its sizes, strides, dtype and dispatch keys) into the cache.
inline void prefetch_impl(const at::Tensor& t) {
  const char* impl = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
  for (size_t b = 0; b < sizeof(c10::TensorImpl); b += 64) {
    __builtin_prefetch(impl + b);
  }
}

// Validates `tensors` for op `op` (one device, strided layout, a dtype of NANFAST_FOR_EACH_DTYPE) and
// describes each entry. Errors name the op and the offending entry.
std::vector<InputRun> describe_inputs(const char* op, at::TensorList tensors);

// Swaps the +inf and -inf columns of `counts` ([N, 3]) for inputs read with their negative bit.
void fix_negated_counts(const std::vector<InputRun>& runs, at::Tensor& counts);

// The L2 norm of a concatenation from its parts' L2 norms (float64 [N] -> 0-dim): torch.ops.nanfast.combine_norms
// (csrc/combine_norms.cpp, see NOTE: [Combining norms]).
at::Tensor combine_norms(const at::Tensor& norms);

// Checks the inputs of nanfast.step_summary (csrc/step_summary.cpp, see NOTE: [The step's summary in one
// call]); errors name the argument.
void check_step_summary_inputs(at::TensorList recorded, const std::optional<at::Tensor>& recorded_counted,
                               const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& norm,
                               const std::optional<at::Tensor>& absmax,
                               int64_t n_params, const std::optional<at::Tensor>& counted,
                               const std::optional<at::Tensor>& found_inf,
                               const std::optional<at::Tensor>& grad_scale, at::TensorList losses,
                               at::IntArrayRef loss_calls, const std::optional<at::Tensor>& scale,
                               const std::optional<at::Tensor>& groups, int64_t n_groups);

// The length of nanfast.step_summary's result: 8, one per loss name, the scale, one per module.
int64_t step_summary_size(at::IntArrayRef loss_calls, bool has_scale, int64_t n_groups);

// Scales the counts ([N, 3]) and norms ([N]) of expanded inputs by their repeats: each element read
// stands for `repeats` elements, so counts and squares are that many times larger.
void apply_repeats(const std::vector<InputRun>& runs, at::Tensor& counts, at::Tensor& norm);

}  // namespace nanfast

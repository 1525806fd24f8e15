#pragma once
// nanfast._C.WatchRecorder: where nanfast.watch's hooks leave the counts of a step (see NOTE: [The
// watch's recorder] in watch_records.h). Declared here so that the module hooks (module_hooks.h)
// call it directly, without a round trip through Python.
#include <memory>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <torch/csrc/autograd/function.h>

#include "bindings.h"
#include "watch_records.h"

namespace nanfast::python {

struct GradSlot;

class NANFAST_HIDDEN WatchRecorder {
 public:
  WatchRecorder(at::Device device, bool profiled, int64_t fuse_bytes, bool counts_as_tensors)
      : records_(std::make_shared<Records>(device, profiled, fuse_bytes, counts_as_tensors)) {}

  // Appends the NaN/+inf/-inf counts of `tensors` (one row each) as slot `slot`; the -inf of rows
  // `masks` (additive masks of the model's input) are not counted; `kept_in_place`: they are the output
  // of an in-place activation that keeps non-finite values (NOTE: [Non-finite values an in-place
  // activation keeps] in deferred_records.h); `call_began`: record_count() when the call of the module whose
  // output they are began (NOTE: [A child's output a module changes in place and returns]), -1 for none.
  void record(py::handle tensors, int64_t slot, std::vector<int64_t> masks = {}, bool kept_in_place = false,
              int64_t call_began = -1);

  // The number of records made in this step so far.
  int64_t record_count();

  // Whether records are deferred to a fused call (NOTE: [Fused records]).
  bool fused() const {
    return records_->fuse_bytes > 0;
  }

  // Checks the gradient w.r.t. each of `tensors` in backward as slot `slot`: one pre-hook per (autograd
  // node, output) until forget(); a tensor hooked before is retargeted to `slot`. Leaves (no node) are
  // skipped: their gradients are the parameters'.
  void hook_grads(py::handle tensors, int64_t slot);

  // torch.ops.nanfast.stats over `tensors` (as nanfast._C.stats_on) in the same call as the deferred
  // records (see NOTE: [Fused records]): the step's pass and the backward's checks in one.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_with_deferred(py::handle tensors, at::Device device);

  // Ends a forward: later tensors get hooks of their own (the ones placed stay on their nodes). Deferred
  // records wait for the step's pass (see NOTE: [Fused records]).
  void forget();

  // The step's records, in execution order, which are emptied: the counts packed (a list of int64
  // [rows, 3] on the device, one per fused call that checked them, in row order; at least one, of no
  // rows for none: NOTE: [Records taken as views]), with which of their cells count (int64 0/1
  // [rows, 3] on the device, None when all do: NOTE: [Cells a record does not count]); (slot, rows)
  // per record; and for the records holding low-precision tensors (see NOTE: [Overflow headroom in the
  // recorder]) their rows' max |x| packed (float64 [k] on the device; None when there is none) with
  // (slot, largest finite value of the row's dtype or 0) per row. With `first_slot`, only the records of
  // slots `first_slot` and later are taken; the earlier ones stay (an evaluation forward inside a
  // training step: NOTE: [An evaluation inside a training step]).
  py::tuple take(int64_t first_slot = 0);

  // Whether the step's records so far count nothing; None where that is not known on the host without
  // a read from the device (an accelerator's recorder, deferred records).
  py::object finite();

  // Drops the records; the gradient checks placed so far do nothing from now on.
  void clear();

  // Drops a forward that raised: the records of slots `first_slot` and later, and the gradient checks
  // it placed (those since forget()), which do nothing from now on.
  void discard(int64_t first_slot);

  // True if a backward that checks fired in raised (see NOTE: [A backward that raised]), once; false
  // while a backward is running (a checkpointed model's forward runs again inside one).
  bool backward_failed();

  // Whether a backward of the whole graph that checks fired in finished since the last call and in this
  // step (see NOTE: [A backward that raised] in watch_records.h).
  bool backward_finished();

  // Seconds in kernel calls, the part of them in gradient checks, bytes read, fused-op calls made: totals
  // since the recorder began (zeros unless profiled).
  std::tuple<double, double, int64_t, int64_t> costs();

  // Hooks still on a graph do nothing from now on.
  void disable();

 private:
  // A shared_ptr before torch 2.14, an intrusive_ptr since.
  using NodePtr = std::decay_t<decltype(std::declval<at::Tensor>().grad_fn())>;
  using Key = std::pair<const torch::autograd::Node*, uint32_t>;
  struct KeyHash {
    size_t operator()(const Key& key) const {
      return std::hash<const torch::autograd::Node*>()(key.first) ^
             (static_cast<size_t>(key.second) * 0x9e3779b97f4a7c15ULL);
    }
  };
  struct Hooked {
    NodePtr node;
    std::shared_ptr<GradSlot> slot;
  };

  // A take's mask of counted cells on the device, for its cells not counted (packed row * 3 + first
  // column), made anew only where no recent take's had the same (see NOTE: [Cells a record does not
  // count]).
  at::Tensor counted_cells(const std::vector<int64_t>& uncounted, int64_t rows);

  struct CountedCells {
    std::vector<int64_t> uncounted;
    at::Tensor counted;
  };
  static constexpr size_t kMasksKept = 4;

  const std::shared_ptr<Records> records_;
  std::unordered_map<Key, Hooked, KeyHash> hooked_;
  std::vector<CountedCells> masks_;  // the recent takes' masks, the latest first: at most kMasksKept
};

}  // namespace nanfast::python

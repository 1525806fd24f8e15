// nanfast._C.WatchRecorder: where nanfast.watch's hooks leave the counts of a step.
#include "watch_recorder.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace nanfast::python {

// NOTE: [Gradient checks outliving their step]
// A gradient check lives as long as its graph, and its slot id means something only within the step
// that placed it (the Python side numbers slots from 0 each step). A backward run after its step ended
// (w.step() between a forward and its backward), or through what is left of a forward that raised,
// must not record into a later step under another slot's name. So a check records only while the epoch
// it was placed in lasts (clear() starts a new one), and a forward that raised marks its checks dead
// (slot id kDeadSlot, see discard()). Such gradients still reach the parameters' gradients, which the
// next step checks.
constexpr int64_t kDeadSlot = -1;

// What a gradient check records as: retargeted when a later module takes the same tensor.
struct GradSlot {
  GradSlot(int64_t id, int64_t epoch) : id(id), epoch(epoch) {}
  std::atomic<int64_t> id;
  const int64_t epoch;  // the Records epoch it was placed in
};

namespace {

using torch::autograd::variable_list;

// A pre-hook on the autograd node that made a module's input: counts the gradient w.r.t. that input
// (the node's grad output `output_nr`), i.e. what flows out of the module in backward.
class GradCheck final : public torch::autograd::FunctionPreHook {
 public:
  GradCheck(std::shared_ptr<Records> records, std::shared_ptr<GradSlot> slot, uint32_t output_nr)
      : records_(std::move(records)), slot_(std::move(slot)), output_nr_(output_nr) {}

  variable_list operator()(const variable_list& grads) override {
    const int64_t slot = slot_->id;
    if (records_->enabled && slot != kDeadSlot && slot_->epoch == records_->epoch && output_nr_ < grads.size()) {
      Records::note_backward(records_);
      const at::Tensor& grad = grads[output_nr_];
      if (grad.defined() && (grad.layout() == at::kStrided || grad.layout() == at::kJagged)) {
        // A jagged gradient (a Python subclass) is read through its values (stats_on takes the GIL).
        records_->add(grad, slot, /*grad_check=*/true);
      } else if (grad.defined() && grad.layout() == at::kSparse) {
        // The entries of a sparse COO gradient, duplicates uncoalesced (coalescing would sync the host
        // on CUDA): every non-finite entry is counted.
        records_->add(grad._values(), slot, /*grad_check=*/true);
      }
    }
    return grads;
  }

  // Compiled autograd asks each hook to add itself to the backward graph it traces; this one stays out
  // (see NOTE: [The watch and torch.compile]): the gradients it would have checked in that backward are
  // checked at the step, in the parameters' gradients. (The method became const in torch 2.6: both
  // forms, so that one overrides on either side.)
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const {}
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {}

 private:
  const std::shared_ptr<Records> records_;
  const std::shared_ptr<GradSlot> slot_;
  const uint32_t output_nr_;
};

// NOTE: [Records taken as views]
// A fused call checks many records at once (every deferred one: NOTE: [Fused records]); each record's
// rows are a range of that call's results, kept as the whole result and a first row rather than a view
// each (a narrow per record is host time in every step on a GPU, where the host bounds a small step).
// take() joins adjacent ranges of one call's results into one view, and hands the counts over as those
// views, one per call, which nanfast.step_summary sums where they lie: a step is taken without an op
// that launches however many calls checked its records (a cat of two calls' counts was the fifth launch
// of the d=256 transformer's fused step, past the "three and one read" of issue 19). The max |x| of
// low-precision records (headroom), read by ops of their own, are joined by a cat where they span calls.
struct RowRange {
  at::Tensor base;  // one fused call's results
  int64_t row;
  int64_t rows;
};

std::vector<at::Tensor> row_views(const std::vector<RowRange>& ranges) {
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < ranges.size();) {
    const RowRange& first = ranges[i];
    int64_t end = first.row + first.rows;
    for (++i; i < ranges.size() && ranges[i].base.is_same(first.base) && ranges[i].row == end; ++i) {
      end += ranges[i].rows;
    }
    const bool whole = first.row == 0 && end == first.base.size(0);
    parts.push_back(whole ? first.base : first.base.narrow(0, first.row, end - first.row));
  }
  TORCH_INTERNAL_ASSERT(!parts.empty(), "nanfast.watch: row_views of no records");
  return parts;
}

}  // namespace

void WatchRecorder::record(py::handle tensors, int64_t slot, std::vector<int64_t> masks, bool kept_in_place,
                           int64_t call_began) {
  const BorrowedTensors inputs("nanfast.watch", tensors);
  if (inputs.list().empty()) {
    return;
  }
  py::gil_scoped_release no_gil;
  records_->add(inputs.list(), slot, /*grad_check=*/false, std::move(masks), kept_in_place, call_began);
}

int64_t WatchRecorder::record_count() {
  const std::lock_guard<std::mutex> lock(records_->mutex);
  return static_cast<int64_t>(records_->entries.size());
}

void WatchRecorder::hook_grads(py::handle tensors, int64_t slot) {
  const BorrowedTensors inputs("nanfast.watch", tensors);
  for (const at::Tensor& t : inputs.list()) {
    // NOTE: [A leaf's gradient]
    // A tensor made by no op has no grad_fn: its gradient arrives at its grad accumulator, whose pre-hook
    // sees it. Activation checkpointing with use_reentrant=True hands the checkpointed block its inputs
    // as such leaves, detached: the gradient out of the block's first module went unchecked, and a fault
    // there was named at a parameter's gradient further on (a probe, session 44).
    NodePtr node = t.grad_fn();
    uint32_t output_nr = t.output_nr();
    if (!node) {
      if (!t.requires_grad()) {
        continue;
      }
      node = torch::autograd::impl::grad_accumulator(t);
      output_nr = 0;
      if (!node) {
        continue;
      }
    }
    const auto [it, added] = hooked_.try_emplace(Key{node.get(), output_nr});
    if (!added) {
      it->second.slot->id = slot;
      continue;
    }
    it->second.node = node;  // keeps the address from being reused by another node until forget()
    it->second.slot = std::make_shared<GradSlot>(slot, records_->epoch.load());
    node->add_pre_hook(std::make_unique<GradCheck>(records_, it->second.slot, output_nr));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> WatchRecorder::stats_with_deferred(py::handle tensors, at::Device device) {
  const BorrowedTensors inputs("nanfast._C.WatchRecorder.stats_with_deferred", tensors);
  TORCH_CHECK(!inputs.list().empty(), "nanfast._C.WatchRecorder.stats_with_deferred: tensors is empty");
  TORCH_CHECK(device == records_->device, "nanfast._C.WatchRecorder.stats_with_deferred: device ", device,
              " is not the recorder's ", records_->device);
  const c10::AutoGradMode no_grad(false);  // as _C.stats_on: the pass's parameters require grad
  py::gil_scoped_release no_gil;
  return *records_->flush(inputs.list());
}

void WatchRecorder::forget() {
  hooked_.clear();
}

// NOTE: [Cells a record does not count]
// Some cells of a record's device counts must count nothing: an input's mask rows' -inf (NOTE:
// [Additive masks]) and, in a fused watch, the rows of a tensor written in place between its record and
// the flush that read it (NOTE: [Deferred tensors changed in place]: every block of torchvision's
// ResNets rewrites its bn2 output). Zeroing them was a launch each (a zero_ per mask row), then one
// multiply per flush by a mask of the flush's cells: the fourth op of ResNet-18's fused step, past the
// issue's "three and one read". A record notes its cells instead (Entry::uncounted); take() hands the
// step's mask of counted cells to nanfast.step_summary, which weighs the records' counts by it as it
// sums them, and a bad step's rows are multiplied by it when read. The mask is made on the host and
// copied to the device only when no recent take had the same cells: a model's steps leave out the
// same cells, so a healthy step adds no op for it. The last few masks are kept, not only the last: a
// loop that validates or makes a rollout between its steps, or inside the step's accumulation window
// (take(first_slot)), alternates two sets of cells, and made both anew at each step.
at::Tensor WatchRecorder::counted_cells(const std::vector<int64_t>& uncounted, int64_t rows) {
  if (uncounted.empty()) {
    return at::Tensor();
  }
  auto kept = std::find_if(masks_.begin(), masks_.end(), [&](const CountedCells& mask) {
    return mask.counted.size(0) == rows && mask.uncounted == uncounted;
  });
  if (kept == masks_.end()) {
    at::Tensor made = at::ones({rows, 3}, at::TensorOptions().dtype(at::kLong));
    int64_t* values = made.mutable_data_ptr<int64_t>();
    for (const int64_t cell : uncounted) {
      std::fill(values + cell, values + (cell / 3 + 1) * 3, 0);
    }
    if (masks_.size() == kMasksKept) {
      masks_.pop_back();
    }
    masks_.push_back(CountedCells{uncounted, made.to(records_->device, /*non_blocking=*/true)});
    kept = masks_.end() - 1;
  }
  std::rotate(masks_.begin(), kept, kept + 1);  // the latest first
  return masks_.front().counted;
}

// NOTE: [One call's max |x| in one view]
// The max |x| of the low-precision records (NOTE: [Overflow headroom in the recorder]) go to the host
// with the step. Under autocast a model's records alternate between float32 and bfloat16 (a LayerNorm's
// output is float32, the Linear after it bfloat16), so the limited records of one fused call were
// ranges with gaps between them, joined by a cat: a launch more in every fused step of the small
// transformer and ResNet-18 under CPU autocast (4 ops with a GPU's bookkeeping, past "three and one
// read"). A flush's records all keep its max |x|, and take() hands over, between two limited records
// of one call, the rows of those in between too, each with the limit 0 (what a float32 row of a mixed
// record has: nothing to warn of): one call's rows come out as one view.
py::tuple WatchRecorder::take(int64_t first_slot) {
  std::vector<Entry> entries;
  {
    py::gil_scoped_release no_gil;
    records_->flush();  // entries are split by index below: none may still be deferred
  }
  {
    const std::lock_guard<std::mutex> lock(records_->mutex);
    if (first_slot == 0) {
      entries.swap(records_->entries);
    } else {  // by slot, not position: a backward records earlier slots after later ones
      auto& kept = records_->entries;
      const auto tail = std::stable_partition(kept.begin(), kept.end(),
                                              [first_slot](const Entry& entry) { return entry.slot < first_slot; });
      entries.assign(std::make_move_iterator(tail), std::make_move_iterator(kept.end()));
      kept.erase(tail, kept.end());
    }
  }
  std::vector<std::pair<int64_t, int64_t>> slots;
  std::vector<std::pair<int64_t, double>> limited;
  std::vector<RowRange> counts;
  std::vector<RowRange> absmax;
  std::vector<int64_t> uncounted;  // row * 3 + first column, rows counted in packed order
  slots.reserve(entries.size());
  const auto last_limited = std::find_if(entries.rbegin(), entries.rend(),
                                         [](const Entry& entry) { return !entry.limits.empty(); });
  const size_t limited_end = entries.rend() - last_limited;  // entries from here on add no max |x|
  const bool on_host = records_->counts_on_host;  // see NOTE: [CPU counts kept as numbers]
  int64_t rows = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& entry = entries[i];
    slots.emplace_back(entry.slot, entry.rows);
    for (const int64_t cell : entry.uncounted) {
      uncounted.push_back(rows * 3 + cell);
    }
    rows += entry.rows;
    if (!on_host) {
      counts.push_back(RowRange{std::move(entry.counts), entry.row, entry.rows});
    }
    if (!entry.limits.empty()) {
      TORCH_INTERNAL_ASSERT(entry.absmax.defined() && static_cast<int64_t>(entry.limits.size()) == entry.rows &&
                                entry.row + entry.rows <= entry.absmax.size(0),
                            "nanfast.watch: a record's max |x| and its limits differ in length");
      for (const double limit : entry.limits) {
        limited.emplace_back(entry.slot, limit);
      }
      absmax.push_back(RowRange{std::move(entry.absmax), entry.row, entry.rows});
    } else if (i < limited_end && !absmax.empty() && entry.absmax.defined() &&
               absmax.back().base.is_same(entry.absmax) && absmax.back().row + absmax.back().rows == entry.row) {
      // Between two limited records of one call: its rows keep the call's view whole (see the NOTE above).
      limited.insert(limited.end(), entry.rows, {entry.slot, 0.0});
      absmax.push_back(RowRange{std::move(entry.absmax), entry.row, entry.rows});
    }
  }
  std::vector<at::Tensor> packed;
  at::Tensor packed_absmax;
  at::Tensor counted;
  {
    py::gil_scoped_release no_gil;
    counted = counted_cells(uncounted, rows);
    if (on_host) {
      at::Tensor numbers = at::empty({rows, 3}, at::kLong);
      int64_t* out = numbers.mutable_data_ptr<int64_t>();
      for (const Entry& entry : entries) {
        out = std::copy(entry.host.begin(), entry.host.end(), out);
      }
      packed.push_back(std::move(numbers));
    } else if (counts.empty()) {
      packed.push_back(at::empty({0, 3}, at::TensorOptions().dtype(at::kLong).device(records_->device)));
    } else {
      packed = row_views(counts);
    }
    if (!absmax.empty()) {
      const std::vector<at::Tensor> parts = row_views(absmax);
      packed_absmax = parts.size() == 1 ? parts[0] : at::cat(parts);
    }
  }
  return py::make_tuple(packed, counted.defined() ? py::cast(counted) : py::none(), slots,
                        packed_absmax.defined() ? py::cast(packed_absmax) : py::none(), limited);
}

py::object WatchRecorder::finite() {
  const std::optional<bool> finite = records_->finite();
  return finite.has_value() ? py::object(py::bool_(*finite)) : py::object(py::none());
}

void WatchRecorder::clear() {
  std::vector<Deferred> dropped;
  HeldStorages dropped_held;
  const std::lock_guard<std::mutex> lock(records_->mutex);
  records_->entries.clear();
  dropped.swap(records_->deferred);  // released after the lock (declared before it)
  std::swap(dropped_held, records_->held);
  records_->deferred_bytes = 0;
  records_->backward_finished = false;
  ++records_->epoch;
}

void WatchRecorder::discard(int64_t first_slot) {
  for (auto& [key, hooked] : hooked_) {
    hooked.slot->id = kDeadSlot;
  }
  hooked_.clear();
  {
    py::gil_scoped_release no_gil;
    records_->flush();  // entries are addressed by index: none may be deferred while some are erased
  }
  const std::lock_guard<std::mutex> lock(records_->mutex);
  auto& entries = records_->entries;
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [first_slot](const Entry& entry) { return entry.slot >= first_slot; }),
                entries.end());
}

bool WatchRecorder::backward_failed() {
  if (torch::autograd::get_current_graph_task_id() >= 0) {
    return false;
  }
  const std::lock_guard<std::mutex> lock(records_->mutex);
  const bool failed = !records_->backwards.empty();
  records_->backwards.clear();
  return failed;
}

bool WatchRecorder::backward_finished() {
  const std::lock_guard<std::mutex> lock(records_->mutex);
  return std::exchange(records_->backward_finished, false);
}

std::tuple<double, double, int64_t, int64_t> WatchRecorder::costs() {
  const std::lock_guard<std::mutex> lock(records_->mutex);
  return {std::chrono::duration<double>(records_->kernel_time).count(),
          std::chrono::duration<double>(records_->check_time).count(), records_->bytes, records_->calls};
}

void WatchRecorder::disable() {
  records_->enabled = false;
  forget();
  clear();
}

void bind_watch_recorder(py::module_& m) {
  py::class_<WatchRecorder>(m, "WatchRecorder",
                            "Where nanfast.watch's hooks leave a step's counts (see NOTE: [The watch's recorder]).")
      .def(py::init<at::Device, bool, int64_t, bool>(), py::arg("device"), py::arg("profiled") = false,
           py::arg("fuse_bytes") = 0, py::arg("counts_as_tensors") = false)
      .def("record", &WatchRecorder::record, py::arg("tensors"), py::arg("slot"),
           py::arg("masks") = std::vector<int64_t>{}, py::arg("kept_in_place") = false, py::arg("call_began") = -1)
      .def("hook_grads", &WatchRecorder::hook_grads, py::arg("tensors"), py::arg("slot"))
      .def("stats_with_deferred", &WatchRecorder::stats_with_deferred, py::arg("tensors"), py::arg("device"))
      .def("forget", &WatchRecorder::forget)
      .def("take", &WatchRecorder::take, py::arg("first_slot") = 0)
      .def("finite", &WatchRecorder::finite)
      .def("clear", &WatchRecorder::clear)
      .def("discard", &WatchRecorder::discard, py::arg("first_slot"))
      .def("backward_failed", &WatchRecorder::backward_failed)
      .def("backward_finished", &WatchRecorder::backward_finished)
      .def("costs", &WatchRecorder::costs)
      .def("disable", &WatchRecorder::disable);
  m.def(
      "limits_of",
      [](py::handle tensors) {
        const BorrowedTensors inputs("nanfast._C.limits_of", tensors);
        return limits_of(inputs.list());
      },
      "Each tensor's dtype's largest finite value, the headroom's limit (0 where it is not watched: float32, "
      "float64), as the recorder keeps them; [] when no tensor needs one.",
      py::arg("tensors"));
}

}  // namespace nanfast::python

#pragma once
// The counts of one watched step, in execution order (Records): what nanfast._C.WatchRecorder
// (watch_recorder.cpp) and its gradient checks append to, and what the watch takes once per step.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "../dtypes.h"
#include "bindings.h"
#include "deferred_records.h"

namespace nanfast::python {

using Clock = std::chrono::steady_clock;

// NOTE: [The watch's recorder]
// The watch checks the output of every module in forward and the gradient flowing out of every module
// in backward. In Python, a gradient check cost more than reading a small activation: a Python object
// for the autograd node, a RemovableHandle for its pre-hook, then a Python call in backward. The
// recorder does that bookkeeping in C++. Each check appends its counts, in execution order, with the
// id of its slot (what was checked: phase, module, call, which the Python side keeps); gradient checks
// are C++ pre-hooks on the autograd nodes, which the engine runs without the GIL. The watch takes
// everything once per step.

// NOTE: [Overflow headroom in the recorder]
// The watch warns when a low-precision place's max |x| nears its dtype's largest finite value
// (nanfast/watcher/headroom.py). The fused op computes every tensor's max |x| anyway; the recorder keeps
// it, with that maximum, for the records that hold a float16, bfloat16 or float8 tensor, decided on the
// host from the dtype when the record is made. A record of float32/float64 tensors keeps nothing more
// than its counts, so a model without low-precision places pays nothing (take() returns None for it).

// The largest finite value of `dtype` for the dtypes whose headroom is watched; 0 for the others
// (float32 and float64 need no watching; integers and float4 saturate or cannot overflow).
inline double max_finite(at::ScalarType dtype) {
  if (!can_be_nonfinite(dtype)) {
    return 0.0;
  }
  return visit_dtype</*kFloatingOnly=*/true>(dtype, [](auto tag) {
    using T = typename decltype(tag)::type;
    // 16 bits or fewer, with a largest finite value (float4_e2m1fn_x2 packs two values and has none).
    if constexpr (sizeof(T) <= 2 && std::numeric_limits<T>::is_specialized) {
      return static_cast<double>(std::numeric_limits<T>::max());
    } else {
      return 0.0;
    }
  });
}

// NOTE: [CPU counts kept as numbers]
// A record's counts are a fresh [rows, 3] tensor, still in cache when the record is made. Kept as a
// tensor until the step's end, each is a cold TensorImpl, StorageImpl and data line by the time take()
// concatenates them, after the model's backward went through the caches: take() cost 76-88 us for
// ResNet-18 64x64's 91 records in the watch suite's steps (20 us for the small transformer's 23), and
// 13 us for 90 records in a loop of records alone. On CPU the three numbers per row are copied into
// the entry when it is made (in cache; nothing is read later from the tensor) and take() writes them
// into one new tensor: 19 us (9 us) a step. (Counts computed elsewhere for a CPU recorder have landed:
// see NOTE: [Results copied to the CPU].) A GPU recorder's counts stay on the GPU.

// One record: its counts [rows, 3] (on the device, rows [row, row + rows) of its fused call's counts,
// kept whole: see NOTE: [Records taken as views]; on CPU the numbers, see NOTE: [CPU counts kept as
// numbers]) and the slot id; for a record holding a low-precision tensor, its max |x| per row (the same
// rows of its call's float64 max |x|) and each row's dtype's largest finite value (0 for a row that
// needs none). See NOTE: [Overflow headroom in the recorder].
struct Entry {
  at::Tensor counts;  // undefined on CPU: `host` holds them
  c10::SmallVector<int64_t, 6> host;  // CPU: rows x (NaN, +inf, -inf)
  int64_t row = 0;   // the record's first row in `counts` and `absmax`
  int64_t rows = 0;
  int64_t slot = 0;
  at::Tensor absmax;  // undefined unless `limits` is non-empty, or a flush's (NOTE: [One call's max |x| in one view])
  std::vector<double> limits;
  // Rows (of this record) named as additive masks: their -inf are not counted (see NOTE: [Additive
  // masks] in nanfast/intended.py). Only the model's input has any.
  std::vector<int64_t> masks;
  // Device counts: the cells of its rows that count nothing, k * 3 + the first column not counted, of
  // each row k that counts less (a mask row's -inf, a tensor rewritten before its flush): applied by the
  // step's summary (NOTE: [Cells a record does not count]). CPU: zeroed in `host` instead.
  std::vector<int64_t> uncounted;
};

// The limits of `tensors` (see max_finite), or an empty vector when none of them needs one.
inline std::vector<double> limits_of(at::TensorList tensors) {
  std::vector<double> limits;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const double limit = max_finite(tensors[i].scalar_type());
    if (limit > 0 && limits.empty()) {
      limits.resize(tensors.size(), 0.0);
    }
    if (!limits.empty()) {
      limits[i] = limit;
    }
  }
  return limits;
}

// NOTE: [Fused records]
// By default each record is one fused call made at once, while the tensor is fresh in cache: on a CPU
// the cheapest way. On a GPU each call is a launch and a host round of dispatch, so a watch made with
// fuse=True defers them: a record keeps its tensors (and its place in execution order), and one call
// checks every deferred tensor: the step's pass over parameters and gradients (stats_with_deferred),
// or the take of the step's records when there is no pass (inference, a step without parameters), or
// any record that brings the deferred tensors to `fuse_bytes` (a bound on the memory they keep alive
// past their use). A step is then two calls, the pass with every forward's and backward's checks in it
// and the summary: on a GPU each call costs two launches and ~17 us of host time (H200), and a fast
// step is bound by its host. What it gives up: a value checked at that call is the tensor as it is
// then; an in-place op in between that made it finite (ReLU over -inf) hides it.

// The counts of one step, in execution order. Shared with the gradient checks, which may run on an
// autograd engine thread (one per CUDA device) and which live as long as their graph.
struct Records {
  Records(at::Device device, bool profiled, int64_t fuse_bytes, bool counts_as_tensors)
      : device(device), counts_on_host(device.is_cpu() && !counts_as_tensors), fuse_bytes(fuse_bytes),
        profiled(profiled) {}

  // Appends the counts of `tensors` as slot `slot`, the -inf of rows `masks` not counted; `grad_check`:
  // called by a gradient check; `kept_in_place`: the output of an in-place activation that keeps
  // non-finite values (NOTE: [Non-finite values an in-place activation keeps]); `call_began`: the number
  // of entries when the call of the module whose output they are began (-1: none; NOTE: [A child's
  // output a module changes in place and returns]).
  void add(at::TensorList tensors, int64_t slot, bool grad_check, std::vector<int64_t> masks = {},
           bool kept_in_place = false, int64_t call_began = -1) {
    // A tensor subclass is read at once (stats_on takes the GIL for it: NOTE: [Tensor subclasses read
    // through their plain tensors]), not deferred to a flush that holds `mutex`.
    const bool subclass = std::any_of(tensors.begin(), tensors.end(),
                                      [](const at::Tensor& t) { return t.unsafeGetTensorImpl()->is_python_dispatch(); });
    if (fuse_bytes > 0 && !subclass) {
      defer(tensors, slot, std::move(masks), kept_in_place, call_began);
      return;
    }
    const Clock::time_point start = profiled ? Clock::now() : Clock::time_point{};
    const auto [counts, norm, absmax] = stats_on(tensors, device);
    const std::vector<double> limits = limits_of(tensors);
    Entry entry;
    entry.slot = slot;
    entry.masks = std::move(masks);
    fill(entry, counts, absmax, limits, 0, static_cast<int64_t>(tensors.size()));
    const std::lock_guard<std::mutex> lock(mutex);
    entries.push_back(std::move(entry));
    if (profiled) {
      count_call(start, bytes_of(tensors), grad_check);
    }
  }

  // Fills `entry` with rows [row, row + rows) of one fused call whose inputs' limits are `limits`
  // (empty: none needs one); its max |x| is kept only if one of its rows needs it (see NOTE:
  // [Overflow headroom in the recorder]). The -inf of its mask rows are not counted: zeroed in the host's
  // numbers, or for device counts noted as cells the summary leaves out (NOTE: [Cells a record does not
  // count]).
  void fill(Entry& entry, const at::Tensor& counts, const at::Tensor& absmax, const std::vector<double>& limits,
            int64_t row, int64_t rows) const {
    entry.row = row;
    entry.rows = rows;
    for (const int64_t mask : entry.masks) {
      TORCH_INTERNAL_ASSERT(mask >= 0 && mask < rows, "nanfast.watch: a mask row outside its record");
    }
    if (counts_on_host) {  // see NOTE: [CPU counts kept as numbers]
      TORCH_INTERNAL_ASSERT(counts.is_contiguous() && counts.scalar_type() == at::kLong,
                            "nanfast.watch: the fused op's counts are not contiguous int64");
      const int64_t* values = counts.const_data_ptr<int64_t>() + 3 * row;
      entry.host.assign(values, values + 3 * rows);
      for (const int64_t mask : entry.masks) {
        entry.host[3 * mask + 2] = 0;
      }
    } else {
      for (const int64_t mask : entry.masks) {
        entry.uncounted.push_back(mask * 3 + 2);
      }
      entry.counts = counts;
    }
    if (limits.empty()) {
      return;
    }
    std::vector<double> kept(limits.begin() + row, limits.begin() + row + rows);
    for (const int64_t mask : entry.masks) {
      kept[mask] = 0.0;  // a mask's magnitude is a sentinel (finfo.min), not values growing toward overflow
    }
    if (std::any_of(kept.begin(), kept.end(), [](double limit) { return limit > 0; })) {
      entry.absmax = absmax;
      entry.limits = std::move(kept);
    }
  }

  static int64_t bytes_of(at::TensorList tensors) {
    int64_t nbytes = 0;
    for (const at::Tensor& t : tensors) {
      nbytes += t.numel() * t.element_size();
    }
    return nbytes;
  }

  // Whether every record so far counts nothing: known on the host only while each record's counts are
  // numbers there (a CPU recorder, nothing deferred); nullopt otherwise, where knowing would need a
  // read from the device. See NOTE: [Parameters read when they add information] (fused_pass.py).
  std::optional<bool> finite() {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!deferred.empty()) {
      return std::nullopt;
    }
    for (const Entry& entry : entries) {
      if (entry.counts.defined()) {
        return std::nullopt;
      }
      if (std::any_of(entry.host.begin(), entry.host.end(), [](int64_t count) { return count != 0; })) {
        return false;
      }
    }
    return true;
  }

  // A profiled watch's accounting of one fused call (under `mutex`).
  void count_call(Clock::time_point start, int64_t nbytes, bool grad_check) {
    const auto spent = Clock::now() - start;
    kernel_time += spent;
    if (grad_check) {
      check_time += spent;
    }
    ++calls;
    bytes += nbytes;
  }

  // Keeps `tensors` for the next flush, as slot `slot` (see NOTE: [Fused records]).
  void defer(at::TensorList tensors, int64_t slot, std::vector<int64_t> masks, bool kept_in_place,
             int64_t call_began) {
    const int64_t nbytes = profiled ? bytes_of(tensors) : 0;  // only a profiled watch reports bytes read
    bool full = false;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      Entry& entry = entries.emplace_back();
      entry.slot = slot;
      entry.masks = std::move(masks);
      std::vector<int64_t> versions(tensors.size());
      std::transform(tensors.begin(), tensors.end(), versions.begin(), version_of);
      deferred.push_back(
          Deferred{entries.size() - 1, tensors.vec(), std::move(versions), kept_in_place, call_began});
      for (const at::Tensor& t : tensors) {
        held.add(t);
      }
      deferred_bytes += nbytes;
      // NOTE: [Deferred bytes that only the records keep alive] (deferred_records.h)
      full = held.referenced_bytes() >= fuse_bytes && held.alone_bytes() >= fuse_bytes;
    }
    if (full) {
      flush();
    }
  }

  using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

  // Checks every deferred tensor in one call and fills their entries; with `extra` tensors (the step's
  // pass over parameters and gradients) in the same call, whose rows it returns (that call is the
  // pass's: the caller counts it). Call it without the mutex and, from Python, without the GIL:
  // dropping the last reference to a tensor may take the GIL.
  std::optional<Stats> flush(at::TensorList extra = {}) {
    std::vector<Deferred> done;
    HeldStorages done_held;
    std::optional<Stats> result;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      if (deferred.empty()) {
        if (!extra.empty()) {
          result = stats_on(extra, device);
        }
        return result;
      }
      const Clock::time_point start = profiled ? Clock::now() : Clock::time_point{};
      std::vector<at::Tensor> all;
      for (const Deferred& d : deferred) {
        all.insert(all.end(), d.tensors.begin(), d.tensors.end());
      }
      const int64_t own = static_cast<int64_t>(all.size());
      all.insert(all.end(), extra.begin(), extra.end());
      auto [counts, norm, absmax] = stats_on(all, device);
      const std::vector<double> limits = limits_of(all);
      int64_t row = 0;
      for (const Deferred& d : deferred) {
        const int64_t rows = static_cast<int64_t>(d.tensors.size());
        TORCH_INTERNAL_ASSERT(d.entry < entries.size(), "nanfast.watch: a deferred record outlived its entry");
        fill(entries[d.entry], counts, absmax, limits, row, rows);
        entries[d.entry].absmax = absmax;  // kept by every record: NOTE: [One call's max |x| in one view]
        row += rows;
      }
      zero_rewritten_rows(deferred, [&](size_t e, int64_t k, int64_t from) {
        Entry& entry = entries[e];
        if (!entry.limits.empty()) {
          entry.limits[k] = 0.0;  // and needs no headroom
        }
        if (entry.counts.defined()) {
          entry.uncounted.push_back(k * 3 + from);
        } else {
          std::fill_n(entry.host.begin() + 3 * k + from, 3 - from, 0);
        }
      });
      if (!extra.empty()) {
        const int64_t n = static_cast<int64_t>(extra.size());
        result = Stats{counts.narrow(0, own, n), norm.narrow(0, own, n), absmax.narrow(0, own, n)};
      }
      if (profiled) {
        if (extra.empty()) {
          count_call(start, deferred_bytes, /*grad_check=*/false);
        } else {
          bytes += deferred_bytes;  // the call itself is the pass's, which its caller counts
        }
      }
      done.swap(deferred);
      std::swap(done_held, held);
      deferred_bytes = 0;
    }
    return result;
  }  // `done` and `done_held` release the tensors here, outside the mutex

  // NOTE: [A backward that raised]
  // The first check to fire in a backward (a graph task) notes the task and queues an engine callback,
  // which runs when the task finishes without error and forgets it. A task still noted once no backward
  // is running raised (an out-of-memory error the loop caught): backward_failed() tells the watch, which
  // drops that microbatch's records. A backward that raises before any check fired goes unnoticed.
  // The callback also notes a backward of the whole graph (`loss.backward()`, no `inputs=`: one that
  // accumulates into every leaf's .grad; autograd.grad is not one) that finished in this step (see NOTE:
  // [A batch the loop abandons] in nanfast/watcher/forwards.py).
  static void note_backward(const std::shared_ptr<Records>& self) {
    const int task = torch::autograd::get_current_graph_task_id();
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    const bool whole_graph = exec_info != nullptr && exec_info->empty();
    int64_t epoch_now = 0;
    {
      const std::lock_guard<std::mutex> lock(self->mutex);
      if (!self->backwards.insert(task).second) {
        return;
      }
      epoch_now = self->epoch;
    }
    std::weak_ptr<Records> weak = self;
    torch::autograd::Engine::get_default_engine().queue_callback([weak, task, whole_graph, epoch_now] {
      if (const auto records = weak.lock()) {
        const std::lock_guard<std::mutex> lock(records->mutex);
        records->backwards.erase(task);
        records->backward_finished = records->backward_finished || (whole_graph && records->epoch == epoch_now);
      }
    });
  }

  const at::Device device;
  // The records' counts kept as numbers on the host (a CPU recorder: NOTE: [CPU counts kept as numbers]),
  // else as the tensors the fused calls gave, as on a GPU: a CPU recorder made with counts_as_tensors
  // runs the device's bookkeeping (views, uncounted cells, the unknown verdict), which the tests run on a CPU.
  const bool counts_on_host;
  const int64_t fuse_bytes;  // 0: each record at once; else see NOTE: [Fused records]
  // NOTE: [Profiling the watch]
  // What the checks cost is measured only for a watch made with profile=True (Watch.costs(), which
  // the benchmark reads): an ordinary watch reads no clock on its hot path.
  const bool profiled;
  std::atomic<bool> enabled{true};  // false once the watch is removed: hooks left on a graph do nothing
  // Bumped when the records are dropped (a step ended): gradient checks placed before then do nothing
  // (see NOTE: [Gradient checks outliving their step]).
  std::atomic<int64_t> epoch{0};
  std::mutex mutex;
  std::vector<Entry> entries;
  std::vector<Deferred> deferred;  // records waiting for flush() (under `mutex`)
  int64_t deferred_bytes = 0;  // what the next flush reads (counted only by a profiled watch)
  HeldStorages held;  // the deferred tensors' storages (under `mutex`)
  std::unordered_set<int> backwards;  // graph tasks a check fired in that have not finished (under `mutex`)
  bool backward_finished = false;  // one of the whole graph finished, not yet told (under `mutex`)
  // What the checks cost, when profiled (under `mutex`): time in the kernel calls, the part of it
  // spent by gradient checks (the time the Python hooks do not see), bytes read, and the number of
  // fused-op calls (each one kernel launch on a GPU).
  Clock::duration kernel_time{0};
  Clock::duration check_time{0};
  int64_t bytes = 0;
  int64_t calls = 0;
};

}  // namespace nanfast::python

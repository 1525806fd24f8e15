// nanfast._C.WatchRecorder: where nanfast.watch's hooks leave the counts of a step.
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/function.h>

#include "bindings.h"

namespace nanfast::python {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using Clock = std::chrono::steady_clock;
// A shared_ptr before torch 2.14, an intrusive_ptr since.
using NodePtr = std::decay_t<decltype(std::declval<at::Tensor>().grad_fn())>;

// NOTE: [The watch's recorder]
// The watch checks the output of every module in forward and the gradient flowing out of every module
// in backward. In Python, a gradient check cost more than reading a small activation: a Python object
// for the autograd node, a RemovableHandle for its pre-hook, then a Python call in backward. The
// recorder does that bookkeeping in C++. Each check appends its counts, in execution order, with the
// id of its slot (what was checked: phase, module, call, which the Python side keeps); gradient checks
// are C++ pre-hooks on the autograd nodes, which the engine runs without the GIL. The watch takes
// everything once per step.

// The counts of one step, in execution order. Shared with the gradient checks, which may run on an
// autograd engine thread (one per CUDA device) and which live as long as their graph.
struct Records {
  explicit Records(at::Device device) : device(device) {}

  // Appends the counts of `tensors` as slot `slot`; `grad_check`: called by a gradient check.
  void add(at::TensorList tensors, int64_t slot, bool grad_check) {
    const auto start = Clock::now();
    at::Tensor counts = std::get<0>(stats_on(tensors, device));
    int64_t read = 0;
    for (const at::Tensor& t : tensors) {
      read += t.numel() * t.element_size();
    }
    const std::lock_guard<std::mutex> lock(mutex);
    entries.emplace_back(std::move(counts), slot);
    const auto spent = Clock::now() - start;
    kernel_time += spent;
    if (grad_check) {
      check_time += spent;
    }
    bytes += read;
  }

  const at::Device device;
  std::atomic<bool> enabled{true};  // false once the watch is removed: hooks left on a graph do nothing
  std::mutex mutex;
  std::vector<std::pair<at::Tensor, int64_t>> entries;  // counts [rows, 3] on `device`, slot id
  // What the checks cost, for benchmarks (under `mutex`): time in the kernel calls, the part of it
  // spent by gradient checks (the time the Python hooks do not see), bytes read.
  Clock::duration kernel_time{0};
  Clock::duration check_time{0};
  int64_t bytes = 0;
};

// What a gradient check records as: retargeted when a later module takes the same tensor.
struct GradSlot {
  explicit GradSlot(int64_t id) : id(id) {}
  std::atomic<int64_t> id;
};

// A pre-hook on the autograd node that made a module's input: counts the gradient w.r.t. that input
// (the node's grad output `output_nr`), i.e. what flows out of the module in backward.
class GradCheck final : public torch::autograd::FunctionPreHook {
 public:
  GradCheck(std::shared_ptr<Records> records, std::shared_ptr<GradSlot> slot, uint32_t output_nr)
      : records_(std::move(records)), slot_(std::move(slot)), output_nr_(output_nr) {}

  variable_list operator()(const variable_list& grads) override {
    if (records_->enabled && output_nr_ < grads.size()) {
      const at::Tensor& grad = grads[output_nr_];
      if (grad.defined() && grad.layout() == at::kStrided) {
        records_->add(grad, slot_->id, /*grad_check=*/true);
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

class WatchRecorder {
 public:
  explicit WatchRecorder(at::Device device) : records_(std::make_shared<Records>(device)) {}

  // Appends the NaN/+inf/-inf counts of `tensors` (one row each) as slot `slot`.
  void record(py::handle tensors, int64_t slot) {
    const BorrowedTensors inputs("nanfast.watch", tensors);
    if (inputs.list().empty()) {
      return;
    }
    py::gil_scoped_release no_gil;
    records_->add(inputs.list(), slot, /*grad_check=*/false);
  }

  // Checks the gradient w.r.t. each of `tensors` in backward as slot `slot`: one pre-hook per (autograd
  // node, output) until forget(); a tensor hooked before is retargeted to `slot`. Leaves (no node) are
  // skipped: their gradients are the parameters'.
  void hook_grads(py::handle tensors, int64_t slot) {
    const BorrowedTensors inputs("nanfast.watch", tensors);
    for (const at::Tensor& t : inputs.list()) {
      const NodePtr& node = t.grad_fn();
      if (!node) {
        continue;
      }
      const uint32_t output_nr = t.output_nr();
      const auto [it, added] = hooked_.try_emplace(Key{node.get(), output_nr});
      if (!added) {
        it->second.slot->id = slot;
        continue;
      }
      it->second.node = node;  // keeps the address from being reused by another node until forget()
      it->second.slot = std::make_shared<GradSlot>(slot);
      node->add_pre_hook(std::make_unique<GradCheck>(records_, it->second.slot, output_nr));
    }
  }

  // Ends a forward: later tensors get hooks of their own (the ones placed stay on their nodes).
  void forget() {
    hooked_.clear();
  }

  // The step's counts, packed in execution order ([rows, 3] int64 on the device), and (slot, rows) per
  // record; the records are emptied.
  std::pair<at::Tensor, std::vector<std::pair<int64_t, int64_t>>> take() {
    std::vector<std::pair<at::Tensor, int64_t>> entries;
    {
      const std::lock_guard<std::mutex> lock(records_->mutex);
      entries.swap(records_->entries);
    }
    std::vector<std::pair<int64_t, int64_t>> slots;
    std::vector<at::Tensor> counts;
    slots.reserve(entries.size());
    counts.reserve(entries.size());
    for (auto& [c, slot] : entries) {
      slots.emplace_back(slot, c.size(0));
      counts.push_back(std::move(c));
    }
    py::gil_scoped_release no_gil;
    if (counts.empty()) {
      return {at::empty({0, 3}, at::TensorOptions().dtype(at::kLong).device(records_->device)), std::move(slots)};
    }
    return {at::cat(counts), std::move(slots)};
  }

  // Drops the records.
  void clear() {
    const std::lock_guard<std::mutex> lock(records_->mutex);
    records_->entries.clear();
  }

  // Seconds in kernel calls, the part of them in gradient checks, bytes read: totals since the recorder began.
  std::tuple<double, double, int64_t> costs() {
    const std::lock_guard<std::mutex> lock(records_->mutex);
    return {std::chrono::duration<double>(records_->kernel_time).count(),
            std::chrono::duration<double>(records_->check_time).count(), records_->bytes};
  }

  // Hooks still on a graph do nothing from now on.
  void disable() {
    records_->enabled = false;
    forget();
    clear();
  }

 private:
  using Key = std::pair<const Node*, uint32_t>;
  struct KeyHash {
    size_t operator()(const Key& key) const {
      return std::hash<const Node*>()(key.first) ^ (static_cast<size_t>(key.second) * 0x9e3779b97f4a7c15ULL);
    }
  };
  struct Hooked {
    NodePtr node;
    std::shared_ptr<GradSlot> slot;
  };

  const std::shared_ptr<Records> records_;
  std::unordered_map<Key, Hooked, KeyHash> hooked_;
};

}  // namespace

void bind_watch_recorder(py::module_& m) {
  py::class_<WatchRecorder>(m, "WatchRecorder",
                            "Where nanfast.watch's hooks leave a step's counts (see NOTE: [The watch's recorder]).")
      .def(py::init<at::Device>(), py::arg("device"))
      .def("record", &WatchRecorder::record, py::arg("tensors"), py::arg("slot"))
      .def("hook_grads", &WatchRecorder::hook_grads, py::arg("tensors"), py::arg("slot"))
      .def("forget", &WatchRecorder::forget)
      .def("take", &WatchRecorder::take)
      .def("clear", &WatchRecorder::clear)
      .def("costs", &WatchRecorder::costs)
      .def("disable", &WatchRecorder::disable);
}

}  // namespace nanfast::python

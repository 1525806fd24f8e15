#pragma once
// nanfast._C.ModuleHooks: what nanfast.watch's module hooks do at each module call. Declared here so
// that the hooks on the modules (hooked_modules.cpp) call it directly.
#include <cstdint>
#include <string>
#include <utility>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include "bindings.h"
#include "watch_recorder.h"

namespace nanfast::python {

// Whether a torch.func transform is running (see NOTE: [The watch under torch.func] in
// nanfast/watcher/hooks.py): functorch includes its front-mode key in the thread's dispatch keys while
// a level is on its stack, one thread-local read. Also nanfast._C.transformed, for the Python hooks.
inline bool transformed() {
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// NOTE: [Module hooks in C++]
// Each hooked module call runs two hooks: before it, the check of the gradient w.r.t. its inputs is
// placed (NOTE: [Where a gradient is checked]); after it, its output is checked. In Python each was a
// chain of small calls (the call count, the slot, the floating tensors, the recorder) running right
// after the module's own kernels had evicted the interpreter's caches: 5-15 us a call inside a step
// for about 1 us of work in a loop. The hooks on the modules call ModuleHooks directly (NOTE: [Module
// hooks without a Python frame] in hooked_modules.cpp), which holds the state the hooks of one forward
// share: whether the step is checked, the forward's number and microbatch, the step's slots (the Step's
// Python list, appended to here and by the Python side alike) and the last output checked (NOTE:
// [Checking each tensor once]). What is rare stays in Python: the container walk of an output that is
// not a tensor or a tuple of them, and telling a checkpoint's recomputation apart, which is asked only
// when an autograd node is running.

// A place that records slots: a watched module (or the model's input or output, or a loss), with its
// call count in the current forward.
struct NANFAST_HIDDEN Site {
  Site(std::string name, std::string module_class, bool ignored, bool keeps_in_place)
      : name(std::move(name)),
        module_class(std::move(module_class)),
        ignored(ignored),
        keeps_in_place(keeps_in_place) {}
  const std::string name;
  const std::string module_class;
  const bool ignored;
  // An activation of torch's that writes its input in place and keeps its non-finite values (NOTE:
  // [Non-finite values an in-place activation keeps] in deferred_records.h).
  const bool keeps_in_place;
  int64_t calls = 0;
  // The recorder's record count when its latest call began, in a fused watch (NOTE: [A child's output a
  // module changes in place and returns] in deferred_records.h); -1 otherwise.
  int64_t call_began = -1;
  int64_t forward_id = -1;
};

class NANFAST_HIDDEN ModuleHooks {
 public:
  // recorder: the watch's WatchRecorder, called directly; walk(obj): the floating tensors of an object
  // plain_floating_tensors declines, with their layout (the container walker, inputs.walked_tensors);
  // recomputation(): None, "reentrant" or
  // "unpack" (nanfast/recompute.py); outside(grad_enabled): see NOTE: [Submodules called outside the
  // model's forward].
  // profiled: the module hooks add their time to `seconds` (NOTE: [Profiling the watch]).
  ModuleHooks(py::object recorder, py::object walk, py::object recomputation, py::object outside, bool check_grads,
              bool profiled)
      : profiled(profiled),
        recorder_object_(std::move(recorder)),
        recorder_(recorder_object_.cast<WatchRecorder&>()),
        fused_(recorder_.fused()),
        walk_(std::move(walk)),
        recomputation_(std::move(recomputation)),
        outside_(std::move(outside)),
        check_grads_(check_grads) {}

  // A module's forward pre-hook; `s` is `site`'s Site.
  void before_module(py::handle site, Site& s, py::handle args) {
    if (!active || transformed()) {
      return;
    }
    // NOTE: [Submodules called outside the model's forward]
    // A loop may call a submodule of the watched model without the model's own forward (a Lightning
    // validation_step running self.net(x)): an evaluation the model's hooks never see. Its records went
    // into the next training step, which a dirty validation batch then skipped or stopped. So the first
    // hooked call outside the model's forward, and each one after that whose grad mode differs from the
    // last one's, tells the watch (outside(grad_enabled): one Python call per change, none per module
    // call). Calls without gradients in an evaluation (Hooks._outside_forward) are read as one
    // evaluation when the model's forward, a call with gradients, a validation loss or the step's end
    // comes. (Not at each return: the hooked calls of self.net(x) follow one another, a plain
    // nn.Sequential being unhooked, and none of them is known to be the last.)
    if (!in_forward && (!outside_open || at::GradMode::is_enabled() != outside_grad_)) {
      outside_open = true;
      outside_grad_ = at::GradMode::is_enabled();
      outside_(outside_grad_);
    }
    const Recomputed recomputed = recomputation();
    if (recomputed != Recomputed::kUnpack) {
      enter(site, s, args, recomputed == Recomputed::kReentrant);
    }
  }

  // A module's forward hook; `s` is `site`'s Site.
  void after_module(py::handle site, const Site& s, py::handle output) {
    if (active && !transformed() && recomputation() == Recomputed::kNo) {
      check_output(phase_name(kForward), site, s, output, py::none());
    }
  }

  // A call of `site` begins: its call count (unless the call is a recomputation, which is not another
  // call) and the check of the gradients w.r.t. its floating inputs.
  void enter(py::handle site, Site& s, py::handle args, bool recomputed) {
    if (!recomputed) {
      if (s.forward_id != forward_id) {
        s.forward_id = forward_id;
        s.calls = 0;
      }
      ++s.calls;
      if (fused_) {
        s.call_began = recorder_.record_count();
      }
    }
    if (check_grads_ && !s.ignored && at::GradMode::is_enabled()) {
      hook_grads(args, phase_name(kBackward), site, s.calls);
    }
  }

  // Places the checks of the gradients w.r.t. the floating tensors in `obj` as a new slot (phase,
  // site, call).
  void hook_grads(py::handle obj, py::handle phase, py::handle site, int64_t call) {
    const py::list tensors = floating(obj).first;
    if (!tensors.empty()) {
      recorder_.hook_grads(tensors, slot(phase, site, call));
    }
  }

  // Records the check of an output of `site`; returns whether its floating values are checked (an
  // ignored site's are not; a tensor checked last and unchanged since is in the slot that checked it).
  // `walked`: what walk(output) gave, where the caller walked it already for its own use (None: found here).
  bool check_output(py::handle phase, py::handle site, const Site& s, py::handle output, py::handle walked) {
    const auto [tensors, layout] = walked.is_none() ? floating(output) : as_floating(walked);
    if (tensors.empty()) {
      return false;
    }
    const bool single = tensors.size() == 1;
    if (single && checked_before(THPVariable_Unpack(tensors[0].ptr()))) {
      return last_recorded_;
    }
    const bool recorded = !s.ignored;
    if (recorded) {
      const int64_t id = slot(phase, site, s.calls);
      recorder_.record(tensors, id, {}, s.keeps_in_place, s.call_began);
      if (!layout.is_none()) {  // a walked output's layout, to name its fields (NOTE: [Naming the output's fields])
        outputs[py::int_(id)] = layout;
      }
    }
    if (single) {
      last_recorded_ = recorded;
    }
    return recorded;
  }

  // A new slot id for records of `site` in `phase` (call `call`, the running forward's microbatch).
  int64_t slot(py::handle phase, py::handle site, int64_t call) {
    slots.append(py::make_tuple(phase, site, call, microbatch));
    return static_cast<int64_t>(slots.size()) - 1;
  }

  // The forward returned (or was dropped): no output of it is "the last checked" for the next one, and
  // the recorder forgets its gradient hooks (see WatchRecorder::forget).
  void forget() {
    forget_last();
    recorder_.forget();
  }

  // A new step: the recorder's records dropped, the forward forgotten, the step's slot list and whether
  // it is checked. One call where there were five: each call into C++ at a step's boundary pays cold
  // caches (NOTE: [Module hooks in C++]).
  void new_step(py::list step_slots, py::dict step_outputs, bool checked) {
    recorder_.clear();
    forget();
    slots = std::move(step_slots);
    outputs = std::move(step_outputs);
    active = checked;
    outside_open = false;
  }

  // The model's forward begins: calls outside it after it start afresh.
  void enter_forward() {
    in_forward = true;
    outside_open = false;
  }

  const bool profiled;
  double seconds = 0;      // in the module hooks, when profiled
  bool active = false;     // this step is checked and the hooks are on
  bool in_forward = false;    // the model's own forward is running
  bool outside_open = false;  // calls outside it were told of (NOTE: [Submodules called outside the model's forward])
  int64_t forward_id = 0;  // numbers the model's forwards (a site's calls count within one)
  int64_t microbatch = 0;  // of the forward running
  py::list slots;          // the Step's: (phase, site, call, microbatch) by slot id
  py::dict outputs;        // the Step's: slot id -> a walked output's layout (NOTE: [Naming the output's fields])

 private:
  enum class Recomputed { kNo, kReentrant, kUnpack };
  enum Phase { kForward, kBackward };

  // The phase's name as the slots hold it: one string made once, not one per slot.
  static py::handle phase_name(Phase phase) {
    static PyObject* names[] = {PyUnicode_InternFromString("forward"), PyUnicode_InternFromString("backward")};
    return names[phase];
  }

  void forget_last() {
    last_output_.reset();
    last_version_ = -1;
    last_recorded_ = false;
  }

  Recomputed recomputation() const {
    if (!torch::autograd::get_current_node()) {
      return Recomputed::kNo;  // not inside backward: the usual case, without calling Python
    }
    const py::object found = recomputation_();
    if (found.is_none()) {
      return Recomputed::kNo;
    }
    return found.cast<std::string>() == "unpack" ? Recomputed::kUnpack : Recomputed::kReentrant;
  }

  // The floating tensors of `obj`, with the layout of a walked one (None for a tensor or a tuple of them).
  std::pair<py::list, py::object> floating(py::handle obj) const {
    py::object found = plain_floating_tensors(obj);
    if (!found.is_none()) {
      return {py::reinterpret_steal<py::list>(found.release()), py::none()};
    }
    return as_floating(walk_(obj));
  }

  // walk()'s (tensors, layout) as floating() gives them.
  static std::pair<py::list, py::object> as_floating(py::handle walked) {
    const auto found = walked.cast<py::tuple>();
    return {py::list(found[0]), found[1]};
  }

  // Whether `t` is the last output checked, unchanged since (its version counter); else it becomes the
  // last output. An inference tensor has no version counter: it is checked again.
  bool checked_before(const at::Tensor& t) {
    if (t.is_inference()) {
      forget_last();
      return false;
    }
    const int64_t version = static_cast<int64_t>(t._version());
    if (last_output_.defined() && t.is_same(last_output_) && version == last_version_) {
      return true;
    }
    last_output_ = t;
    last_version_ = version;
    return false;
  }

  const py::object recorder_object_;  // keeps recorder_ alive
  WatchRecorder& recorder_;
  const bool fused_;  // the recorder defers its records (NOTE: [Fused records])
  const py::object walk_;
  const py::object recomputation_;
  const py::object outside_;
  const bool check_grads_;
  bool outside_grad_ = false;  // the grad mode of the calls outside the forward told of last
  at::Tensor last_output_;  // kept alive until forget_last(), as its identity is what is compared
  int64_t last_version_ = -1;
  bool last_recorded_ = false;
};

}  // namespace nanfast::python

// The Python extension module nanfast._C: importing it registers the operators (torch.ops.nanfast),
// and it holds the unboxed entry points, the watch's recorder and the CPU instruction-set switch
// used by tests and benchmarks.
#include "bindings.h"

#include <algorithm>
#include <optional>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/ops/any.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mean.h>
#include <torch/csrc/autograd/python_variable.h>

#include "../cpu/simd_kernels.h"
#include "../ops.h"

namespace nanfast::python {

// NOTE: [Unboxed entry points]
// torch.ops.nanfast.* goes through the boxed call path: every list entry becomes an IValue, then a
// Tensor again. These bindings make the same dispatcher call, unboxed (dispatch modes, fake tensors
// and the fallthroughs all apply as usual); nanfast.stats and nanfast.any_nonfinite use them in eager
// mode and torch.ops.nanfast.* under torch.compile.

BorrowedTensors::BorrowedTensors(const char* api, py::handle sequence)
    : owner_(py::reinterpret_steal<py::tuple>(PySequence_Tuple(sequence.ptr()))) {
  if (!owner_) {
    throw py::error_already_set();
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(owner_.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(owner_.ptr(), i);
    if (!THPVariable_Check(item)) {
      throw py::type_error(std::string(api) + ": entry " + std::to_string(i) + " is of type " + Py_TYPE(item)->tp_name +
                           ", not a Tensor");
    }
  }
  // Nothing below throws once the space is reserved: a borrow must never reach the vector's own
  // destructor, which would release a reference it does not hold.
  tensors_.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const Py_ssize_t ahead = i + static_cast<Py_ssize_t>(kMetadataAhead);
    if (ahead < n) {  // see NOTE: [Thousands of small tensors' metadata]
      prefetch_impl(THPVariable_Unpack(PyTuple_GET_ITEM(owner_.ptr(), ahead)));
    }
    tensors_.push_back(
        c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(PyTuple_GET_ITEM(owner_.ptr(), i))));
  }
}

// NOTE: [Lazy modules' uninitialized parameters]
// A lazy module's parameter or buffer before its first forward (nn.UninitializedParameter,
// nn.UninitializedBuffer) is an empty tensor whose class refuses every torch function ("Attempted to use
// an uninitialized parameter"). The unboxed bindings do not ask its class, so the kernels would read its
// 0 elements and call it clean: nanfast.stats and nanfast.any_nonfinite refuse it by name, as a meta
// tensor. Only an entry of another class than Tensor or Parameter is asked (a pointer compare each).
void BorrowedTensors::refuse_uninitialized(const char* api) const {
  static PyObject* const parameter = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  static PyObject* const uninitialized =
      py::object(py::module_::import("torch.nn.parameter").attr("UninitializedTensorMixin")).release().ptr();
  const Py_ssize_t n = PyTuple_GET_SIZE(owner_.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(owner_.ptr(), i);
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(item));
    if (type == THPVariableClass || type == parameter) {
      continue;
    }
    const int lazy = PyObject_IsInstance(item, uninitialized);
    if (lazy < 0) {
      throw py::error_already_set();
    }
    if (lazy == 1) {
      throw py::value_error(std::string(api) + ": entry " + std::to_string(i) + " is a lazy module's " +
                            Py_TYPE(item)->tp_name + " (before its first forward): it has no "
                            "values to check yet");
    }
  }
}

BorrowedTensors::~BorrowedTensors() {
  for (at::Tensor& t : tensors_) {
    c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
}

const StatsOp& stats_op() {
  static const StatsOp op = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("nanfast::stats", "")
                                .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList)>();
  return op;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_stats(py::handle tensors) {
  const BorrowedTensors inputs("nanfast.stats", tensors);
  inputs.refuse_uninitialized("nanfast.stats");
  if (holds_wrapper_subclass(inputs.list())) {
    return stats_through_parts("nanfast.stats", inputs.list());
  }
  py::gil_scoped_release no_gil;
  return stats_op().call(inputs.list());
}

at::Tensor call_any_nonfinite(py::handle tensors) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("nanfast::any_nonfinite", "").typed<at::Tensor(at::TensorList)>();
  const BorrowedTensors inputs("nanfast.any_nonfinite", tensors);
  inputs.refuse_uninitialized("nanfast.any_nonfinite");
  if (holds_wrapper_subclass(inputs.list())) {
    return std::get<0>(stats_through_parts("nanfast.any_nonfinite", inputs.list())).any();
  }
  py::gil_scoped_release no_gil;
  return op.call(inputs.list());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_stats_on(py::handle tensors, at::Device device) {
  const BorrowedTensors inputs("nanfast._C.stats_on", tensors);
  TORCH_CHECK(!inputs.list().empty(), "nanfast._C.stats_on: tensors is empty");
  const c10::AutoGradMode no_grad(false);  // counts and norms of values: no graph (parameters require grad)
  py::gil_scoped_release no_gil;
  return stats_on(inputs.list(), device);
}

// NOTE: [A loss's mean without ATen ops]
// Watch.loss keeps the mean of each loss value, float64 on its device, for the step's one read. As
// `value.detach().mean(dtype=torch.float64)` under no_grad it was four calls into torch right after the
// model's kernels and the loss's own, each paying cold caches: 45-70 us a call inside a step (the watch
// suite's MLP steps take 4.5 ms), for one number. A loss is nearly always one element: on the CPU (a
// plain tensor: no subclass, no negative view) its value is read here and written into a new float64
// tensor, the number ATen's mean gives (the element converted exactly to double and added to a sum
// that starts at +0, so -0 gives +0 there too): 4-5 us. Anything else (several elements, none, an
// accelerator) takes ATen's mean with grad mode off: no graph and no host read.
at::Tensor loss_mean(const at::Tensor& value) {
  TORCH_CHECK(value.is_floating_point(), "nanfast._C.loss_mean: value must be a floating tensor, got ",
              value.scalar_type());
  const c10::ScalarType dtype = value.scalar_type();
  const bool direct = !value.unsafeGetTensorImpl()->is_python_dispatch() && value.is_cpu() &&
      value.layout() == at::kStrided && value.numel() == 1 && !value.is_neg() && value.has_storage() &&
      (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16);
  if (!direct) {
    std::vector<at::Tensor> parts;
    std::vector<int64_t> owners;
    // A tensor subclass: the mean of the values it holds (NOTE: [Tensor subclasses read through their plain tensors]).
    if (plain_parts(value, parts, owners) && !parts.empty()) {
      if (parts.size() == 1) {
        return loss_mean(parts[0]);
      }
      std::vector<at::Tensor> flat;  // the mean of all the values it holds
      for (const at::Tensor& part : parts) {
        flat.push_back(part.detach().reshape(-1).to(at::kDouble));
      }
      return loss_mean(at::cat(flat));
    }
    const c10::AutoGradMode no_grad(false);
    return at::mean(value, at::kDouble);
  }
  double mean = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "nanfast._C.loss_mean",
                                  [&] { mean = static_cast<double>(*value.const_data_ptr<scalar_t>()) + 0.0; });
  at::Tensor out = at::empty({}, at::TensorOptions().dtype(at::kDouble));
  *out.mutable_data_ptr<double>() = mean;
  return out;
}

using OptTensor = std::optional<at::Tensor>;

// torch.ops.nanfast.step_summary, unboxed: the watch calls it once per step, right after the model's
// own kernels, where each boxed argument's conversion pays cold caches (see NOTE: [The step's summary
// in one call]).
at::Tensor call_step_summary(py::handle recorded, const OptTensor& recorded_counted, const OptTensor& counts,
                             const OptTensor& norm, const OptTensor& absmax, int64_t n_params, const OptTensor& counted,
                             bool nan_only,
                             const OptTensor& found_inf, const OptTensor& grad_scale, py::handle losses,
                             const std::vector<int64_t>& loss_calls, const OptTensor& scale, const OptTensor& groups,
                             int64_t n_groups) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("nanfast::step_summary", "")
          .typed<at::Tensor(at::TensorList, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                            int64_t, const OptTensor&, bool, const OptTensor&, const OptTensor&, at::TensorList,
                            at::IntArrayRef, const OptTensor&, const OptTensor&, int64_t)>();
  const BorrowedTensors parts("nanfast.step_summary", recorded);
  const BorrowedTensors loss_means("nanfast.step_summary", losses);
  py::gil_scoped_release no_gil;
  return op.call(parts.list(), recorded_counted, counts, norm, absmax, n_params, counted, nan_only, found_inf,
                 grad_scale, loss_means.list(), loss_calls, scale, groups, n_groups);
}

// The eager read of a step's summary (see NOTE: [One read per step]): the one host sync is the flag's
// item(); on CUDA the whole summary is first copied to pinned memory without blocking, which stream
// order finishes before that item() returns (other devices have no pinned memory: copied after it).
// One entry instead of the five Python-side calls it replaces, since each costs a cold path right
// after the model's kernels.
std::tuple<bool, py::list> read_summary(const at::Tensor& summary) {
  TORCH_CHECK(summary.dim() == 1 && summary.numel() > 0 && summary.scalar_type() == at::kDouble,
              "nanfast._C.read_summary: summary must be a non-empty 1-d float64 tensor, got ", summary.scalar_type(),
              " of shape ", summary.sizes());
  at::Tensor host;
  double flag = 0;
  {
    py::gil_scoped_release no_gil;
    if (summary.is_cuda()) {
      host = at::empty(summary.sizes(), summary.options().device(at::kCPU).pinned_memory(true))
                 .copy_(summary, /*non_blocking=*/true);
    }
    flag = summary.select(0, 0).item<double>();
    if (!host.defined()) {
      host = (summary.is_cpu() ? summary : summary.cpu()).contiguous();
    }
  }
  const double* values = host.const_data_ptr<double>();
  const int64_t n = host.numel();
  py::list out(n);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = py::float_(values[i]);
  }
  return {flag > 0, std::move(out)};
}

// Whether counts ([rows, 3] int64, as nanfast.stats gives them) count nothing, read where they lie on
// the host; None for counts on an accelerator, where knowing would take a read from the device.
py::object counts_zero(const at::Tensor& counts) {
  TORCH_CHECK(counts.scalar_type() == at::kLong, "nanfast._C.counts_zero: counts must be int64, got ",
              counts.scalar_type());
  if (!counts.is_cpu()) {
    return py::none();
  }
  const at::Tensor host = counts.contiguous();
  const int64_t* values = host.const_data_ptr<int64_t>();
  return py::bool_(std::all_of(values, values + host.numel(), [](int64_t count) { return count == 0; }));
}

}  // namespace

}  // namespace nanfast::python

PYBIND11_MODULE(_C, m) {
  using namespace nanfast::python;
  m.def("stats", &call_stats, "torch.ops.nanfast.stats without the boxed call (see NOTE: [Unboxed entry points]).",
        py::arg("tensors"));
  m.def("any_nonfinite", &call_any_nonfinite, "torch.ops.nanfast.any_nonfinite without the boxed call.",
        py::arg("tensors"));
  m.def("stats_on", &call_stats_on,
        "torch.ops.nanfast.stats over tensors on any number of devices (one call per device), rows in input "
        "order, results on `device`; a tensor subclass read through the plain tensors it holds.",
        py::arg("tensors"), py::arg("device"));
  m.def("merge_rows", &merge_rows,
        "The stats rows of n entries from those of their parts (part k of entry owners[k]): counts summed, "
        "max |x| the largest, 2-norms combined. No host read.",
        py::arg("counts"), py::arg("norm"), py::arg("absmax"), py::arg("owners"), py::arg("n"));
  m.def("step_summary", &call_step_summary, "torch.ops.nanfast.step_summary without the boxed call.",
        py::arg("recorded"), py::arg("recorded_counted"), py::arg("counts"), py::arg("norm"), py::arg("absmax"),
        py::arg("n_params"), py::arg("counted"), py::arg("nan_only"), py::arg("found_inf"), py::arg("grad_scale"),
        py::arg("losses"), py::arg("loss_calls"), py::arg("scale"), py::arg("groups"), py::arg("n_groups"));
  m.def("loss_mean", &loss_mean,
        "The mean of a floating tensor as float64 on its device, with no graph and no host read (Watch.loss).",
        py::arg("value"));
  m.def("read_summary", &read_summary,
        "A step's summary on the host: (flag > 0, its values); the flag's item() is the one host sync.",
        py::arg("summary"));
  m.def("counts_zero", &counts_zero,
        "Whether counts (int64, as nanfast.stats gives them) count nothing, read on the host; None on an "
        "accelerator (a read would sync).",
        py::arg("counts"));
  bind_buffer_slots(m);
  bind_param_grads(m);
  bind_spike_windows(m);
  bind_watch_recorder(m);
  bind_module_hooks(m);
  bind_hooked_modules(m);
  m.def("cpu_isa", [] { return std::string(nanfast::cpu::simd_kernels().isa); },
        "The instruction set of the CPU kernels in use: avx512, avx2 or baseline.");
  m.def("set_cpu_isa", [](const std::string& isa) { return std::string(nanfast::cpu::set_cpu_isa(isa.c_str())); },
        "Caps the CPU kernels' instruction set (never above what the processor has); returns the one in use.",
        py::arg("isa"));
  m.def("cpu_prefetch", [] { return nanfast::cpu::simd_kernels().prefetch; },
        "Whether the CPU kernels prefetch the next page (NANFAST_CPU_PREFETCH=0|1; by default not on AMD).");
  m.def("set_cpu_prefetch", [](bool on) { return nanfast::cpu::set_cpu_prefetch(on); },
        "Turns the CPU kernels' software prefetches on or off (results do not change); returns the setting.",
        py::arg("on"));
}

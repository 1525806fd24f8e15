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
#include <ATen/ops/index_add.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/scatter_reduce.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
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

// NOTE: [Tensor subclasses read through their plain tensors]
// A module's output, a gradient or a loss may be a Python tensor subclass whose values live in plain
// tensors it holds: a DTensor of a tensor-parallel model (SequenceParallel's and
// ColwiseParallel(use_local_output=False)'s outputs, their gradients, a loss_parallel loss), or a
// wrapper such as a quantized weight's. The fused op has no rule for them (DTensor raised "no sharding
// strategy" inside the watch's hook: a healthy model stopped at its first forward), or one of their own
// (a wrapper's results were of its class, which no read could turn into numbers). So stats_on, which
// every check of the watch goes through, reads such a tensor through the floating tensors its
// __tensor_flatten__ names, recursively, and merges their rows back into the tensor's one (merge_rows):
// a DTensor's local shard gives this rank's values (a Partial shard with a NaN or inf makes the sum
// non-finite too; reading the reduced value would be a collective inside a hook). A subclass without
// __tensor_flatten__ names nothing to read: its row counts nothing, with a warning. A strided nested
// tensor (nn.TransformerEncoder's fast path in eval with a padding mask passes them between its layers)
// is read through its components the same way; a jagged one through its values buffer, unless narrow()
// left that buffer wider than its components (the values outside them are not the tensor's: a NaN
// there stopped a healthy step), then through its components, which costs torch's one host read. A
// plain tensor costs two bit tests; only a Python subclass takes the GIL, from a backward thread too.
namespace {

bool floating_strided(const at::Tensor& t) {
  return (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) && t.layout() == at::kStrided;
}

bool python_subclass(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->is_python_dispatch();
}

// The tensors a wrapper subclass `obj` names through its __tensor_flatten__ (which it has).
std::vector<at::Tensor> flattened_tensors(const py::object& obj) {
  std::vector<at::Tensor> found;
  const py::object names = obj.attr("__tensor_flatten__")()[py::int_(0)];  // held: the loop reads it
  for (const py::handle name : names) {
    const py::object inner = obj.attr(name);
    if (THPVariable_Check(inner.ptr())) {
      found.push_back(THPVariable_Unpack(inner.ptr()));
    }
  }
  return found;
}

void append_plain(const at::Tensor& t, int64_t owner, std::vector<at::Tensor>& out, std::vector<int64_t>& owners) {
  if (t.is_nested() && !python_subclass(t)) {  // a strided nested tensor: its components
    for (const at::Tensor& component : t.unbind(0)) {
      append_plain(component, owner, out, owners);
    }
    return;
  }
  if (!python_subclass(t)) {
    out.push_back(t);
    owners.push_back(owner);
    return;
  }
  const py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  if (t.is_nested()) {  // a jagged nested tensor: its values buffer, or, once narrow() made that buffer
    // wider than the components, the components (torch reads their offsets to the host: the one sync)
    const py::object pieces =
        obj.attr("lengths")().is_none() ? py::make_tuple(obj.attr("values")()) : obj.attr("unbind")();
    for (const py::handle piece : pieces) {
      append_plain(THPVariable_Unpack(piece.ptr()), owner, out, owners);
    }
    return;
  }
  if (!py::hasattr(obj, "__tensor_flatten__")) {
    TORCH_WARN_ONCE("nanfast: a ", Py_TYPE(obj.ptr())->tp_name, " (a tensor subclass without __tensor_flatten__) "
                    "names no plain tensors to read: its values are not checked");
    return;
  }
  for (const at::Tensor& inner : flattened_tensors(obj)) {
    if (floating_strided(inner)) {
      append_plain(inner, owner, out, owners);
    }
  }
}

}  // namespace

bool plain_parts(at::TensorList tensors, std::vector<at::Tensor>& out, std::vector<int64_t>& owners) {
  const auto needs_parts = [](const at::Tensor& t) { return python_subclass(t) || t.is_nested(); };
  if (std::none_of(tensors.begin(), tensors.end(), needs_parts)) {
    return false;
  }
  std::optional<py::gil_scoped_acquire> gil;
  if (std::any_of(tensors.begin(), tensors.end(), python_subclass)) {
    gil.emplace();
  }
  const c10::AutoGradMode no_grad(false);  // a nested tensor's components: views, no graph
  for (size_t i = 0; i < tensors.size(); ++i) {
    append_plain(tensors[i], static_cast<int64_t>(i), out, owners);
  }
  return true;
}

// The rows of `n` entries from the rows of their parts (part k belongs to entry owners[k]): counts
// summed, max |x| the largest, the 2-norm from the parts' norms scaled by the largest (no overflow of
// the squares). ATen ops on the rows' device, no host read. Also nanfast._C.merge_rows, for the nested
// tensors of nanfast/_nested.py.
std::tuple<at::Tensor, at::Tensor, at::Tensor> merge_rows(const at::Tensor& counts, const at::Tensor& norm,
                                                          const at::Tensor& absmax, const at::Tensor& owners,
                                                          int64_t n) {
  const c10::AutoGradMode no_grad(false);
  const at::TensorOptions options = norm.options();
  at::Tensor merged_counts = at::zeros({n, 3}, counts.options()).index_add_(0, owners, counts);
  at::Tensor merged_absmax = at::zeros({n}, options).scatter_reduce_(0, owners, absmax, "amax");
  const at::Tensor top = at::zeros({n}, options).scatter_reduce_(0, owners, norm, "amax");
  const at::Tensor scale = at::where(at::isfinite(top) & (top > 0), top, at::ones_like(top));
  at::Tensor merged_norm =
      at::zeros({n}, options).index_add_(0, owners, (norm / scale.index_select(0, owners)).square()).sqrt_() * scale;
  return {merged_counts, merged_norm, merged_absmax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_on(at::TensorList tensors, at::Device device) {
  TORCH_INTERNAL_ASSERT(!tensors.empty());
  std::vector<at::Tensor> plain;
  std::vector<int64_t> owners;
  if (plain_parts(tensors, plain, owners)) {  // see NOTE: [Tensor subclasses read through their plain tensors]
    const int64_t n = static_cast<int64_t>(tensors.size());
    if (plain.empty()) {
      const at::TensorOptions options = at::TensorOptions().device(device);
      return {at::zeros({n, 3}, options.dtype(at::kLong)), at::zeros({n}, options.dtype(at::kDouble)),
              at::zeros({n}, options.dtype(at::kDouble))};
    }
    const auto [counts, norm, absmax] = stats_on(plain, device);
    return merge_rows(counts, norm, absmax, at::tensor(owners, at::kLong).to(device, /*non_blocking=*/true), n);
  }
  const at::Device first = tensors[0].device();
  const bool one_device =
      std::all_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) { return t.device() == first; });
  // NOTE: [Results copied to the CPU]
  // Results computed on an accelerator and wanted on the CPU are copied with a wait: a non-blocking copy
  // lands in pinned memory while the host goes on, and the watch reads CPU counts on the host without
  // any sync of that accelerator, so it could read them before they land and call the step clean. The
  // watch puts its results on an accelerator whenever a parameter is on one (Watch._device), so this
  // wait is met only by a model whose parameters are all on the CPU while it computes elsewhere.
  // Copies to an accelerator stay non-blocking (from pageable memory they are staged before returning).
  auto to_device = [&](const at::Tensor& t) {
    return t.device() == device ? t : t.to(device, /*non_blocking=*/!device.is_cpu());
  };
  if (one_device) {
    auto [counts, norm, absmax] = stats_op().call(tensors);
    return {to_device(counts), to_device(norm), to_device(absmax)};
  }
  // Group by device, one call each; then each result row goes back to its input's position.
  std::vector<at::Device> devices;
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<std::vector<int64_t>> group_positions;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t g = std::find(devices.begin(), devices.end(), tensors[i].device()) - devices.begin();
    if (g == devices.size()) {
      devices.push_back(tensors[i].device());
      groups.emplace_back();
      group_positions.emplace_back();
    }
    groups[g].push_back(tensors[i]);
    group_positions[g].push_back(static_cast<int64_t>(i));
  }
  std::vector<int64_t> positions;
  std::vector<at::Tensor> parts[3];
  for (size_t g = 0; g < groups.size(); ++g) {
    positions.insert(positions.end(), group_positions[g].begin(), group_positions[g].end());
    auto [counts, norm, absmax] = stats_op().call(groups[g]);
    parts[0].push_back(to_device(counts));
    parts[1].push_back(to_device(norm));
    parts[2].push_back(to_device(absmax));
  }
  // Built on the host and copied without blocking: no sync on CUDA.
  const at::Tensor rows = at::tensor(positions, at::kLong).to(device, /*non_blocking=*/true);
  auto in_input_order = [&](const std::vector<at::Tensor>& part) {
    const at::Tensor packed = at::cat(part);
    return at::empty_like(packed).index_copy_(0, rows, packed);
  };
  return {in_input_order(parts[0]), in_input_order(parts[1]), in_input_order(parts[2])};
}

namespace {

// Whether `tensors` hold a tensor subclass that names the plain tensors holding its values
// (__tensor_flatten__: a TwoTensor, a quantized weight, a jagged nested tensor). nanfast.stats and
// nanfast.any_nonfinite read such a list as the watch does, through stats_on: the subclass's own
// __torch_dispatch__ may run the op on each plain tensor and hand back results of its class, whose read
// takes the first one's: a NaN in the second was called clean (a probe, session 42). A FakeTensor or a
// MaskedTensor names none: the op's dispatch takes them. Called with the GIL; a plain list costs a bit
// test per tensor.
bool holds_wrapper_subclass(at::TensorList tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
    return python_subclass(t) &&
        py::hasattr(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)), "__tensor_flatten__");
  });
}

// NOTE: [Entries read through their parts must all be readable]
// A list holding a wrapper subclass goes to stats_on, which reads each entry through its plain parts. For
// the watch, an entry that names no plain tensors is left out with a warning (a model's output of some
// subclass); called by the user on stats or any_nonfinite, such an entry got a row of zeros and the
// call said "finite": a MaskedTensor, a FakeTensor or a wrapper without __tensor_flatten__ beside a
// TwoTensor, or a TwoTensor of sparse tensors (a probe, session 45). Alone, each is refused. So there,
// every entry and every part must be one the kernels read, or the call is refused, naming the entry.
void refuse_unreadable_parts(const char* api, size_t index, const at::Tensor& t) {
  if (!python_subclass(t) || t.is_nested()) {
    TORCH_CHECK(t.is_nested() || t.layout() == at::kStrided, api, ": tensors[", index, "] has layout ", t.layout(),
                "; only strided tensors are supported (check a sparse tensor's .values(), or .to_dense() it)");
    return;
  }
  const py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
  TORCH_CHECK(py::hasattr(obj, "__tensor_flatten__"), api, ": tensors[", index, "] is a ", Py_TYPE(obj.ptr())->tp_name,
              ", a tensor subclass whose values the kernels cannot read; check the plain tensors it holds");
  for (const at::Tensor& inner : flattened_tensors(obj)) {
    refuse_unreadable_parts(api, index, inner);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_through_parts(const char* api, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    refuse_unreadable_parts(api, i, tensors[i]);
  }
  const c10::AutoGradMode no_grad(false);
  py::gil_scoped_release no_gil;  // stats_on takes it back for the subclasses
  return stats_on(tensors, tensors[0].device());
}

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

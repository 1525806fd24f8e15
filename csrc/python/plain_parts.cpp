// Reading tensors that hold their values elsewhere (Python tensor subclasses, nested tensors) through the
// plain tensors that do, and nanfast._C.stats_on, which every check of the watch goes through.
#include "bindings.h"

#include <algorithm>
#include <optional>
#include <vector>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/scatter_reduce.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/python_variable.h>

namespace nanfast::python {

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

namespace {

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

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_through_parts(const char* api, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    refuse_unreadable_parts(api, i, tensors[i]);
  }
  const c10::AutoGradMode no_grad(false);
  py::gil_scoped_release no_gil;  // stats_on takes it back for the subclasses
  return stats_on(tensors, tensors[0].device());
}

}  // namespace nanfast::python

// nanfast::step_summary: a watched step's summary, the one thing the host reads per step. Its checks
// of the inputs, its output layout, and the implementation for every device without a kernel of its
// own (ATen ops); the CPU kernel is csrc/cpu/step_summary_cpu.cpp, the CUDA one in csrc/cuda/stats_cuda.cu.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace nanfast {

// NOTE: [The step's summary in one call]
// At each step's end the watch packs what the host reads once: [flag, nan, +inf, -inf, grad norm,
// max |grad|, param norm, found_inf], then each loss's mean over its calls, the GradScaler's scale and
// each module's gradient norm. Made from Python that was about 38 ATen ops: 0.3-0.5 ms on a CPU step,
// where each op paid Python's argument parsing and, right after the model's own kernels, cold caches
// for its dispatch path (a call measured 8x slower inside a step than in a loop). One op does it:
// on CPU a kernel of plain loops over a few hundred numbers (csrc/cpu/step_summary_cpu.cpp); on CUDA
// one launch of one block, which reads the losses' means where they lie (csrc/cuda/stats_cuda.cu); on
// other devices the same arithmetic as ATen ops (below). Nothing here reads a value on the host.
// * counts: the fused pass's rows (parameters first, n_params of them, then gradients) are summed
//   where `counted` is 1 (the ignored names and the switched-off checks are 0); `recorded`'s always.
//   `recorded` is a list: the records' rows as the fused calls that checked them gave them (a fused
//   watch's calls where its deferred tensors reached their bound, then the pass's), summed where they
//   lie, so that a step of several calls needs no cat to join them (one launch on a GPU);
//   `recorded_counted` (0/1 per cell of those rows, in order) leaves out the cells a record does not
//   count (NOTE: [Cells a record does not count] in csrc/python/watch_recorder.cpp).
// * norms: combine_norms of the parameters' and of the gradients' norms; max |grad| over the
//   gradients' rows; with `grad_scale` (a fused optimizer under a GradScaler: its gradients are still
//   scaled) the gradient norms and max are divided by it. Module norms: sqrt of the sum of the squared
//   norms of the gradients whose `groups` entry is the module's number.

void check_step_summary_inputs(at::TensorList recorded, const std::optional<at::Tensor>& recorded_counted,
                               const std::optional<at::Tensor>& counts,
                               const std::optional<at::Tensor>& norm, const std::optional<at::Tensor>& absmax,
                               int64_t n_params, const std::optional<at::Tensor>& counted,
                               const std::optional<at::Tensor>& found_inf,
                               const std::optional<at::Tensor>& grad_scale, at::TensorList losses,
                               at::IntArrayRef loss_calls, const std::optional<at::Tensor>& scale,
                               const std::optional<at::Tensor>& groups, int64_t n_groups) {
  constexpr const char* kOp = "nanfast.step_summary";
  TORCH_CHECK(!recorded.empty(), kOp,
              ": recorded is empty; pass one int64 [0, 3] tensor for no records (it gives the device)");
  const at::Device device = recorded[0].device();
  int64_t recorded_rows = 0;
  for (size_t i = 0; i < recorded.size(); ++i) {
    const at::Tensor& part = recorded[i];
    TORCH_CHECK(part.dim() == 2 && part.size(1) == 3 && part.scalar_type() == at::kLong, kOp, ": recorded[", i,
                "] must be int64 [rows, 3], got ", part.scalar_type(), " ", part.sizes());
    TORCH_CHECK(part.device() == device, kOp, ": recorded[", i, "] is on ", part.device(), ", recorded[0] on ", device);
    recorded_rows += part.size(0);
  }
  auto on_device = [&](const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel) {
    TORCH_CHECK(t.device() == device, kOp, ": ", name, " is on ", t.device(), ", recorded on ", device);
    TORCH_CHECK(t.scalar_type() == dtype || (dtype == at::kFloat && at::isFloatingType(t.scalar_type())), kOp, ": ",
                name, " must be ", (dtype == at::kFloat ? "floating" : c10::toString(dtype)), ", got ",
                t.scalar_type());
    TORCH_CHECK(numel < 0 || t.numel() == numel, kOp, ": ", name, " must have ", numel, " elements, got ",
                t.numel());
  };
  if (recorded_counted.has_value()) {
    on_device(*recorded_counted, "recorded_counted", at::kLong, 3 * recorded_rows);
  }
  TORCH_CHECK(counts.has_value() == norm.has_value() && norm.has_value() == absmax.has_value(), kOp,
              ": counts, norm and absmax come together (the fused pass's results)");
  int64_t rows = 0;
  if (counts.has_value()) {
    rows = counts->size(0);
    TORCH_CHECK(counts->dim() == 2 && counts->size(1) == 3, kOp, ": counts must be [rows, 3], got ", counts->sizes());
    on_device(*counts, "counts", at::kLong, -1);
    on_device(*norm, "norm", at::kDouble, rows);
    on_device(*absmax, "absmax", at::kDouble, rows);
    TORCH_CHECK(0 <= n_params && n_params <= rows, kOp, ": n_params=", n_params, " is not within the pass's ",
                rows, " rows");
  }
  TORCH_CHECK(!counted.has_value() || counts.has_value(), kOp, ": counted without counts");
  if (counted.has_value()) {
    on_device(*counted, "counted", at::kLong, rows);
  }
  TORCH_CHECK(!groups.has_value() || counts.has_value(), kOp, ": groups without counts");
  if (groups.has_value()) {
    on_device(*groups, "groups", at::kLong, rows - n_params);
  }
  TORCH_CHECK(n_groups >= 0 && (n_groups == 0 || groups.has_value()), kOp, ": n_groups=", n_groups,
              " without groups");
  if (found_inf.has_value()) {
    on_device(*found_inf, "found_inf", at::kFloat, 1);
  }
  if (grad_scale.has_value()) {
    on_device(*grad_scale, "grad_scale", at::kFloat, 1);
  }
  if (scale.has_value()) {
    on_device(*scale, "scale", at::kFloat, 1);
  }
  int64_t calls = 0;
  for (const int64_t n : loss_calls) {
    TORCH_CHECK(n >= 1, kOp, ": loss_calls must be >= 1 each, got ", n);
    calls += n;
  }
  TORCH_CHECK(calls == static_cast<int64_t>(losses.size()), kOp, ": loss_calls sum to ", calls, ", but ",
              losses.size(), " losses were given");
  for (size_t i = 0; i < losses.size(); ++i) {
    on_device(losses[i], "losses[i]", at::kDouble, 1);
  }
}

int64_t step_summary_size(at::IntArrayRef loss_calls, bool has_scale, int64_t n_groups) {
  return 8 + static_cast<int64_t>(loss_calls.size()) + (has_scale ? 1 : 0) + n_groups;
}

namespace {

at::Tensor as_double(const at::Tensor& t) {
  return t.detach().reshape({1}).to(at::kDouble);
}

at::Tensor step_summary_aten(at::TensorList recorded, const std::optional<at::Tensor>& recorded_counted,
                             const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& norm,
                             const std::optional<at::Tensor>& absmax,
                             int64_t n_params, const std::optional<at::Tensor>& counted, bool nan_only,
                             const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_scale,
                             at::TensorList losses, at::IntArrayRef loss_calls, const std::optional<at::Tensor>& scale,
                             const std::optional<at::Tensor>& groups, int64_t n_groups) {
  check_step_summary_inputs(recorded, recorded_counted, counts, norm, absmax, n_params, counted, found_inf, grad_scale,
                            losses, loss_calls, scale, groups, n_groups);
  const at::TensorOptions f64 = recorded[0].options().dtype(at::kDouble);
  const at::Tensor rows = recorded.size() == 1 ? recorded[0] : at::cat(recorded);
  at::Tensor totals = (recorded_counted.has_value() ? rows * recorded_counted->reshape({-1, 3}) : rows).sum(0);
  const at::Tensor zero = at::zeros({1}, f64);
  at::Tensor grad_norm = zero, grad_max = zero, param_norm = zero, modules;
  if (counts.has_value()) {
    const int64_t rows = counts->size(0);
    totals = totals + (counted.has_value() ? *counts * counted->unsqueeze(1) : *counts).sum(0);
    param_norm = combine_norms(norm->narrow(0, 0, n_params)).reshape({1});
    if (rows > n_params) {
      const at::Tensor grad_norms = norm->narrow(0, n_params, rows - n_params);
      grad_norm = combine_norms(grad_norms).reshape({1});
      grad_max = absmax->narrow(0, n_params, rows - n_params).amax().reshape({1});
      if (groups.has_value()) {
        modules = at::zeros({n_groups}, f64).index_add_(0, *groups, grad_norms.square()).sqrt_();
      }
      if (grad_scale.has_value()) {
        const at::Tensor inverse = as_double(*grad_scale).reciprocal();
        grad_norm = grad_norm * inverse;
        grad_max = grad_max * inverse;
        if (modules.defined()) {
          modules = modules * inverse;
        }
      }
    } else if (n_groups > 0) {
      modules = at::zeros({n_groups}, f64);
    }
  }
  const at::Tensor flag = nan_only ? totals.narrow(0, 0, 1) : totals.sum(0, /*keepdim=*/true);
  std::vector<at::Tensor> parts = {at::cat({flag, totals}).to(at::kDouble), grad_norm, grad_max, param_norm,
                                   found_inf.has_value() ? as_double(*found_inf) : zero};
  if (!losses.empty()) {
    const at::Tensor means = at::stack(losses).reshape({-1});
    int64_t first = 0;
    for (const int64_t calls : loss_calls) {
      parts.push_back(means.narrow(0, first, calls).mean(0, /*keepdim=*/true));
      first += calls;
    }
  }
  if (scale.has_value()) {
    parts.push_back(as_double(*scale));
  }
  if (modules.defined()) {
    parts.push_back(modules);
  }
  return at::cat(parts);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfast, CompositeExplicitAutograd, m) {
  m.impl("step_summary", &step_summary_aten);
}

}  // namespace nanfast

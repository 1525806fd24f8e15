// CPU kernel of nanfast::step_summary (see NOTE: [The step's summary in one call]): plain loops over the
// few hundred numbers of a step, no ATen op but the output's allocation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../ops.h"

namespace nanfast::cpu {
namespace {

// The one value of a floating tensor, without .item() (which the dispatcher counts as a host read).
double value_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "nanfast.step_summary", [&] {
    return static_cast<double>(*c.const_data_ptr<scalar_t>());
  });
}

// amax of x[0, n), NaN if any is NaN (as torch.amax); -inf for none.
double amax(const double* x, int64_t n) {
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) {
      return x[i];
    }
    top = std::max(top, x[i]);
  }
  return top;
}

// nanfast::combine_norms on x[0, n) (see NOTE: [Combining norms]).
double combine_norms(const double* x, int64_t n) {
  if (n == 0) {
    return 0.0;
  }
  const double top = amax(x, n);
  const double scale = std::isfinite(top) && top > 0 ? top : 1.0;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = x[i] / scale;
    sum += r * r;
  }
  return scale * std::sqrt(sum);
}

at::Tensor step_summary_cpu(at::TensorList recorded, const std::optional<at::Tensor>& recorded_counted,
                            const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& norm,
                            const std::optional<at::Tensor>& absmax, int64_t n_params,
                            const std::optional<at::Tensor>& counted, bool nan_only,
                            const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_scale,
                            at::TensorList losses, at::IntArrayRef loss_calls, const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& groups, int64_t n_groups) {
  check_step_summary_inputs(recorded, recorded_counted, counts, norm, absmax, n_params, counted, found_inf, grad_scale,
                            losses, loss_calls, scale, groups, n_groups);
  int64_t totals[3] = {0, 0, 0};
  const at::Tensor weights = recorded_counted.has_value() ? recorded_counted->contiguous() : at::Tensor();
  const int64_t* w = weights.defined() ? weights.const_data_ptr<int64_t>() : nullptr;  // cell by cell, in row order
  for (const at::Tensor& part : recorded) {
    const at::Tensor rec = part.contiguous();
    const int64_t* r = rec.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < 3 * rec.size(0); ++i) {
      totals[i % 3] += w != nullptr ? r[i] * *w++ : r[i];
    }
  }
  double grad_norm = 0.0, grad_max = 0.0, param_norm = 0.0;
  std::vector<double> modules(n_groups, 0.0);
  if (counts.has_value()) {
    const at::Tensor c = counts->contiguous(), nm = norm->contiguous(), am = absmax->contiguous();
    const at::Tensor mask = counted.has_value() ? counted->contiguous() : at::Tensor();
    const int64_t rows = c.size(0), grads = rows - n_params;
    const int64_t* cp = c.const_data_ptr<int64_t>();
    const int64_t* mp = mask.defined() ? mask.const_data_ptr<int64_t>() : nullptr;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t weight = mp != nullptr ? mp[i] : 1;
      for (int k = 0; k < 3; ++k) {
        totals[k] += cp[3 * i + k] * weight;
      }
    }
    const double* np = nm.const_data_ptr<double>();
    param_norm = combine_norms(np, n_params);
    if (grads > 0) {
      grad_norm = combine_norms(np + n_params, grads);
      grad_max = amax(am.const_data_ptr<double>() + n_params, grads);
      if (groups.has_value()) {
        const at::Tensor g = groups->contiguous();
        const int64_t* gp = g.const_data_ptr<int64_t>();
        for (int64_t i = 0; i < grads; ++i) {
          TORCH_CHECK(0 <= gp[i] && gp[i] < n_groups, "nanfast.step_summary: groups[", i, "]=", gp[i],
                      " is not a module number below n_groups=", n_groups);
          modules[gp[i]] += np[n_params + i] * np[n_params + i];
        }
        for (double& m : modules) {
          m = std::sqrt(m);
        }
      }
      if (grad_scale.has_value()) {  // as a division by the scale, the same rounding as the ATen path
        const double inverse = 1.0 / value_of(*grad_scale);
        grad_norm *= inverse;
        grad_max *= inverse;
        for (double& m : modules) {
          m *= inverse;
        }
      }
    }
  }
  at::Tensor out = at::empty({step_summary_size(loss_calls, scale.has_value(), n_groups)},
                             recorded[0].options().dtype(at::kDouble));
  double* o = out.mutable_data_ptr<double>();
  o[0] = static_cast<double>(nan_only ? totals[0] : totals[0] + totals[1] + totals[2]);
  for (int k = 0; k < 3; ++k) {
    o[1 + k] = static_cast<double>(totals[k]);
  }
  o[4] = grad_norm;
  o[5] = grad_max;
  o[6] = param_norm;
  o[7] = found_inf.has_value() ? value_of(*found_inf) : 0.0;
  int64_t at = 8;
  size_t first = 0;
  for (const int64_t calls : loss_calls) {
    double sum = 0.0;
    for (int64_t i = 0; i < calls; ++i) {
      sum += value_of(losses[first + i]);
    }
    o[at++] = sum / static_cast<double>(calls);
    first += calls;
  }
  if (scale.has_value()) {
    o[at++] = value_of(*scale);
  }
  std::copy(modules.begin(), modules.end(), o + at);
  return out;
}

}  // namespace
}  // namespace nanfast::cpu

TORCH_LIBRARY_IMPL(nanfast, CPU, m) {
  m.impl("step_summary", &nanfast::cpu::step_summary_cpu);
}

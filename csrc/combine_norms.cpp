// nanfast::combine_norms: the L2 norm of a concatenation from the L2 norms of its parts.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>

#include "ops.h"

namespace nanfast {

// NOTE: [Combining norms]
// The fused ops give one L2 norm per tensor, in float64; the norm of all of them together is the norm
// of those norms. Their squares can overflow float64 (a float64 tensor's norm may exceed 1e154), so
// they are taken relative to the largest finite part. A composite of ATen ops: the same code runs
// eagerly (the watch's step summary calls it from C++), on any device and under torch.compile, which
// traces through it.
at::Tensor combine_norms(const at::Tensor& norms) {
  TORCH_CHECK(norms.dim() == 1 && norms.scalar_type() == at::kDouble,
              "nanfast.combine_norms: norms must be a float64 vector, got ", norms.scalar_type(), " of shape ",
              norms.sym_sizes());
  if (norms.sym_numel() == 0) {  // symbolic under torch.compile: a guard on the size
    return at::zeros({}, norms.options());
  }
  // The scale: the largest part, 1 where that is +inf (or NaN), and where it is 0 (all parts 0: the norm
  // is 0 at any scale) the smallest double; as step_summary's CUDA kernel scales the norms it is given,
  // in three ops where a finiteness test and a select were eight (each a launch on a GPU; the step
  // summary combines twice a step on a CPU). |x|: negative numbers are scaled by their largest magnitude.
  const at::Tensor top = norms.abs().amax();
  const at::Tensor scale = at::nan_to_num(top, 1.0, 1.0).clamp_min(std::numeric_limits<double>::denorm_min());
  return scale * at::linalg_vector_norm(norms / scale);
}

TORCH_LIBRARY_IMPL(nanfast, CompositeImplicitAutograd, m) {
  m.impl("combine_norms", &combine_norms);
}

}  // namespace nanfast

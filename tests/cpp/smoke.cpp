// Calls the operators of libnanfast through the dispatcher, as a C++ program using libtorch would:
// a CPU tensor holding NaN and infinities, and the same on CUDA where the library has CUDA kernels
// and a GPU is present. Exits 1 on a wrong result.
#include <cmath>
#include <iostream>
#include <limits>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

using StatsFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList);
using AnyFn = at::Tensor(at::TensorList);

bool check(bool ok, const char* what, const at::Device& device) {
  if (!ok) {
    std::cerr << "nanfast smoke test on " << device << ": " << what << '\n';
  }
  return ok;
}

bool check_device(const at::Device& device) {
  const auto stats = c10::Dispatcher::singleton().findSchemaOrThrow("nanfast::stats", "").typed<StatsFn>();
  const auto any_nonfinite =
      c10::Dispatcher::singleton().findSchemaOrThrow("nanfast::any_nonfinite", "").typed<AnyFn>();
  const double inf = std::numeric_limits<double>::infinity();
  const at::Tensor bad = at::tensor({3.0, std::nan(""), inf, -inf, -4.0, -inf}, at::kFloat).to(device);
  const at::Tensor good = at::arange(5, at::TensorOptions(at::kDouble).device(device));

  const auto [counts, norm, absmax] = stats.call({bad, good});
  const at::Tensor expected_counts = at::tensor({1, 1, 2, 0, 0, 0}, at::kLong).view({2, 3});
  bool ok = check(at::equal(counts.cpu(), expected_counts), "wrong counts", device);
  ok &= check(std::abs(norm[0].item<double>() - 5.0) < 1e-12, "wrong norm of the tensor with NaN", device);
  ok &= check(std::abs(norm[1].item<double>() - std::sqrt(30.0)) < 1e-12, "wrong norm", device);
  ok &= check(absmax[0].item<double>() == 4.0 && absmax[1].item<double>() == 4.0, "wrong absmax", device);
  ok &= check(any_nonfinite.call({good, bad}).item<bool>(), "any_nonfinite missed a NaN", device);
  ok &= check(!any_nonfinite.call({good}).item<bool>(), "any_nonfinite flagged finite values", device);
  return ok;
}

}  // namespace

int main() {
  bool ok = check_device(at::kCPU);
#ifdef NANFAST_WITH_CUDA
  if (at::hasCUDA()) {
    ok &= check_device(at::Device(at::kCUDA, 0));
  } else {
    std::cout << "nanfast smoke test: no GPU, CUDA kernels not run\n";
  }
#endif
  if (ok) {
    std::cout << "nanfast smoke test: ok\n";
  }
  return ok ? 0 : 1;
}

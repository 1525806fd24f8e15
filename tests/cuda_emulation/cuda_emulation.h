#pragma once
// The CUDA execution model on the CPU, for running csrc/cuda/stats_cuda.cu unchanged in the tests.
//
// NOTE: [CUDA emulation]
// The loader (tests/cuda_emulation/__init__.py) compiles a copy of the .cu file as C++ with this
// header included first and the stand-ins of c10/cuda/*.h first on the include path. The copy differs
// from the file only on two kinds of lines, rewritten in place (line numbers stay): a launch
// `k<<<grid, block, shared, stream>>>(args)` becomes `::cuda_emu::Launch(&k, site, grid, block,
// shared, stream)(args)`, and each `__shared__` array declaration is followed by a call that reports
// its address (the emulator fills shared memory with garbage before every block, so data left by an
// earlier block cannot stand in for a missing barrier). Keywords are defined away; a block's threads
// are fibers on the launching OS thread that switch only at __syncthreads(), which checks that every
// thread of the block waits at the same one. Blocks run one after another, in the order chosen with
// nanfast_emu::configure (forward, reverse or shuffled; threads too); built for ThreadSanitizer, in
// waves of unordered OS threads (see NOTE: [CUDA emulation under ThreadSanitizer] in emulator.cpp). Host-side rules are checked at
// each launch: launch limits, the 4 KB argument limit (at compile time), a launch check after each
// launch, a CUDAGuard held, and the current stream taken under it.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One copy per OS thread; a block's fibers all run on the launching thread, so they share it.
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace cuda_emu {

// Where a launch or a barrier is in the source (the copy keeps the .cu file's name and lines).
struct Site {
  const char* file;
  int line;
  const char* what;
};

const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void syncthreads(const char* file, int line);
void shared_declared(void* data, size_t bytes);
void launch_check(const char* file, int line);
void guard_entered();
void guard_exited();
cudaStream_t current_stream();

// Checks the launch's host-side rules, then runs `thread_body` once per thread of every block.
void run_grid(const Site& site, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
              const std::function<void()>& thread_body);

// Size of a kernel's parameter buffer: each parameter at its alignment, in order.
template <typename... P>
constexpr size_t parameter_bytes() {
  size_t offset = 0;
  ((offset = (offset + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return offset;
}

template <typename... P>
class Launch {
 public:
  Launch(void (*kernel)(P...), Site site, dim3 grid, dim3 block, size_t shared_bytes = 0,
         cudaStream_t stream = nullptr)
      : kernel_(kernel), site_(site), grid_(grid), block_(block), shared_bytes_(shared_bytes), stream_(stream) {}

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(parameter_bytes<P...>() <= 4096, "kernel arguments are limited to 4 KB");
    // The arguments as the kernel's parameters hold them; each thread gets its own copy.
    const std::tuple<std::decay_t<P>...> parameters(std::forward<A>(args)...);
    run_grid(site_, grid_, block_, shared_bytes_, stream_, [&] { std::apply(kernel_, parameters); });
  }

 private:
  void (*kernel_)(P...);
  Site site_;
  dim3 grid_;
  dim3 block_;
  size_t shared_bytes_;
  cudaStream_t stream_;
};

// The kernels the .cu file registers (its TORCH_LIBRARY_IMPL lands here, see below).
using StatsKernel = std::tuple<at::Tensor, at::Tensor, at::Tensor> (*)(at::TensorList);
using FlagKernel = at::Tensor (*)(at::TensorList);
using OptionalTensor = const std::optional<at::Tensor>&;
using SummaryKernel = at::Tensor (*)(at::TensorList, OptionalTensor, OptionalTensor, OptionalTensor, OptionalTensor,
                                     int64_t, OptionalTensor, bool, OptionalTensor, OptionalTensor, at::TensorList,
                                     at::IntArrayRef, OptionalTensor, OptionalTensor, int64_t);

struct KernelTable {
  StatsKernel stats = nullptr;
  FlagKernel any_nonfinite = nullptr;
  SummaryKernel step_summary = nullptr;
  void impl(const char* name, StatsKernel kernel);
  void impl(const char* name, FlagKernel kernel);
  void impl(const char* name, SummaryKernel kernel);
};

KernelTable& kernels();

}  // namespace cuda_emu

#define threadIdx (::cuda_emu::thread_idx())
#define blockIdx (::cuda_emu::block_idx())
#define blockDim (::cuda_emu::block_dim())
#define gridDim (::cuda_emu::grid_dim())
#define __syncthreads() ::cuda_emu::syncthreads(__FILE__, __LINE__)

// In the kernel file only (the loader defines CUDA_EMU_KERNEL_FILE there): its CUDA registration
// fills the emulator's table instead; the emulator registers wrappers of these kernels as
// torch.ops.nanfast_emu.* for CPU tensors.
#ifdef CUDA_EMU_KERNEL_FILE
#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, key, m)                                                        \
  static void cuda_emu_collect_##ns(::cuda_emu::KernelTable& m);                             \
  [[maybe_unused]] static const bool cuda_emu_collected_##ns =                               \
      (cuda_emu_collect_##ns(::cuda_emu::kernels()), true);                                  \
  static void cuda_emu_collect_##ns(::cuda_emu::KernelTable& m)
#endif

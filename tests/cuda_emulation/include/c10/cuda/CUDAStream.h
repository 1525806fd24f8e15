#pragma once
// Stand-in for the CUDA emulation: the current stream is a handle; taken without a CUDAGuard it is
// another device's (a launch on it is an error), and the default stream is the null handle.
#include <c10/core/Device.h>

#include "../../../cuda_emulation.h"

namespace c10::cuda {

class CUDAStream {
 public:
  explicit CUDAStream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream() const {
    return stream_;
  }
  operator cudaStream_t() const {
    return stream_;
  }

 private:
  cudaStream_t stream_;
};

inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex /*device*/ = -1) {
  return CUDAStream(::cuda_emu::current_stream());
}

}  // namespace c10::cuda

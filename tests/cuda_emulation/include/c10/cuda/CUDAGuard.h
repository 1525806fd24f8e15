#pragma once
// Stand-in for the CUDA emulation: the guard only records that it is held (launches require it).
#include <c10/core/Device.h>

#include "../../../cuda_emulation.h"

namespace c10::cuda {

class CUDAGuard {
 public:
  explicit CUDAGuard(c10::Device /*device*/) {
    ::cuda_emu::guard_entered();
  }
  ~CUDAGuard() {
    ::cuda_emu::guard_exited();
  }
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
};

}  // namespace c10::cuda

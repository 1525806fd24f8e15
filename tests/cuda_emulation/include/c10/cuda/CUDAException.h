#pragma once
// Stand-in for the CUDA emulation (see NOTE: [CUDA emulation] in cuda_emulation.h): the launch check
// marks the last launch as checked; a launch left unchecked is an error.
#include "../../../cuda_emulation.h"

#define C10_CUDA_KERNEL_LAUNCH_CHECK() ::cuda_emu::launch_check(__FILE__, __LINE__)

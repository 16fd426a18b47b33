// One check macro for CUDA runtime calls: throws sonicmoe::Error with the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include "sonicmoe/detail/host_util.h"

// SONICMOE_CUDA_CHECK(call) and SONICMOE_CUDA_CHECK_LAUNCH(): sonicmoe/detail/host_util.h (the tools use them too).

// Thin wrappers over the CUDA runtime used by host code that must also build without CUDA
// (cuda_runtime.cpp with CUDA, no_cuda_runtime.cpp without; the latter throws Error).
#pragma once

#include <cstddef>

#include "sonicmoe/detail/host_util.h"
#include "sonicmoe/types.h"

// The declarations are in sonicmoe/detail/host_util.h (the tools use them too).


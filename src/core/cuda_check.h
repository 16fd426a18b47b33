// One check macro for CUDA runtime calls: throws sonicmoe::Error with the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sonicmoe/error.h"

#define SONICMOE_CUDA_CHECK(call)                                                                  \
  do {                                                                                             \
    cudaError_t err_ = (call);                                                                     \
    if (err_ != cudaSuccess)                                                                       \
      throw ::sonicmoe::Error(std::string("CUDA error ") + cudaGetErrorName(err_) + " (" +         \
                              cudaGetErrorString(err_) + ") in " #call " at " __FILE__ ":" +       \
                              std::to_string(__LINE__));                                           \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronising.
#define SONICMOE_CUDA_CHECK_LAUNCH() SONICMOE_CUDA_CHECK(cudaGetLastError())

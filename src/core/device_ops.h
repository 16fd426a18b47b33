// Thin wrappers over the CUDA runtime used by host code that must also build without CUDA
// (cuda_runtime.cpp with CUDA, no_cuda_runtime.cpp without; the latter throws Error).
#pragma once

#include <cstddef>

#include "sonicmoe/types.h"

namespace sonicmoe::devops {

bool cuda_compiled();
int cuda_device_count();  // 0 when not compiled with CUDA or no device/driver
void* cuda_malloc_async(std::size_t bytes, int device, void* stream);
void cuda_free_async(void* ptr, int device, void* stream);
void cuda_memset_async(void* ptr, int value, std::size_t bytes, int device, void* stream);
// Synchronous copy between any two devices (cudaMemcpyDefault).
void cuda_memcpy(void* dst, const void* src, std::size_t bytes);
void cuda_memcpy_async(void* dst, const void* src, std::size_t bytes, void* stream);
void cuda_stream_synchronize(int device, void* stream);

}  // namespace sonicmoe::devops

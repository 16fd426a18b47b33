// The one internal header of the tools (tools/, examples/): host helpers that the library uses itself but that are
// not part of its API (no stability promise): overflow-checked size arithmetic, the CUDA runtime wrappers that also
// build without CUDA, the host-memory guard of the cpu backend, and the check macro for CUDA runtime calls. Everything
// else a tool needs is in the public headers (sonicmoe/moe.h, stages.h, quant.h, ...). The kernel micro-benchmarks
// (tools/bench_{gemm,elementwise,routing}.cu) measure internal kernels against the baselines and, like tests/cuda,
// include src/ through the sonicmoe_baselines target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "sonicmoe/error.h"

// Light on purpose: src/core/cuda_check.h includes this header into every CUDA translation unit, kernels included,
// where sonicmoe::Tensor must not meet cute::Tensor (hence MoEConfig declared, not sonicmoe/moe.h included).
namespace sonicmoe {

struct MoEConfig;

// a * b for sizes and element counts (both >= 0); throws Error naming `what` (e.g. "T*K") and both factors
// when the product does not fit int64, instead of wrapping into a negative or small size.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  SONICMOE_CHECK(!__builtin_mul_overflow(a, b, &r), "sonicmoe: size overflow: ", what, " = ", a, " * ", b,
                 " does not fit in int64");
  return r;
}
// a + b, checked the same way.
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  SONICMOE_CHECK(!__builtin_add_overflow(a, b, &r), "sonicmoe: size overflow: ", what, " = ", a, " + ", b,
                 " does not fit in int64");
  return r;
}

// Thin wrappers over the CUDA runtime for host code that must also build without CUDA (src/core/cuda_runtime.cpp
// with CUDA, src/core/no_cuda_runtime.cpp without; the latter throws Error).
namespace devops {

bool cuda_compiled();
int cuda_device_count();  // 0 when not compiled with CUDA or no device/driver
void* cuda_malloc_async(std::size_t bytes, int device, void* stream);
void cuda_free_async(void* ptr, int device, void* stream);
void cuda_memset_async(void* ptr, int value, std::size_t bytes, int device, void* stream);
// Synchronous copy between any two devices (cudaMemcpyDefault).
void cuda_memcpy(void* dst, const void* src, std::size_t bytes);
void cuda_memcpy_async(void* dst, const void* src, std::size_t bytes, void* stream);
void cuda_stream_synchronize(int device, void* stream);

}  // namespace devops

namespace limits {
// Bytes a new allocation can take without swapping or the OOM killer: MemAvailable (/proc/meminfo, else
// sysconf), lowered to the cgroup's remaining limit when there is one and to the room left under an address-space
// limit (RLIMIT_AS, ulimit -v). SIZE_MAX when nothing is readable.
std::size_t available_host_memory();

// Throws Error naming T, H, I, E, K, the bytes needed and the bytes available when need > available.
void check_host_memory(const char* fn, const MoEConfig& cfg, std::int64_t T, std::size_t need, const char* what);
}  // namespace limits

}  // namespace sonicmoe

// One check macro for CUDA runtime calls: throws sonicmoe::Error with the call, file and line. The names it uses
// (cudaError_t, cudaGetErrorName, ...) are looked up where it expands: include <cuda_runtime.h> there.
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

#include <cstdint>
#include <mutex>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/device_ops.h"

namespace sonicmoe::devops {

namespace {
cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    SONICMOE_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != device) SONICMOE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
};
}  // namespace

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

// The device's default memory pool keeps what it has reserved instead of returning it to the driver at
// every synchronisation (release threshold 0 by default): otherwise each training step pays for mapping
// its gigabytes of workspace again. Set once per device, on first use.
static void keep_pool_reserved(int device) {
  static std::once_flag once[64];
  if (device < 0 || device >= 64) return;
  std::call_once(once[device], [device] {
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    std::uint64_t keep = UINT64_MAX;
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) cudaGetLastError();
  });
}

void* cuda_malloc_async(std::size_t bytes, int device, void* stream) {
  if (bytes == 0) return nullptr;
  DeviceGuard g(device);
  keep_pool_reserved(device);
  void* p = nullptr;
  SONICMOE_CUDA_CHECK(cudaMallocAsync(&p, bytes, as_stream(stream)));
  return p;
}

void cuda_free_async(void* ptr, int device, void* stream) {
  if (!ptr) return;
  DeviceGuard g(device);
  cudaFreeAsync(ptr, as_stream(stream));  // never throws from a destructor path
}

void cuda_memset_async(void* ptr, int value, std::size_t bytes, int device, void* stream) {
  if (bytes == 0) return;
  DeviceGuard g(device);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(ptr, value, bytes, as_stream(stream)));
}

void cuda_memcpy(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  SONICMOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

void cuda_memcpy_async(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)));
}

void cuda_stream_synchronize(int device, void* stream) {
  DeviceGuard g(device);
  SONICMOE_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
}

}  // namespace sonicmoe::devops

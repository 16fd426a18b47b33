// Shared by the CUDA micro-benchmarks (bench_gemm, bench_elementwise, bench_routing): a checked-call
// macro, a hash-based device fill (non-zero, unstructured values without host RNG), and a CUDA-event
// median timer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace sonicmoe::bench {

// The checked-call macros' failure path (CK here, CBL in bench_gemm): "<what> at file:line" on stderr, exit 1.
[[noreturn]] inline void fail_at(const std::string& what, const char* file, int line) {
  std::fprintf(stderr, "%s at %s:%d\n", what.c_str(), file, line);
  std::exit(1);
}

inline void check_cuda(cudaError_t e, const char* file, int line) {
  if (e != cudaSuccess) fail_at(std::string("CUDA error ") + cudaGetErrorString(e), file, line);
}

}  // namespace sonicmoe::bench

#define CK(x) ::sonicmoe::bench::check_cuda((x), __FILE__, __LINE__)

namespace sonicmoe::bench {

__device__ __forceinline__ float hash_uniform(std::int64_t i, std::uint32_t seed) {  // in [-1, 1), never 0
  std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  const float f = (static_cast<float>(h & 0xffffff) / 16777216.0f) * 2.0f - 1.0f;
  return f == 0.0f ? 0.5f : f;
}

template <typename T>
__global__ void fill_kernel(T* p, std::int64_t n, std::uint32_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = scale * hash_uniform(i, seed);
    if constexpr (sizeof(T) == 2) p[i] = __float2bfloat16(v);
    else p[i] = v;
  }
}

// p[i] = scale * uniform[-1, 1) (never 0), for float or __nv_bfloat16.
template <typename T>
void fill(T* p, std::int64_t n, std::uint32_t seed, float scale, cudaStream_t stream = nullptr) {
  fill_kernel<T><<<2048, 256, 0, stream>>>(p, n, seed, scale);
  CK(cudaGetLastError());
}

// Median over `iters` runs of fn (after 3 warm-ups), timed with CUDA events on `stream`, in ms.
inline float median_ms(const std::function<void()>& fn, int iters = 20, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaStreamSynchronize(stream));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, stream));
    fn();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// A memory-bound kernel to time: its name, the bytes it moves, the call.
struct BandwidthRow {
  const char* name;
  double bytes;
  std::function<void()> fn;
};
// Times each row (median of `iters`) and prints MB moved, ms, GB/s and the GB/s as a share of the first row's
// (the device-to-device copy every such table starts with).
inline void print_bandwidth_table(const std::vector<BandwidthRow>& rows, int iters) {
  std::printf("%-40s %10s %10s %10s %8s\n", "kernel", "MB moved", "ms", "GB/s", "% copy");
  double copy_gbs = 0;
  for (const auto& r : rows) {
    const float ms = median_ms(r.fn, iters);
    const double gbs = r.bytes / (ms * 1e-3) / 1e9;
    if (copy_gbs == 0) copy_gbs = gbs;
    std::printf("%-40s %10.1f %10.3f %10.1f %7.1f%%\n", r.name, r.bytes / 1e6, ms, gbs, 100.0 * gbs / copy_gbs);
  }
}

}  // namespace sonicmoe::bench

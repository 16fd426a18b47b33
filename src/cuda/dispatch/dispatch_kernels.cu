// DESIGN.md section 10: the index kernels of the dispatched-token entries and the expert-parallel layer.
#include "cuda/dispatch/dispatch_kernels.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "core/cuda_check.h"
#include "cuda/launch_util.h"

namespace sonicmoe::cuda {

namespace {

struct LocalId {
  const std::int32_t* idx;
  std::int32_t E;
  __device__ bool operator()(std::int32_t s) const { return idx[s] >= 0 && idx[s] < E; }
};

__global__ void fill_pairs_kernel(const std::int32_t* idx, const float* w, const std::int32_t* slots,
                                  const std::int32_t* count, std::int64_t P, std::int64_t K, std::int64_t rows,
                                  std::int32_t* token, std::int32_t* expert, float* score) {
  const std::int64_t n = *count;
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < P;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    if (p < n) {
      const std::int32_t s = slots[p];
      token[p] = static_cast<std::int32_t>(s / K);
      expert[p] = idx[s];
      score[p] = w[s];
    } else {
      token[p] = static_cast<std::int32_t>(rows - 1);
      expert[p] = 0;
      score[p] = 0.0f;
    }
  }
}

__global__ void scatter_slots_kernel(const float* dscore, const std::int32_t* slots, std::int64_t P, float* dw) {
  for (std::int64_t p = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; p < P;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dw[slots[p]] = dscore[p];
}

// One thread: offsets [E+1] from counts [E] (E is small: the local experts).
__global__ void counts_to_offsets_kernel(const std::int32_t* counts, std::int64_t E, std::int32_t* offsets) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  std::int32_t acc = 0;
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    acc += counts[e] > 0 ? counts[e] : 0;
    offsets[e + 1] = acc;
  }
}

__global__ void permuted_pairs_kernel(const std::int32_t* offsets, std::int64_t E, std::int64_t rows,
                                      std::int32_t* token, std::int32_t* expert) {
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    // the last e with offsets[e] <= r (binary search over the non-decreasing offsets[0 .. E))
    std::int64_t lo = 0, hi = E - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
    }
    token[r] = static_cast<std::int32_t>(r);
    expert[r] = static_cast<std::int32_t>(lo);
  }
}

template <typename T>
__global__ void gather_kernel(const T* src, const std::int32_t* idx, std::int64_t rows, std::int64_t cols, T* dst) {
  const std::int64_t total = rows * cols;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / cols, c = i - r * cols;
    dst[i] = src[static_cast<std::int64_t>(idx[r]) * cols + c];
  }
}

constexpr int kThreads = 256;

}  // namespace

void deepep_select_slots(const Context& ctx, const std::int32_t* idx, std::int64_t nk, std::int64_t E,
                         std::int32_t* slots, std::int32_t* count) {
  cudaStream_t st = stream_of(ctx);
  if (nk == 0) {
    SONICMOE_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(std::int32_t), st));
    return;
  }
  thrust::counting_iterator<std::int32_t> in(0);
  const LocalId pred{idx, static_cast<std::int32_t>(E)};
  std::size_t temp_bytes = 0;
  SONICMOE_CUDA_CHECK(cub::DeviceSelect::If(nullptr, temp_bytes, in, slots, count, static_cast<int>(nk), pred, st));
  Tensor temp = workspace(ctx, static_cast<std::int64_t>(temp_bytes), DType::f8e4m3);  // bytes
  SONICMOE_CUDA_CHECK(cub::DeviceSelect::If(temp.data(), temp_bytes, in, slots, count, static_cast<int>(nk), pred, st));
}

void deepep_fill_pairs(const Context& ctx, const std::int32_t* idx, const float* weights, const std::int32_t* slots,
                       const std::int32_t* count, std::int64_t P, std::int64_t K, std::int64_t rows,
                       std::int32_t* token, std::int32_t* expert, float* score) {
  if (P == 0) return;
  fill_pairs_kernel<<<blocks_for(P, kThreads), kThreads, 0, stream_of(ctx)>>>(idx, weights, slots, count, P, K, rows,
                                                                             token, expert, score);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void scatter_slots(const Context& ctx, const float* dscore, const std::int32_t* slots, std::int64_t P,
                   float* dweights) {
  if (P == 0) return;
  scatter_slots_kernel<<<blocks_for(P, kThreads), kThreads, 0, stream_of(ctx)>>>(dscore, slots, P, dweights);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void permuted_pairs(const Context& ctx, const std::int32_t* counts_or_offsets, bool is_offsets, std::int64_t E,
                    std::int64_t rows, std::int32_t* token, std::int32_t* expert) {
  if (rows == 0) return;
  cudaStream_t st = stream_of(ctx);
  Tensor off;
  const std::int32_t* offsets = counts_or_offsets;
  if (!is_offsets) {
    off = workspace(ctx, E + 1, DType::i32);
    counts_to_offsets_kernel<<<1, 1, 0, st>>>(counts_or_offsets, E, off.ptr<std::int32_t>());
    SONICMOE_CUDA_CHECK_LAUNCH();
    offsets = off.ptr<std::int32_t>();
  }
  permuted_pairs_kernel<<<blocks_for(rows, kThreads), kThreads, 0, st>>>(offsets, E, rows, token, expert);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void gather_rows_any(const Context& ctx, const void* src, DType dt, const std::int32_t* idx, std::int64_t rows,
                     std::int64_t cols, void* dst) {
  if (rows == 0 || cols == 0) return;
  const int blocks = blocks_for(rows * cols, kThreads);
  cudaStream_t st = stream_of(ctx);
  if (dt == DType::bf16 || dt == DType::f16)  // 16-bit rows: a copy, the codes' type does not matter
    gather_kernel<<<blocks, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(src), idx, rows, cols,
                                               static_cast<__nv_bfloat16*>(dst));
  else
    gather_kernel<<<blocks, kThreads, 0, st>>>(static_cast<const float*>(src), idx, rows, cols,
                                               static_cast<float*>(dst));
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::cuda

// The expert bias gradient kernel (expert_bias_grad.h).
#include "cuda/elementwise/expert_bias_grad.h"

#include "core/cuda_check.h"
#include "cuda/elementwise/elementwise_common.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

using ew::aligned16;

// Block = (expert, chunk of kBgCols*V columns); kBgGroups row groups walk the expert's rows with a
// fixed stride, then the groups are summed in a fixed order. Deterministic.
constexpr int kBgCols = 32, kBgGroups = 8;
template <int V, class T>
__global__ void __launch_bounds__(kBgCols* kBgGroups) bias_grad_kernel(
    const T* __restrict__ src, const std::int32_t* __restrict__ idx, const float* __restrict__ scale,
    const std::int32_t* __restrict__ pair, std::int64_t C, const std::int32_t* __restrict__ offsets,
    T* __restrict__ db, BiasGradOut parts) {
  __shared__ float part[kBgGroups][kBgCols * V];
  const int e = blockIdx.y;
  const int col = threadIdx.x % kBgCols, grp = threadIdx.x / kBgCols;
  const std::int64_t c0 = ((std::int64_t)blockIdx.x * kBgCols + col) * V;
  const bool active = c0 < C;
  const std::int64_t r0 = __ldg(offsets + e), r1 = __ldg(offsets + e + 1);
  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.0f;
  if (active) {
    for (std::int64_t r = r0 + grp; r < r1; r += kBgGroups) {
      const std::int64_t sr = idx ? __ldg(idx + r) : r;
      const float w = scale ? __ldg(scale + __ldg(pair + r)) : 1.0f;
      float v[V];
      ew::load16<V>(src + sr * C + c0, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = fmaf(w, v[i], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) part[grp][col * V + i] = acc[i];
  __syncthreads();
  if (grp == 0 && active) {
    float out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < kBgGroups; ++k) t += part[k][col * V + i];
      out[i] = t;
    }
    if (parts.part > 0) {  // interleaved column c = 2j + p -> part p, column j
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const std::int64_t c = c0 + i;
        if (c < C) db[e * parts.expert + (c % 2) * parts.part + c / 2] = ew::from_float<T>(out[i]);
      }
    } else {
      ew::store16<V>(db + e * C + c0, out);
    }
  }
}

template <class T>
void launch_bias_grad(const T* src, const std::int32_t* src_rows_index, const float* row_scale_pair,
                      const std::int32_t* pair, std::int64_t capacity_rows, std::int64_t C,
                      const std::int32_t* offsets, int E, T* db, cudaStream_t stream, BiasGradOut parts) {
  (void)capacity_rows;
  if (parts.part > 0 && C % 2 != 0) throw Error("expert_bias_grad: a db in two parts needs an even C");
  if (E <= 0 || C <= 0) return;
  if (row_scale_pair != nullptr && pair == nullptr) throw Error("expert_bias_grad: row_scale_pair needs pair");
  const bool vec = C % 8 == 0 && aligned16(src) && aligned16(db);
  if (vec) {
    const dim3 grid(static_cast<unsigned>((C / 8 + kBgCols - 1) / kBgCols), static_cast<unsigned>(E));
    bias_grad_kernel<8, T><<<grid, kBgCols * kBgGroups, 0, stream>>>(src, src_rows_index, row_scale_pair, pair, C,
                                                                   offsets, db, parts);
  } else {
    const dim3 grid(static_cast<unsigned>((C + kBgCols - 1) / kBgCols), static_cast<unsigned>(E));
    bias_grad_kernel<1, T><<<grid, kBgCols * kBgGroups, 0, stream>>>(src, src_rows_index, row_scale_pair, pair, C,
                                                                   offsets, db, parts);
  }
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void expert_bias_grad(const __nv_bfloat16* src, const std::int32_t* src_rows_index, const float* row_scale_pair,
                      const std::int32_t* pair, std::int64_t capacity_rows, std::int64_t C,
                      const std::int32_t* offsets, int E, __nv_bfloat16* db, cudaStream_t stream,
                      BiasGradOut parts) {
  launch_bias_grad(src, src_rows_index, row_scale_pair, pair, capacity_rows, C, offsets, E, db, stream, parts);
}

void expert_bias_grad(const __half* src, const std::int32_t* src_rows_index, const float* row_scale_pair,
                      const std::int32_t* pair, std::int64_t capacity_rows, std::int64_t C,
                      const std::int32_t* offsets, int E, __half* db, cudaStream_t stream, BiasGradOut parts) {
  launch_bias_grad(src, src_rows_index, row_scale_pair, pair, capacity_rows, C, offsets, E, db, stream, parts);
}

}  // namespace sonicmoe::cuda

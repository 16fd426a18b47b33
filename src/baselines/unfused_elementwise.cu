// Baseline: the standalone memory-bound MoE kernels of unfused_elementwise.h (activation, dgated elementwise, row
// gather).
#include "baselines/unfused_elementwise.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "cuda/elementwise/elementwise_common.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::baselines {

namespace ew = cuda::ew;
namespace {

using ew::aligned16;
constexpr int kThreads = 256;

int grid_for(std::int64_t work, int threads) {
  std::int64_t b = (work + threads - 1) / threads;
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(b, 132 * 32)));
}

// ---- 1. activation ------------------------------------------------------------------------
template <Activation A, int V>
__global__ void __launch_bounds__(kThreads) activation_kernel(const __nv_bfloat16* __restrict__ z,
                                                              __nv_bfloat16* __restrict__ a, std::int64_t I,
                                                              const std::int32_t* __restrict__ offsets, int E) {
  constexpr bool glu = ew::kGlu<A>;
  const std::int64_t total = __ldg(offsets + E);
  const std::int64_t per_row = I / V;
  const std::int64_t n = total * per_row;
  for (std::int64_t v = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x; v < n;
       v += (std::int64_t)gridDim.x * blockDim.x) {
    const std::int64_t r = v / per_row, j0 = (v - r * per_row) * V;
    float out[V];
    if constexpr (glu) {
      float zz[2 * V];
      ew::load_bf16<2 * V>(z + r * 2 * I + 2 * j0, zz);
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = ew::act_fwd<A>(zz[2 * i], zz[2 * i + 1]);
    } else {
      float zz[V];
      ew::load_bf16<V>(z + r * I + j0, zz);
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = ew::act_fwd<A>(zz[i], 0.0f);
    }
    ew::store_bf16<V>(a + r * I + j0, out);
  }
}

// ---- 2. dgated ------------------------------------------------------------------------------
constexpr int kDgThreads = 128;
template <Activation A, int V, int VH>
__global__ void __launch_bounds__(kDgThreads) dgated_kernel(
    const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ z, const float* __restrict__ pair_score,
    const std::int32_t* __restrict__ pair, const __nv_bfloat16* __restrict__ d_out,
    const std::int32_t* __restrict__ gather, const __nv_bfloat16* __restrict__ b2, __nv_bfloat16* __restrict__ dz,
    __nv_bfloat16* __restrict__ as, float* __restrict__ dscore, std::int64_t H, std::int64_t I,
    const std::int32_t* __restrict__ offsets, int E) {
  __shared__ float smem[kDgThreads / 32];
  constexpr bool glu = ew::kGlu<A>;
  const std::int64_t r = blockIdx.x;
  if (r >= __ldg(offsets + E)) return;  // uniform per block
  const std::int32_t p = __ldg(pair + r);
  const float s = __ldg(pair_score + p);
  const std::int64_t zw = glu ? 2 * I : I;
  float dot = 0.0f;
  for (std::int64_t j0 = (std::int64_t)threadIdx.x * V; j0 < I; j0 += kDgThreads * V) {
    float gv[V], av[V];
    ew::load_bf16<V>(g + r * I + j0, gv);
    if constexpr (glu) {
      float zz[2 * V], dd[2 * V];
      ew::load_bf16<2 * V>(z + r * zw + 2 * j0, zz);
#pragma unroll
      for (int i = 0; i < V; ++i) av[i] = ew::dgated_elem<A>(zz[2 * i], zz[2 * i + 1], gv[i], s, dd[2 * i], dd[2 * i + 1]);
      ew::store_bf16<2 * V>(dz + r * zw + 2 * j0, dd);
    } else {
      float zz[V], dd[V], unused;
      ew::load_bf16<V>(z + r * zw + j0, zz);
#pragma unroll
      for (int i = 0; i < V; ++i) av[i] = ew::dgated_elem<A>(zz[i], 0.0f, gv[i], s, dd[i], unused);
      ew::store_bf16<V>(dz + r * zw + j0, dd);
    }
    float sa[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      dot += gv[i] * av[i];
      sa[i] = s * av[i];
    }
    if (as != nullptr) ew::store_bf16<V>(as + r * I + j0, sa);
  }
  if (b2 != nullptr) {
    const int e = ew::find_expert(offsets, E, static_cast<std::int32_t>(r));
    const std::int64_t t = __ldg(gather + r);
    for (std::int64_t h0 = (std::int64_t)threadIdx.x * VH; h0 < H; h0 += kDgThreads * VH) {
      float ov[VH], bv[VH];
      ew::load_bf16<VH>(d_out + t * H + h0, ov);
      ew::load_bf16<VH>(b2 + e * H + h0, bv);
#pragma unroll
      for (int i = 0; i < VH; ++i) dot += ov[i] * bv[i];
    }
  }
  const float tot = ew::block_sum<kDgThreads>(dot, smem);
  if (threadIdx.x == 0) dscore[p] = tot;
}

// ---- 4. gather rows -------------------------------------------------------------------------------
template <int V>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __nv_bfloat16* __restrict__ src,
                                                          const std::int32_t* __restrict__ idx,
                                                          __nv_bfloat16* __restrict__ dst, std::int64_t C,
                                                          const std::int32_t* __restrict__ total_ptr) {
  const std::int64_t total = __ldg(total_ptr);
  const std::int64_t per_row = C / V;
  const std::int64_t n = total * per_row;
  for (std::int64_t v = blockIdx.x * (std::int64_t)blockDim.x + threadIdx.x; v < n;
       v += (std::int64_t)gridDim.x * blockDim.x) {
    const std::int64_t r = v / per_row, c0 = (v - r * per_row) * V;
    const std::int64_t sr = __ldg(idx + r);
    if constexpr (V == 8) {
      reinterpret_cast<uint4*>(dst + r * C + c0)[0] = __ldg(reinterpret_cast<const uint4*>(src + sr * C + c0));
    } else {
      dst[r * C + c0] = src[sr * C + c0];
    }
  }
}

}  // namespace

void activation_forward(Activation act, const __nv_bfloat16* z, __nv_bfloat16* a, std::int64_t capacity_rows,
                        std::int64_t I, const std::int32_t* offsets, int E, cudaStream_t stream) {
  if (capacity_rows <= 0 || I <= 0) return;
  const bool vec = I % 8 == 0 && aligned16(z) && aligned16(a);
  act::dispatch(act, [&](auto tag) {
    constexpr Activation A = decltype(tag)::value;
    if (vec) {
      activation_kernel<A, 8><<<grid_for(capacity_rows * (I / 8), kThreads), kThreads, 0, stream>>>(z, a, I, offsets, E);
    } else {
      activation_kernel<A, 1><<<grid_for(capacity_rows * I, kThreads), kThreads, 0, stream>>>(z, a, I, offsets, E);
    }
  });
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void dgated_elementwise(Activation act, const __nv_bfloat16* g, const __nv_bfloat16* z, const float* pair_score,
                        const std::int32_t* pair, const __nv_bfloat16* d_out, const std::int32_t* gather,
                        const __nv_bfloat16* b2, __nv_bfloat16* dz, __nv_bfloat16* as, float* dscore,
                        std::int64_t capacity_rows, std::int64_t H, std::int64_t I, const std::int32_t* offsets,
                        int E, cudaStream_t stream) {
  if (capacity_rows <= 0 || I <= 0) return;
  if (capacity_rows > 0x7fffffffLL) throw Error("dgated_elementwise: capacity_rows exceeds 2^31-1");
  const bool vec = I % 8 == 0 && aligned16(g) && aligned16(z) && aligned16(dz) && (as == nullptr || aligned16(as));
  const bool vech = b2 == nullptr || (H % 8 == 0 && aligned16(d_out) && aligned16(b2));
  const dim3 grid(static_cast<unsigned>(capacity_rows));
  act::dispatch(act, [&](auto tag) {
    constexpr Activation A = decltype(tag)::value;
#define SONICMOE_DG(V, VH)                                                                                \
  dgated_kernel<A, V, VH><<<grid, kDgThreads, 0, stream>>>(g, z, pair_score, pair, d_out, gather, b2, dz, as, \
                                                          dscore, H, I, offsets, E)
    if (vec && vech) SONICMOE_DG(8, 8);
    else if (vec) SONICMOE_DG(8, 1);
    else if (vech) SONICMOE_DG(1, 8);
    else SONICMOE_DG(1, 1);
#undef SONICMOE_DG
  });
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void gather_rows(const __nv_bfloat16* src, const std::int32_t* idx, __nv_bfloat16* dst, std::int64_t capacity_rows,
                 std::int64_t C, const std::int32_t* offsets_total, cudaStream_t stream) {
  if (capacity_rows <= 0 || C <= 0) return;
  if (C % 8 == 0 && aligned16(src) && aligned16(dst)) {
    gather_kernel<8><<<grid_for(capacity_rows * (C / 8), kThreads), kThreads, 0, stream>>>(src, idx, dst, C, offsets_total);
  } else {
    gather_kernel<1><<<grid_for(capacity_rows * C, kThreads), kThreads, 0, stream>>>(src, idx, dst, C, offsets_total);
  }
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::baselines

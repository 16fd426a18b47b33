// Per-element helpers shared by the standalone kernels and (later) GEMM epilogues.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/activation.h"

namespace sonicmoe::cuda::ew {

// is_glu usable in device code without --expt-relaxed-constexpr.
template <Activation A>
inline constexpr bool kGlu =
    A == Activation::swiglu || A == Activation::geglu || A == Activation::reglu || A == Activation::geglu_tanh;

// Expert of row r: the e with offsets[e] <= r < offsets[e+1] (largest e with offsets[e] <= r).
__device__ __forceinline__ int find_expert(const std::int32_t* __restrict__ offsets, int E, std::int32_t r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// The 16-bit storage types (T = __nv_bfloat16 or __half) to fp32 and back, rounded to nearest even. f16 values
// beyond 65504 become inf (as PyTorch's half does).
template <class T>
struct Half2Of;
template <>
struct Half2Of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static float2 to_float2(type h) { return __bfloat1622float2(h); }
  __device__ static type from_floats(float x, float y) { return __floats2bfloat162_rn(x, y); }
};
template <>
struct Half2Of<__half> {
  using type = __half2;
  __device__ static float2 to_float2(type h) { return __half22float2(h); }
  __device__ static type from_floats(float x, float y) { return __floats2half2_rn(x, y); }
};
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <int V, class T>
__device__ __forceinline__ void load16(const T* __restrict__ p, float (&out)[V]) {
  using H2 = Half2Of<T>;
  if constexpr (V % 8 == 0) {
#pragma unroll
    for (int k = 0; k < V / 8; ++k) {
      uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + k);
      const typename H2::type* h = reinterpret_cast<const typename H2::type*>(&u);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 f = H2::to_float2(h[i]);
        out[8 * k + 2 * i] = f.x;
        out[8 * k + 2 * i + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_float(p[i]);
  }
}

template <int V, class T>
__device__ __forceinline__ void store16(T* __restrict__ p, const float (&in)[V]) {
  using H2 = Half2Of<T>;
  if constexpr (V % 8 == 0) {
#pragma unroll
    for (int k = 0; k < V / 8; ++k) {
      uint4 u;
      typename H2::type* h = reinterpret_cast<typename H2::type*>(&u);
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = H2::from_floats(in[8 * k + 2 * i], in[8 * k + 2 * i + 1]);
      reinterpret_cast<uint4*>(p)[k] = u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = from_float<T>(in[i]);
  }
}

template <int V>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* __restrict__ p, float (&out)[V]) {
  load16<V>(p, out);
}
template <int V>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* __restrict__ p, const float (&in)[V]) {
  store16<V>(p, in);
}

// Forward activation of one output element from its Z inputs (GLU: z0 = gate, z1 = up).
template <Activation A>
__device__ __forceinline__ float act_fwd(float z0, float z1) {
  if constexpr (kGlu<A>) return act::glu<A>(z0, z1);
  else return act::f<A>(z0);
}

// dgated per element: given Z inputs, g = G value, s = score: a = act(Z), dz0/dz1 = act' applied to s*g.
template <Activation A>
__device__ __forceinline__ float dgated_elem(float z0, float z1, float g, float s, float& dz0, float& dz1) {
  const float sg = s * g;
  if constexpr (kGlu<A>) {
    act::dglu<A>(z0, z1, sg, dz0, dz1);
    return act::glu<A>(z0, z1);
  } else {
    dz0 = act::df<A>(z0) * sg;
    dz1 = 0.0f;
    return act::f<A>(z0);
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Deterministic block sum (fixed order for a fixed blockDim); result valid in every thread.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* smem /* kThreads/32 */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) t += smem[w];
  return t;
}

}  // namespace sonicmoe::cuda::ew

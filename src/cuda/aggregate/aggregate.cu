// Step 6 / 10b: O[t] = sum over the pairs p of token t of score[p] * Y[rev[p]] (unweighted without scores); pairs
// with rev = -1 (dropped by a capacity) add nothing.
// The indices may come from a caller (torch.ops.sonicmoe.gather_sum) and are not read on the host: a token whose
// pair range leaves [0, P] or whose pairs name a row outside [0, rows of Y) (other than -1) gets a NaN output row,
// never an out-of-bounds read (which would leave the CUDA context unusable).
// Gather-sum, no atomics: each thread owns one 16-byte vector of one output row and loops over the token's
// pairs; fp32 accumulation, one rounding on store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "cuda/cuda_backend.h"
#include "cuda/elementwise/elementwise_common.cuh"

namespace sonicmoe::cuda {

namespace {

// A thread's 16-byte vector of a row: 8 values of the 16-bit storage types (bf16, f16), 4 of f32.
template <typename T>
struct Vec {
  static constexpr int n = 8;
  using H2 = ew::Half2Of<T>;
  __device__ static void load(const T* p, float* f) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const typename H2::type* h = reinterpret_cast<const typename H2::type*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = H2::to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
  __device__ static void store(T* p, const float* f) {
    uint4 u;
    typename H2::type* h = reinterpret_cast<typename H2::type*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = H2::from_floats(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  }
};
template <>
struct Vec<float> {
  static constexpr int n = 4;
  __device__ static void load(const float* p, float* f) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    f[0] = u.x;
    f[1] = u.y;
    f[2] = u.z;
    f[3] = u.w;
  }
  __device__ static void store(float* p, const float* f) { *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]); }
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float& d, float x) { d = x; }
__device__ __forceinline__ void from_f(__nv_bfloat16& d, float x) { d = __float2bfloat16_rn(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void from_f(__half& d, float x) { d = __float2half_rn(x); }

// Token t's pair range [p0, p1): empty, with bad set, when it leaves [0, num_pairs].
__device__ __forceinline__ void pair_range(const int* __restrict__ toff, int t, int num_pairs, int& p0, int& p1,
                                           bool& bad) {
  p0 = toff[t];
  p1 = toff[t + 1];
  bad = p0 < 0 || p1 < p0 || p1 > num_pairs;
  if (bad) p1 = p0;
}

// Whether pair p has a row to read: rev -1 (dropped by a capacity) has none; a row outside [0, num_rows) has none
// and sets bad.
__device__ __forceinline__ bool has_row(int r, int num_rows, bool& bad) {
  if (r >= 0 && r < num_rows) return true;
  bad = bad || r != -1;
  return false;
}

// grid.x: tokens (grid-stride), threads over the row in vectors of Vec<T>::n.
template <typename T>
__global__ void aggregate_vec_kernel(const T* __restrict__ Y, const float* __restrict__ score,
                                     const int* __restrict__ rev, const int* __restrict__ toff, int num_tokens,
                                     int H, int num_rows, int num_pairs, T* __restrict__ O) {
  constexpr int V = Vec<T>::n;
  const int nvec = H / V;
  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    int p0, p1;
    bool bad;
    pair_range(toff, t, num_pairs, p0, p1, bad);
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float acc[V];
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = 0.0f;
      for (int p = p0; p < p1; ++p) {
        const int r = rev[p];
        if (!has_row(r, num_rows, bad)) continue;
        const float s = score ? score[p] : 1.0f;
        float y[V];
        Vec<T>::load(Y + static_cast<std::int64_t>(r) * H + v * V, y);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = fmaf(s, y[i], acc[i]);
      }
      if (bad) {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = __int_as_float(0x7fc00000);  // NaN
      }
      Vec<T>::store(O + static_cast<std::int64_t>(t) * H + v * V, acc);
    }
  }
}

template <typename T>
__global__ void aggregate_scalar_kernel(const T* __restrict__ Y, const float* __restrict__ score,
                                        const int* __restrict__ rev, const int* __restrict__ toff, int num_tokens,
                                        int H, int num_rows, int num_pairs, T* __restrict__ O) {
  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    int p0, p1;
    bool bad;
    pair_range(toff, t, num_pairs, p0, p1, bad);
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      float acc = 0.0f;
      for (int p = p0; p < p1; ++p) {
        const int r = rev[p];
        if (has_row(r, num_rows, bad))
          acc = fmaf(score ? score[p] : 1.0f, to_f(Y[static_cast<std::int64_t>(r) * H + h]), acc);
      }
      from_f(O[static_cast<std::int64_t>(t) * H + h], bad ? __int_as_float(0x7fc00000) : acc);
    }
  }
}

template <typename T>
void launch(const Context& ctx, const TensorView& y, const float* score, const RoutingMetadata& meta,
            const TensorView& out) {
  const int T_ = static_cast<int>(out.shape[0]), H = static_cast<int>(out.shape[1]);
  if (T_ == 0 || H == 0) return;
  cudaStream_t s = static_cast<cudaStream_t>(ctx.stream);
  constexpr int V = Vec<T>::n;
  const bool aligned = H % V == 0 && reinterpret_cast<std::uintptr_t>(y.data) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(out.data) % 16 == 0;
  const int grid = T_ < 65535 * 8 ? T_ : 65535 * 8;
  const int rows = static_cast<int>(y.shape[0]), pairs = static_cast<int>(meta.rev.numel());
  if (aligned) {
    const int nvec = H / V;
    int threads = nvec >= 256 ? 256 : ((nvec + 31) / 32) * 32;
    aggregate_vec_kernel<T><<<grid, threads, 0, s>>>(static_cast<const T*>(y.data), score,
                                                     meta.rev.ptr<const int>(), meta.token_offsets.ptr<const int>(),
                                                     T_, H, rows, pairs, static_cast<T*>(out.data));
  } else {
    aggregate_scalar_kernel<T><<<grid, 256, 0, s>>>(static_cast<const T*>(y.data), score,
                                                    meta.rev.ptr<const int>(), meta.token_offsets.ptr<const int>(),
                                                    T_, H, rows, pairs, static_cast<T*>(out.data));
  }
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void aggregate(const Context& ctx, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,
               const TensorView& out) {
  const float* score = pair_score.given() ? pair_score.ptr<const float>() : nullptr;
  if (out.dtype == DType::bf16) launch<__nv_bfloat16>(ctx, y, score, meta, out);
  else if (out.dtype == DType::f16) launch<__half>(ctx, y, score, meta, out);
  else launch<float>(ctx, y, score, meta, out);
}

}  // namespace sonicmoe::cuda

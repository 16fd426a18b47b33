// The FP8 layer's small helpers beside the quantisers (src/cuda/quant/dequant.h): 1x128 rows dequantised to bf16,
// and a 128x128 scale grid transposed.
#include <cuda_bf16.h>

#include <cstdint>

#include "core/fp8_e4m3.h"
#include "cuda/launch_util.h"
#include "cuda/quant/dequant.h"

namespace sonicmoe::cuda {

namespace {

constexpr int kThreads = 256;

// One thread per 16 codes (one 16-byte load, two 16-byte stores of bf16); a 16-code group lies in one 128-block.
__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const std::uint8_t* __restrict__ q,
                                                                    const float* __restrict__ scale, std::int64_t M,
                                                                    int C, __nv_bfloat16* __restrict__ out) {
  const int groups_per_row = C / 16, nb = (C + fp8::kBlock - 1) / fp8::kBlock;
  const std::int64_t groups = M * groups_per_row;
  for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t r = g / groups_per_row;
    const int c = static_cast<int>(g % groups_per_row) * 16;
    const float s = scale[r * nb + c / fp8::kBlock];
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(q + r * C + c));
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    __align__(16) __nv_bfloat16 v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      v[i] = __float2bfloat16_rn(fp8::e4m3_decode(static_cast<std::uint8_t>(w[i / 4] >> (8 * (i % 4)))) * s);
    uint4* dst = reinterpret_cast<uint4*>(out + r * C + c);
    dst[0] = reinterpret_cast<const uint4*>(v)[0];
    dst[1] = reinterpret_cast<const uint4*>(v)[1];
  }
}

__global__ void transpose_scales_kernel(const float* __restrict__ s, std::int64_t E, int R, int C,
                                        float* __restrict__ s_t) {
  const std::int64_t n = E * R * C;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = i / (static_cast<std::int64_t>(R) * C);
    const int rem = static_cast<int>(i % (static_cast<std::int64_t>(R) * C)), j = rem / R, k = rem % R;
    s_t[i] = s[(e * R + k) * C + j];  // s_t[e, j, k] = s[e, k, j]
  }
}

}  // namespace

void fp8_dequantize_rows_bf16(const Context& ctx, const TensorView& q, const TensorView& scale, const TensorView& out) {
  const std::int64_t M = q.shape[0];
  const int C = static_cast<int>(q.shape[1]);
  if (M == 0 || C == 0) return;
  dequantize_rows_kernel<<<blocks_for(M * (C / 16), kThreads), kThreads, 0, stream_of(ctx)>>>(
      q.ptr<const std::uint8_t>(), scale.ptr<const float>(), M, C, out.ptr<__nv_bfloat16>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void fp8_transpose_scales(const Context& ctx, const TensorView& s, const TensorView& s_t) {
  const std::int64_t E = s.shape[0], n = s.numel();
  if (n == 0) return;
  transpose_scales_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      s.ptr<const float>(), E, static_cast<int>(s.shape[1]), static_cast<int>(s.shape[2]), s_t.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::cuda

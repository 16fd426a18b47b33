// Device pieces shared by the FP8 quantisers: 16-byte input vectors as fp32, the amax of a block as the bits of
// |x| (exact for subnormals, NaN / inf detected), and the e4m3 cast of V values into V bytes stored at once.
// The scale rule itself is src/core/fp8_e4m3.h, shared with the CPU reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/fp8_e4m3.h"

namespace sonicmoe::cuda::quant {

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// v[0 .. 8) = the 8 bf16 values packed in raw (v[0] in the low half of raw.x), as fp32 (exact: a bf16 is the upper
// 16 bits of an fp32).
__device__ __forceinline__ void bf16x8_to_f32(const uint4& raw, float* v) {
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// v[0 .. kVec<T>) = the elements at p (16-byte aligned), as fp32 (exact).
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* v) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  if constexpr (sizeof(T) == 2) {  // bf16
    bf16x8_to_f32(raw, v);
  } else {
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
  }
}

template <int N>
__device__ __forceinline__ std::uint32_t amax_bits(const float (&v)[N]) {
  std::uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) a = max(a, fp8::abs_bits(v[i]));
  return a;
}

// Max over the `width` lanes of an aligned lane group (every lane of the warp takes part).
__device__ __forceinline__ std::uint32_t group_max(std::uint32_t a, int width) {
  for (int o = width / 2; o > 0; o /= 2) a = max(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

// Four e4m3 codes of v[0..3] * inv in one word (v[0] in the low byte); all NaN codes for a non-finite block.
__device__ __forceinline__ std::uint32_t cvt4(const float* v, const fp8::BlockScale& s) {
  if (!s.finite) return 0x01010101u * fp8::kE4m3NaN;
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] * s.inv, v[1] * s.inv), __NV_SATFINITE,
                                                           __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] * s.inv, v[3] * s.inv), __NV_SATFINITE,
                                                           __NV_E4M3);
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// The 16 codes of v[0..16) in one 16-byte word (v[0] in the low byte).
__device__ __forceinline__ uint4 codes16(const float (&v)[16], const fp8::BlockScale& s) {
  return make_uint4(cvt4(v, s), cvt4(v + 4, s), cvt4(v + 8, s), cvt4(v + 12, s));
}

// Quantises v[0..N) (N = 4, 8 or 16) and stores the N codes at dst (N-byte aligned) in one store.
template <int N>
__device__ __forceinline__ void store_codes(std::uint8_t* dst, const float (&v)[N], const fp8::BlockScale& s) {
  if constexpr (N == 4) {
    *reinterpret_cast<std::uint32_t*>(dst) = cvt4(v, s);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(cvt4(v, s), cvt4(v + 4, s));
  } else {
    static_assert(N == 16, "4, 8 or 16 codes");
    *reinterpret_cast<uint4*>(dst) = codes16(v, s);
  }
}

}  // namespace sonicmoe::cuda::quant

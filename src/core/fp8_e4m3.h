// FP8 e4m3 arithmetic of the blockwise recipe (docs/ALGORITHM.md, "FP8 blockwise recipe"), shared by the CPU
// reference and the CUDA quantisers so both derive the same scale from the same amax: the scale rule works on the
// bits of amax (no log2, no division), and the encoder is integer code (no CUDA headers; the CUDA kernels cast with
// cvt.rn.satfinite.e4m3x2.f32, which tests/cuda/test_fp8_host_cvt.cpp and tests/cuda/test_quant.cpp hold equal).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SONICMOE_FP8_HD __host__ __device__ __forceinline__
#else
#define SONICMOE_FP8_HD inline
#endif

namespace sonicmoe::fp8 {

constexpr int kBlock = 128;                // quantisation block edge (1x128, 128x1, 128x128)
constexpr float kE4m3Max = 448.0f;         // largest finite e4m3 value, code 0x7e
constexpr std::uint8_t kE4m3MaxCode = 0x7e;
constexpr std::uint8_t kE4m3NaN = 0x7f;    // what every element of a non-finite block is stored as
constexpr std::uint32_t kScaleNaNBits = 0x7fc00000u;  // the scale of a non-finite block (a quiet NaN)
constexpr int kMinScaleExp = -126;         // scales stay normal floats: 2^-126 <= scale (its inverse 2^126 is exact)

SONICMOE_FP8_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
SONICMOE_FP8_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
// |x| as bits: for non-NaN values their unsigned order is the order of |x| (subnormals included, no flush to zero),
// and any NaN or infinity is >= 0x7f800000. amax of a block = max of these.
SONICMOE_FP8_HD std::uint32_t abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }
constexpr std::uint32_t kNonFiniteBits = 0x7f800000u;

// The power of two 2^k with k = max(ceil(log2(amax / 448)), -126): the smallest scale (down to 2^-126) with
// amax / scale <= 448, computed exactly from amax's exponent and significand. amax = m * 2^e, 1 <= m < 2:
// m * 2^8 <= 448 iff m <= 1.75, so k = e - 8 when m <= 1.75 and e - 7 otherwise. amax = 0 gives k = 0 (scale 1).
// Precondition: amax_bits < kNonFiniteBits.
SONICMOE_FP8_HD int scale_exponent(std::uint32_t amax_bits) {
  if (amax_bits == 0) return 0;
  int e = static_cast<int>(amax_bits >> 23) - 127;
  std::uint32_t frac = amax_bits & 0x7fffffu;
  if ((amax_bits >> 23) == 0) {  // subnormal amax: normalise the significand
    e = -126;
    while (!(frac & 0x800000u)) {
      frac <<= 1;
      --e;
    }
    frac &= 0x7fffffu;
  }
  const int k = frac <= 0x600000u ? e - 8 : e - 7;  // 0x600000: the fraction bits of 1.75
  return k < kMinScaleExp ? kMinScaleExp : k;
}
// 2^k for k in [-126, 127] (a normal float), by its bits.
SONICMOE_FP8_HD float pow2(int k) { return bits_float(static_cast<std::uint32_t>(k + 127) << 23); }

// A block's scale and the exact inverse the values are multiplied by; both NaN for a non-finite block.
struct BlockScale {
  float scale;
  float inv;
  bool finite;
};
SONICMOE_FP8_HD BlockScale block_scale(std::uint32_t amax_bits) {
  if (amax_bits >= kNonFiniteBits) return {bits_float(kScaleNaNBits), bits_float(kScaleNaNBits), false};
  const int k = scale_exponent(amax_bits);
  return {pow2(k), pow2(-k), true};
}

// float -> e4m3, round to nearest even, saturating finite values to +-448 (like cvt.rn.satfinite.e4m3x2.f32 and
// cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)): +-inf -> +-448, any NaN -> 0x7f (as
// cuda_fp8.h, which makes every NaN the positive canonical one first).
SONICMOE_FP8_HD std::uint8_t e4m3_encode(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > kNonFiniteBits) return kE4m3NaN;
  if (a >= 0x43e80000u) return static_cast<std::uint8_t>(sign | kE4m3MaxCode);  // >= 464 (or inf): past 448 + half ulp
  const int E = static_cast<int>(a >> 23);  // biased fp32 exponent; |x| < 464 so E <= 135
  const std::uint32_t sig = E ? ((a & 0x7fffffu) | 0x800000u) : (a & 0x7fffffu);
  const int Eu = E ? E : 1;
  // |x| = sig * 2^(Eu - 150). The result's quantum: 2^(e - 3) for a normal e4m3 result (|x| >= 2^-6, e = Eu - 127),
  // 2^-9 below. n = RNE(|x| / quantum) = RNE(sig / 2^shift).
  const bool normal = Eu - 127 >= -6;
  const int shift = normal ? 20 : 141 - Eu;
  std::uint32_t n = 0;
  if (shift <= 24) {
    n = sig >> shift;
    const std::uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (n & 1u))) ++n;
  }  // shift >= 25: |x| < quantum / 2, rounds to zero
  // Normal: n in [8, 16]; code = (biased exponent << 3) + n - 8, where n = 16 carries into the exponent.
  std::uint32_t code = normal ? static_cast<std::uint32_t>(((Eu - 127 + 7) << 3) + static_cast<int>(n) - 8) : n;
  if (code > kE4m3MaxCode) code = kE4m3MaxCode;
  return static_cast<std::uint8_t>(sign | code);
}

// e4m3 -> float (exact); 0x7f and 0xff are NaN.
SONICMOE_FP8_HD float e4m3_decode(std::uint8_t c) {
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
  const int e = (c >> 3) & 0xf, m = c & 7;
  if (e == 15 && m == 7) return bits_float(sign | 0x7fc00000u);
  std::uint32_t bits;
  if (e == 0) {  // m * 2^-9
    if (m == 0) return bits_float(sign);
    int lead = 2;  // position of m's leading bit
    while (!(m >> lead)) --lead;
    const std::uint32_t frac = static_cast<std::uint32_t>(m & ((1 << lead) - 1)) << (23 - lead);
    bits = (static_cast<std::uint32_t>(lead - 9 + 127) << 23) | frac;
  } else {  // (1 + m/8) * 2^(e - 7)
    bits = (static_cast<std::uint32_t>(e - 7 + 127) << 23) | (static_cast<std::uint32_t>(m) << 20);
  }
  return bits_float(sign | bits);
}

}  // namespace sonicmoe::fp8

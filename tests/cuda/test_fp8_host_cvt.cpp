// The library's e4m3 codec (src/core/fp8_e4m3.h, what the CPU reference uses) against CUDA's own conversions in
// cuda_fp8.h, run on the host (no GPU needed): every float of [2^-12, 2^10) and a stride through all 2^32 bit
// patterns (NaN, infinities, subnormals included), and every code decoded.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/fp8_e4m3.h"

namespace {

using namespace sonicmoe;

std::uint8_t cuda_encode(float x) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

TEST(Fp8HostCvt, EncoderMatchesCudaOnEveryFloatOfTheCodeRange) {
  const std::uint32_t lo = 0x39800000u /* 2^-12 */, hi = 0x44800000u /* 2^10 */;
  for (std::uint32_t u = lo; u < hi; ++u) {
    const float x = fp8::bits_float(u);
    if (fp8::e4m3_encode(x) != cuda_encode(x)) {
      FAIL() << "x = " << x << " (bits " << std::hex << u << "): ours " << int(fp8::e4m3_encode(x)) << ", cuda "
             << int(cuda_encode(x));
    }
  }
  for (std::uint32_t u = lo | 0x80000000u; u < (hi | 0x80000000u); u += 13) {
    const float x = fp8::bits_float(u);
    ASSERT_EQ(fp8::e4m3_encode(x), cuda_encode(x)) << "x = " << x;
  }
}

TEST(Fp8HostCvt, EncoderMatchesCudaAcrossAllBitPatterns) {
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 997) {
    const float x = fp8::bits_float(static_cast<std::uint32_t>(u));
    ASSERT_EQ(fp8::e4m3_encode(x), cuda_encode(x)) << "bits " << std::hex << u;
  }
  for (std::uint32_t u : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u,
                          0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x3a800000u, 0x3a800001u, 0x43e80000u,
                          0x43e7ffffu, 0x43e80001u})
    EXPECT_EQ(fp8::e4m3_encode(fp8::bits_float(u)), cuda_encode(fp8::bits_float(u))) << "bits " << std::hex << u;
}

TEST(Fp8HostCvt, DecoderMatchesCudaOnEveryCode) {
  for (int c = 0; c < 256; ++c) {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<__nv_fp8_storage_t>(c);
    const float want = static_cast<float>(v), got = fp8::e4m3_decode(static_cast<std::uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << "code " << c << ": cuda " << want << ", ours " << got;
    }
  }
}

}  // namespace

// f16 storage (sonicmoe/types.h): the host codec against exact arithmetic (every code decoded; round to nearest
// even, subnormals, overflow to inf, NaN), and the dtype's name, size and parsing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "error_of.h"
#include "sonicmoe/error.h"
#include "sonicmoe/types.h"

namespace {

using namespace sonicmoe;
using ::testing::HasSubstr;

// The value of code h by its definition (sign, 5-bit exponent bias 15, 10-bit mantissa).
double decode(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v;
  if (e == 0) v = std::ldexp(m, -24);
  else if (e == 31) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

TEST(F16Codec, DecodesEveryCode) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_float(f16{static_cast<std::uint16_t>(h)});
    const double want = decode(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(f)))) << "NaN stays NaN, code " << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << "code " << h;
      EXPECT_EQ(float_to_f16(f).bits, h) << "round trip of code " << h;
    }
  }
}

// float_to_f16(x) is the nearest code, ties to the even one, beyond 65504 (the largest finite) inf from 65520 on.
TEST(F16Codec, RoundsToNearestEven) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = bits(rng);
    // exponents around f16's range (2^-26 .. 2^17), where every rounding case lives
    u = (u & 0x807fffffu) | ((101u + (u % 44u)) << 23);
    float x;
    std::memcpy(&x, &u, 4);
    const std::uint16_t h = float_to_f16(x).bits;
    const double got = decode(h), xd = x;
    if (std::fabs(xd) >= 65520.0) {
      EXPECT_TRUE(std::isinf(got) && (got > 0) == (xd > 0)) << x;
      continue;
    }
    // the neighbouring codes are no closer (same sign; magnitudes one code apart)
    const std::uint16_t mag = h & 0x7fff, sign = h & 0x8000;
    for (int d : {-1, 1}) {
      const int nm = mag + d;
      if (nm < 0 || nm > 0x7bff) continue;
      const double other = decode(static_cast<std::uint16_t>(sign | nm));
      const double eg = std::fabs(got - xd), eo = std::fabs(other - xd);
      EXPECT_TRUE(eg < eo || (eg == eo && (mag & 1) == 0)) << "x = " << x << " code " << h;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100000);
}

TEST(F16Codec, Edges) {
  EXPECT_EQ(float_to_f16(65504.0f).bits, 0x7bff);
  EXPECT_EQ(float_to_f16(65519.99f).bits, 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f).bits, 0x7c00);  // the tie between 65504 and 2^16 goes to even: inf
  EXPECT_EQ(float_to_f16(-1e6f).bits, 0xfc00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()).bits, 0x7c00);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)).bits, 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)).bits, 0x0000);  // half of it: tie to even zero
  EXPECT_EQ(float_to_f16(std::ldexp(1.5f, -25)).bits, 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)).bits, 0x0400);  // smallest normal
  EXPECT_EQ(float_to_f16(-0.0f).bits, 0x8000);
  EXPECT_EQ(round_to_f16(1.0f + std::ldexp(1.0f, -11)), 1.0f);  // tie to even
  EXPECT_EQ(round_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 1.0f + std::ldexp(1.0f, -9));
}

TEST(F16Dtype, NameSizeParse) {
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_STREQ(dtype_name(DType::f16), "f16");
  EXPECT_TRUE(is_16bit_float(DType::f16) && is_16bit_float(DType::bf16) && !is_16bit_float(DType::f32));
  for (const char* n : {"f16", "fp16", "half", "float16", "FP16"}) EXPECT_EQ(parse_dtype(n), DType::f16) << n;
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  EXPECT_THAT(sonicmoe::testing_util::error_of([] { parse_dtype("f8"); }),
              AllOf(HasSubstr("'f8'"), HasSubstr("bf16, f16 (fp16), f32")));
}

}  // namespace

// The e4m3 codec and the scale rule of the FP8 recipe (src/core/fp8_e4m3.h) against values derived independently:
// the code table from its definition (ldexp), rounding against a brute-force nearest-even search.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "core/fp8_e4m3.h"
#include "sonicmoe/error.h"
#include "sonicmoe/tensor.h"
#include "sonicmoe/types.h"

namespace {

using namespace sonicmoe;


// The value of an e4m3 code by its definition (OCP E4M3FN: bias 7, subnormals m * 2^-9, S.1111.111 is NaN).
double e4m3_value(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return s ? -mag : mag;
}

// Nearest code to x >= 0 (finite) by search over the positive codes, ties to the even code, saturating at 448.
int nearest_code(double x) {
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double dc = std::abs(e4m3_value(c) - x), db = std::abs(e4m3_value(best) - x);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return best;
}

TEST(Fp8Codec, DecodesEveryCodeAsDefined) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_value(c);
    const float got = fp8::e4m3_decode(static_cast<std::uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;  // -0 is 0x80
    }
  }
  EXPECT_EQ(fp8::e4m3_decode(0x7e), 448.0f);
  EXPECT_EQ(fp8::e4m3_decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8::e4m3_decode(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8Codec, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const float v = fp8::e4m3_decode(static_cast<std::uint8_t>(c));
    const int want = (c & 0x7f) == 0x7f ? 0x7f : c;  // both NaN codes encode back as 0x7f
    EXPECT_EQ(fp8::e4m3_encode(v), want) << "code " << c << " value " << v;
  }
}

TEST(Fp8Codec, TiesRoundToEvenAndNeighboursRoundToNearest) {
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = fp8::e4m3_decode(static_cast<std::uint8_t>(c)), hi = fp8::e4m3_decode(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: one more bit than e4m3 has
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const int even = (c & 1) == 0 ? c : c + 1;
    EXPECT_EQ(fp8::e4m3_encode(mid), even) << "tie between codes " << c << " and " << c + 1;
    EXPECT_EQ(fp8::e4m3_encode(-mid), even | 0x80);
    EXPECT_EQ(fp8::e4m3_encode(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(fp8::e4m3_encode(std::nextafter(mid, 1e9f)), c + 1);
  }
}

TEST(Fp8Codec, SaturatesFiniteAndInfinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, 449.0f, 463.99f, 464.0f, 464.01f, 480.0f, 1e4f, 3.4e38f, inf}) {
    EXPECT_EQ(fp8::e4m3_encode(v), 0x7e) << v;
    EXPECT_EQ(fp8::e4m3_encode(-v), 0xfe) << -v;
  }
  EXPECT_EQ(fp8::e4m3_encode(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(-std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(fp8::e4m3_encode(fp8::bits_float(0x7f800001u)), 0x7f);  // signalling NaN
}

TEST(Fp8Codec, SubnormalsAndUnderflow) {
  EXPECT_EQ(fp8::e4m3_encode(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(fp8::e4m3_encode(std::ldexp(1.0f, -10)), 0x00);                          // tie with 0 -> even 0
  EXPECT_EQ(fp8::e4m3_encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(fp8::e4m3_encode(std::ldexp(3.0f, -10)), 0x02);                          // tie 1 / 2 -> 2
  EXPECT_EQ(fp8::e4m3_encode(std::ldexp(15.0f, -10)), 0x08);                         // tie 7 / 8 -> 8 = 2^-6
  EXPECT_EQ(fp8::e4m3_encode(-std::ldexp(1.0f, -12)), 0x80);                         // underflow keeps the sign
  EXPECT_EQ(fp8::e4m3_encode(fp8::bits_float(0x00000001u)), 0x00);                         // fp32 subnormals
  EXPECT_EQ(fp8::e4m3_encode(fp8::bits_float(0x80400000u)), 0x80);
  EXPECT_EQ(fp8::e4m3_encode(0.0f), 0x00);
  EXPECT_EQ(fp8::e4m3_encode(-0.0f), 0x80);
}

// Every float in [2^-11, 512) with a stride, and random floats of every magnitude, against the brute-force search.
TEST(Fp8Codec, MatchesNearestEvenSearch) {
  std::uint32_t lo = fp8::float_bits(std::ldexp(1.0f, -11)), hi = fp8::float_bits(512.0f);
  for (std::uint32_t u = lo; u < hi; u += 4099) {
    const float x = fp8::bits_float(u);
    const int want = nearest_code(x);
    ASSERT_EQ(fp8::e4m3_encode(x), want) << "x = " << x;
    ASSERT_EQ(fp8::e4m3_encode(-x), want | 0x80) << "x = " << -x;
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0x7f7fffffu);
  for (int i = 0; i < 20000; ++i) {
    const float x = fp8::bits_float(bits(rng));
    ASSERT_EQ(fp8::e4m3_encode(x), nearest_code(x)) << "x = " << x;
  }
}

// Scale 2^k with k = max(ceil(log2(amax / 448)), -126), checked in double: amax / scale <= 448 < amax / (scale / 2).
TEST(Fp8Scale, SmallestPowerOfTwoThatFits) {
  auto k_of = [](float amax) { return fp8::scale_exponent(fp8::float_bits(amax)); };
  EXPECT_EQ(k_of(0.0f), 0);
  EXPECT_EQ(k_of(448.0f), 0);
  EXPECT_EQ(k_of(std::nextafter(448.0f, 1e9f)), 1);
  EXPECT_EQ(k_of(1.0f), -8);
  EXPECT_EQ(k_of(1.75f), -8);
  EXPECT_EQ(k_of(std::nextafter(1.75f, 2.0f)), -7);
  EXPECT_EQ(k_of(std::numeric_limits<float>::max()), 120);
  EXPECT_EQ(k_of(std::ldexp(1.0f, -110)), -118);
  EXPECT_EQ(k_of(std::ldexp(1.0f, -118)), -126);   // at the clamp
  EXPECT_EQ(k_of(std::ldexp(1.0f, -130)), -126);   // subnormal amax: clamped
  EXPECT_EQ(k_of(fp8::bits_float(1u)), -126);
  EXPECT_EQ(fp8::pow2(-126), std::numeric_limits<float>::min());
  EXPECT_EQ(fp8::pow2(120), std::ldexp(1.0f, 120));

  std::mt19937 rng(11);
  std::uniform_int_distribution<std::uint32_t> bits(1, 0x7f7fffffu);
  for (int i = 0; i < 100000; ++i) {
    const std::uint32_t a = bits(rng);
    const int k = fp8::scale_exponent(a);
    const double amax = fp8::bits_float(a);
    ASSERT_LE(std::ldexp(amax, -k), 448.0) << amax;
    if (k > fp8::kMinScaleExp) ASSERT_GT(std::ldexp(amax, -(k - 1)), 448.0) << amax;
    const fp8::BlockScale s = fp8::block_scale(a);
    ASSERT_TRUE(s.finite);
    ASSERT_EQ(static_cast<double>(s.scale), std::ldexp(1.0, k));
    ASSERT_EQ(static_cast<double>(s.inv), std::ldexp(1.0, -k));
  }
}

TEST(Fp8Scale, NonFiniteAmaxGivesNaN) {
  for (std::uint32_t a : {0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fffffffu}) {
    const fp8::BlockScale s = fp8::block_scale(a);
    EXPECT_FALSE(s.finite);
    EXPECT_EQ(fp8::float_bits(s.scale), fp8::kScaleNaNBits);
  }
  EXPECT_EQ(fp8::abs_bits(-std::numeric_limits<float>::infinity()), fp8::kNonFiniteBits);
}

TEST(Fp8Types, DTypeAndPrecision) {
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1u);
  EXPECT_STREQ(dtype_name(DType::f8e4m3), "f8e4m3");
  EXPECT_EQ(parse_precision("fp8"), Precision::fp8_blockwise);
  EXPECT_EQ(parse_precision("FP8-blockwise"), Precision::fp8_blockwise);
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_STREQ(precision_name(Precision::fp8_blockwise), "fp8_blockwise");
  EXPECT_THROW(parse_precision("fp16"), Error);
  Tensor t = Tensor::empty({3, 5}, DType::f8e4m3);
  EXPECT_EQ(t.nbytes(), 15u);
}

}  // namespace

// The FP8 quantisers of the CPU backend (include/sonicmoe/quant.h, src/reference/fp8_ref.cpp): block scales against
// an independent computation, partial blocks, the NaN / inf policy, gathered rows, the transposed copies, fake
// quantisation, and the argument checks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/fp8_e4m3.h"
#include "error_of.h"
#include "fp8_test_data.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/quant.h"

namespace {

using namespace sonicmoe;
using testing::HasSubstr;
using testing_util::error_of;
using testing_util::fp8_test_input;

const Context kCpu{};

float at(const Tensor& t, std::int64_t i) {
  return t.dtype() == DType::bf16 ? bf16_to_float(t.ptr<const bf16>()[i]) : t.ptr<const float>()[i];
}
bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The scale of a block of amax `amax` by its definition, in double: the smallest 2^k, k >= -126, with
// amax / 2^k <= 448; 1 for amax = 0.
double expected_scale(double amax) {
  if (amax == 0) return 1;
  int k = -126;
  while (amax / std::ldexp(1.0, k) > 448.0) ++k;
  return std::ldexp(1.0, k);
}

// Checks q / scale of one block [r0, r1) x [c0, c1) of the [., C] matrix x (an accessor): the scale, every code,
// and the dequantised error bound.
template <typename X>
void expect_block(X x, const std::uint8_t* q, std::int64_t C, float scale, std::int64_t r0, std::int64_t r1,
                  std::int64_t c0, std::int64_t c1) {
  double amax = 0;
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::abs(static_cast<double>(x(r, c))));
  ASSERT_EQ(static_cast<double>(scale), expected_scale(amax)) << "block at (" << r0 << ", " << c0 << ")";
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t c = c0; c < c1; ++c) {
      const double v = x(r, c), d = static_cast<double>(fp8::e4m3_decode(q[r * C + c])) * scale;
      // 3 mantissa bits: half an ulp is 2^-4 relative for normals; absolute 2^-10 * scale below 2^-6 * scale.
      ASSERT_LE(std::abs(d - v), std::max(std::abs(v) * 0.0625, std::ldexp(static_cast<double>(scale), -10)))
          << "(" << r << ", " << c << ") = " << v;
      ASSERT_EQ(std::signbit(d), std::signbit(v));
    }
}

TEST(Fp8Quant, RowsPartialBlocks) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::int64_t M = 5, K = 128 * 2 + 72;  // 3 blocks, the last one partial
    Tensor x = fp8_test_input({M, K}, dt, 1);
    Tensor q = Tensor::empty({M, K}, DType::f8e4m3), s = Tensor::empty({M, 3}, DType::f32);
    fp8_quantize_rows(kCpu, x, {}, q, s);
    auto xv = [&](std::int64_t r, std::int64_t c) { return at(x, r * K + c); };
    for (std::int64_t r = 0; r < M; ++r)
      for (std::int64_t b = 0; b < 3; ++b)
        expect_block(xv, q.ptr<std::uint8_t>(), K, s.ptr<float>()[r * 3 + b], r, r + 1, b * 128,
                     std::min(K, b * 128 + 128));
  }
}

// fp8_dequantize_rows: decode(q) * scale per 1x128 block, rounded once to out's dtype (partial last block; scales
// that are not powers of two too), and its argument errors.
TEST(Fp8Quant, DequantiseRows) {
  const std::int64_t M = 4, K = 128 + 40;
  Tensor x = fp8_test_input({M, K}, DType::f32, 3);
  Tensor q = Tensor::empty({M, K}, DType::f8e4m3), s = Tensor::empty({M, 2}, DType::f32);
  fp8_quantize_rows(kCpu, x, {}, q, s);
  s.ptr<float>()[3] *= 0.7f;  // a scale that is not a power of two
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor out = Tensor::empty({M, K}, dt);
    fp8_dequantize_rows(kCpu, q, s, out);
    for (std::int64_t r = 0; r < M; ++r)
      for (std::int64_t c = 0; c < K; ++c) {
        const float v = fp8::e4m3_decode(q.ptr<const std::uint8_t>()[r * K + c]) * s.ptr<const float>()[r * 2 + c / 128];
        ASSERT_EQ(at(out, r * K + c), dt == DType::bf16 ? round_to_bf16(v) : v) << r << ", " << c;
      }
  }
  Tensor f16 = Tensor::empty({M, K}, DType::f16), bad_s = Tensor::empty({M, 1}, DType::f32);
  EXPECT_THAT(error_of([&] { fp8_dequantize_rows(kCpu, q, s, f16); }), HasSubstr("argument 'out'"));
  EXPECT_THAT(error_of([&] { fp8_dequantize_rows(kCpu, q, bad_s, Tensor::empty({M, K}, DType::f32)); }),
              HasSubstr("argument 'scale'"));
  EXPECT_THAT(error_of([&] { fp8_dequantize_rows(kCpu, x, s, Tensor::empty({M, K}, DType::f32)); }),
              HasSubstr("argument 'q'"));
}

TEST(Fp8Quant, ZeroBlocksHaveScaleOneAndKeepSigns) {
  Tensor x = Tensor::zeros({1, 130}, DType::f32);
  x.ptr<float>()[1] = -0.0f;
  x.ptr<float>()[129] = 3.0f;
  Tensor q = Tensor::empty({1, 130}, DType::f8e4m3), s = Tensor::empty({1, 2}, DType::f32);
  fp8_quantize_rows(kCpu, x, {}, q, s);
  EXPECT_EQ(s.ptr<float>()[0], 1.0f);
  EXPECT_EQ(q.ptr<std::uint8_t>()[0], 0x00);
  EXPECT_EQ(q.ptr<std::uint8_t>()[1], 0x80);
  EXPECT_EQ(s.ptr<float>()[1], std::ldexp(1.0f, -7));  // amax 3 = 1.5 * 2^1: k = 1 - 8
  EXPECT_EQ(fp8::e4m3_decode(q.ptr<std::uint8_t>()[129]) * s.ptr<float>()[1], 3.0f);
}

// A block holding a NaN or an infinity: every code 0x7f and a NaN scale; the other blocks as without it.
TEST(Fp8Quant, NonFiniteBlocksBecomeNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf}) {
    const std::int64_t M = 2, K = 300;
    Tensor clean = fp8_test_input({M, K}, DType::f32, 2), x = fp8_test_input({M, K}, DType::f32, 2);
    x.ptr<float>()[5] = bad;            // row 0, block 0
    x.ptr<float>()[K + 260] = bad;      // row 1, block 2 (partial)
    Tensor q = Tensor::empty({M, K}, DType::f8e4m3), s = Tensor::empty({M, 3}, DType::f32);
    Tensor qc = Tensor::empty({M, K}, DType::f8e4m3), sc = Tensor::empty({M, 3}, DType::f32);
    fp8_quantize_rows(kCpu, x, {}, q, s);
    fp8_quantize_rows(kCpu, clean, {}, qc, sc);
    for (std::int64_t r = 0; r < M; ++r)
      for (std::int64_t c = 0; c < K; ++c) {
        const bool poisoned = (r == 0 && c < 128) || (r == 1 && c >= 256);
        const std::uint8_t got = q.ptr<std::uint8_t>()[r * K + c];
        if (poisoned) ASSERT_EQ(got, fp8::kE4m3NaN) << r << ", " << c;
        else ASSERT_EQ(got, qc.ptr<std::uint8_t>()[r * K + c]) << r << ", " << c;
      }
    for (std::int64_t i = 0; i < M * 3; ++i) {
      const bool poisoned = i == 0 || i == 5;
      if (poisoned) EXPECT_EQ(fp8::float_bits(s.ptr<float>()[i]), fp8::kScaleNaNBits);
      else EXPECT_EQ(fp8::float_bits(s.ptr<float>()[i]), fp8::float_bits(sc.ptr<float>()[i]));
    }
    Tensor d = ref::fp8_dequantize(q, s, 1, 128);
    EXPECT_TRUE(std::isnan(d.ptr<float>()[0]));
    EXPECT_TRUE(std::isfinite(d.ptr<float>()[200]));
  }
}

TEST(Fp8Quant, GatheredRowsEqualQuantisedCopies) {
  const std::int64_t T = 4, K = 192;
  Tensor x = fp8_test_input({T, K}, DType::bf16, 3);
  const std::vector<std::int32_t> idx = {2, 0, 2, 3, 1, 3};
  Tensor rows = Tensor::empty({6}, DType::i32), xg = Tensor::empty({6, K}, DType::bf16);
  for (int i = 0; i < 6; ++i) {
    rows.ptr<std::int32_t>()[i] = idx[i];
    std::memcpy(xg.ptr<bf16>() + i * K, x.ptr<bf16>() + idx[i] * K, K * sizeof(bf16));
  }
  Tensor q = Tensor::empty({6, K}, DType::f8e4m3), s = Tensor::empty({6, 2}, DType::f32);
  Tensor qg = Tensor::empty({6, K}, DType::f8e4m3), sg = Tensor::empty({6, 2}, DType::f32);
  fp8_quantize_rows(kCpu, x, rows, q, s);
  fp8_quantize_rows(kCpu, xg, {}, qg, sg);
  EXPECT_TRUE(same_bytes(q, qg));
  EXPECT_TRUE(same_bytes(s, sg));
}

TEST(Fp8Quant, ColumnsIntoTransposedCopy) {
  const std::int64_t M = 300, K = 72;  // 3 row blocks, the last partial
  Tensor x = fp8_test_input({M, K}, DType::f32, 4);
  Tensor qt = Tensor::empty({K, M}, DType::f8e4m3), st = Tensor::empty({K, 3}, DType::f32);
  fp8_quantize_cols_transposed(kCpu, x, qt, st);
  auto xt = [&](std::int64_t k, std::int64_t m) { return at(x, m * K + k); };  // x^T
  for (std::int64_t k = 0; k < K; ++k)
    for (std::int64_t b = 0; b < 3; ++b)
      expect_block(xt, qt.ptr<std::uint8_t>(), M, st.ptr<float>()[k * 3 + b], k, k + 1, b * 128,
                   std::min(M, b * 128 + 128));
}

TEST(Fp8Quant, WeightBlocksAndTheirTranspose) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const std::int64_t E = 3, N = 200, K = 300, nbn = 2, nbk = 3;
    Tensor w = fp8_test_input({E, N, K}, dt, 5);
    Tensor q = Tensor::empty({E, N, K}, DType::f8e4m3), qt = Tensor::empty({E, K, N}, DType::f8e4m3);
    Tensor s = Tensor::empty({E, nbn, nbk}, DType::f32);
    fp8_quantize_blocks(kCpu, w, q, qt, s);
    for (std::int64_t e = 0; e < E; ++e) {
      auto we = [&](std::int64_t n, std::int64_t k) { return at(w, (e * N + n) * K + k); };
      for (std::int64_t bn = 0; bn < nbn; ++bn)
        for (std::int64_t bk = 0; bk < nbk; ++bk)
          expect_block(we, q.ptr<std::uint8_t>() + e * N * K, K, s.ptr<float>()[(e * nbn + bn) * nbk + bk], bn * 128,
                       std::min(N, bn * 128 + 128), bk * 128, std::min(K, bk * 128 + 128));
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t k = 0; k < K; ++k)
          ASSERT_EQ(qt.ptr<std::uint8_t>()[(e * K + k) * N + n], q.ptr<std::uint8_t>()[(e * N + n) * K + k]);
    }
    // Transpose invariance: quantising w^T gives q_t, with the scale grid transposed.
    Tensor wt = Tensor::empty({E, K, N}, dt);
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t k = 0; k < K; ++k)
          std::memcpy(static_cast<char*>(wt.data()) + ((e * K + k) * N + n) * dtype_size(dt),
                      static_cast<const char*>(w.data()) + ((e * N + n) * K + k) * dtype_size(dt), dtype_size(dt));
    Tensor q2 = Tensor::empty({E, K, N}, DType::f8e4m3), s2 = Tensor::empty({E, nbk, nbn}, DType::f32);
    fp8_quantize_blocks(kCpu, wt, q2, {}, s2);
    EXPECT_TRUE(same_bytes(q2, qt));
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t bn = 0; bn < nbn; ++bn)
        for (std::int64_t bk = 0; bk < nbk; ++bk)
          ASSERT_EQ(s2.ptr<float>()[(e * nbk + bk) * nbn + bn], s.ptr<float>()[(e * nbn + bn) * nbk + bk]);
  }
}

TEST(Fp8Quant, FakeQuantIsDequantisedQuantAndIdempotent) {
  const std::int64_t E = 2, N = 130, K = 260;
  Tensor w = fp8_test_input({E, N, K}, DType::f32, 6);
  Tensor q = Tensor::empty({E, N, K}, DType::f8e4m3), s = Tensor::empty({E, 2, 3}, DType::f32);
  fp8_quantize_blocks(kCpu, w, q, {}, s);
  Tensor deq = ref::fp8_dequantize(q, s, 128, 128), fake = ref::fp8_fake_quant(w, 128, 128);
  EXPECT_TRUE(same_bytes(deq, fake));
  EXPECT_TRUE(same_bytes(ref::fp8_fake_quant(fake, 128, 128), fake));
  for (auto [br, bc] : {std::pair{1, 128}, std::pair{128, 1}}) {
    Tensor f = ref::fp8_fake_quant(w, br, bc);
    EXPECT_TRUE(same_bytes(ref::fp8_fake_quant(f, br, bc), f)) << br << "x" << bc;
  }
  // The fake-quantised rows are exactly the dequantised 1x128 codes.
  Tensor x = fp8_test_input({7, 200}, DType::bf16, 8);
  Tensor qx = Tensor::empty({7, 200}, DType::f8e4m3), sx = Tensor::empty({7, 2}, DType::f32);
  fp8_quantize_rows(kCpu, x, {}, qx, sx);
  EXPECT_TRUE(same_bytes(ref::fp8_dequantize(qx, sx, 1, 128), ref::fp8_fake_quant(x, 1, 128)));
}

TEST(Fp8Quant, EmptyShapes) {
  Tensor x = Tensor::empty({0, 256}, DType::f32), q = Tensor::empty({0, 256}, DType::f8e4m3),
         s = Tensor::empty({0, 2}, DType::f32);
  EXPECT_NO_THROW(fp8_quantize_rows(kCpu, x, {}, q, s));
  Tensor qt = Tensor::empty({256, 0}, DType::f8e4m3), st = Tensor::empty({256, 0}, DType::f32);
  EXPECT_NO_THROW(fp8_quantize_cols_transposed(kCpu, x, qt, st));
  Tensor w = Tensor::empty({0, 128, 128}, DType::f32), qw = Tensor::empty({0, 128, 128}, DType::f8e4m3),
         sw = Tensor::empty({0, 1, 1}, DType::f32);
  EXPECT_NO_THROW(fp8_quantize_blocks(kCpu, w, qw, qw, sw));
  // An empty K: rows of zero blocks.
  Tensor x0 = Tensor::empty({3, 0}, DType::bf16), q0 = Tensor::empty({3, 0}, DType::f8e4m3),
         s0 = Tensor::empty({3, 0}, DType::f32);
  EXPECT_NO_THROW(fp8_quantize_rows(kCpu, x0, {}, q0, s0));
  // ... but the scale's shape is still checked.
  Tensor s_bad = Tensor::empty({0, 3}, DType::f32);
  EXPECT_THROW(fp8_quantize_rows(kCpu, x, {}, q, s_bad), Error);
}

TEST(Fp8Quant, ArgumentErrorsNameTheArgument) {
  Tensor x = Tensor::empty({4, 256}, DType::f32), q = Tensor::empty({4, 256}, DType::f8e4m3),
         s = Tensor::empty({4, 2}, DType::f32);
  Tensor q_bad = Tensor::empty({4, 256}, DType::bf16), s_bad = Tensor::empty({4, 3}, DType::f32);
  Tensor xi = Tensor::empty({4, 256}, DType::i32);
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(kCpu, x, {}, q_bad, s); }),
              testing::AllOf(HasSubstr("argument 'q'"), HasSubstr("f8e4m3")));
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(kCpu, x, {}, q, s_bad); }),
              testing::AllOf(HasSubstr("argument 'scale'"), HasSubstr("[M, ceil(K/128)]")));
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(kCpu, xi, {}, q, s); }), HasSubstr("argument 'x'"));
  Tensor rows = Tensor::empty({4}, DType::i32);
  for (int i = 0; i < 4; ++i) rows.ptr<std::int32_t>()[i] = i == 2 ? 4 : i;
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(kCpu, x, rows, q, s); }),
              testing::AllOf(HasSubstr("argument 'rows'"), HasSubstr("[0, T)")));
  Tensor qt = Tensor::empty({4, 256}, DType::f8e4m3), st = Tensor::empty({256, 1}, DType::f32);
  EXPECT_THAT(error_of([&] { fp8_quantize_cols_transposed(kCpu, x, qt, st); }),
              testing::AllOf(HasSubstr("argument 'q_t'"), HasSubstr("[K, M]")));
  Tensor w = Tensor::empty({2, 256, 128}, DType::bf16), qw = Tensor::empty({2, 256, 128}, DType::f8e4m3),
         sw = Tensor::empty({2, 2, 1}, DType::f32), qwt_bad = Tensor::empty({2, 256, 128}, DType::f8e4m3);
  EXPECT_THAT(error_of([&] { fp8_quantize_blocks(kCpu, x, qw, {}, sw); }),
              testing::AllOf(HasSubstr("argument 'w'"), HasSubstr("3")));
  EXPECT_THAT(error_of([&] { fp8_quantize_blocks(kCpu, w, qw, qwt_bad, sw); }),
              testing::AllOf(HasSubstr("argument 'q_t'"), HasSubstr("[E, K, N]")));
  EXPECT_THAT(error_of([&] { fp8_quantize_blocks(kCpu, w, qw, {}, s); }), HasSubstr("argument 'scale'"));
  fp8_quantize_blocks(kCpu, w, qw, {}, sw);  // the valid call
}

}  // namespace

// DeepEP's FP8 dispatch entry (moe_forward_deepep_fp8 / moe_backward_dispatched_fp8, include/sonicmoe/dispatched.h)
// on the cpu backend: bitwise moe_forward_deepep + moe_backward_dispatched under precision fp8_blockwise on the
// dequantised rows (whose 1x128 quantisation is the given codes); scales that are not powers of two (DeepEP's amax /
// 448) honoured; N = 0; the arguments' errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "ep_test_util.h"
#include "error_of.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/dispatched.h"
#include "sonicmoe/error.h"
#include "sonicmoe/quant.h"

namespace {

using namespace sonicmoe;
using eptest::f32;
using eptest::i32;
using eptest::vec;
using sonicmoe::testing_util::error_of;

struct Fp8Case {
  static constexpr std::int64_t N = 11, K = 3, E = 5, H = 256, I = 128;
  MoEConfig cfg;
  Tensor w1, w2, b1, b2, x, q, scale, idx, wts, dout;
  MoEWeights w() const { return {TensorView(), w1, b1, w2, b2}; }
  Fp8Rows rows() const { return {q, scale}; }
};

Fp8Case make_case(Activation act) {
  Fp8Case c;
  c.cfg.num_experts = Fp8Case::E;
  c.cfg.top_k = 1;
  c.cfg.hidden_size = Fp8Case::H;
  c.cfg.intermediate_size = Fp8Case::I;
  c.cfg.activation = act;
  c.cfg.add_bias = true;
  c.cfg.precision = Precision::fp8_blockwise;
  const std::int64_t N = Fp8Case::N, K = Fp8Case::K, E = Fp8Case::E, H = Fp8Case::H, I = Fp8Case::I;
  const std::int64_t ZW = c.cfg.z_width();
  c.w1 = f32(eptest::uniform(E * ZW * H, -0.1f, 0.1f, 1), {E, ZW, H});
  c.b1 = f32(eptest::uniform(E * ZW, -0.1f, 0.1f, 2), {E, ZW});
  c.w2 = f32(eptest::uniform(E * H * I, -0.1f, 0.1f, 3), {E, H, I});
  c.b2 = f32(eptest::uniform(E * H, -0.1f, 0.1f, 4), {E, H});
  c.x = f32(eptest::uniform(N * H, -2.0f, 2.0f, 5), {N, H});
  c.dout = f32(eptest::uniform(N * H, -1.0f, 1.0f, 6), {N, H});
  c.wts = f32(eptest::uniform(N * K, 0.1f, 1.0f, 7), {N, K});
  std::vector<std::int32_t> idx(static_cast<std::size_t>(N * K));
  for (std::int64_t s = 0; s < N * K; ++s)  // distinct ids per row, some -1, row 4 without local experts
    idx[s] = (s / K == 4 || s % 4 == 1) ? -1 : static_cast<std::int32_t>((s / K + s % K) % (E - 1));
  c.idx = i32(idx, {N, K});
  c.q = Tensor::empty({N, H}, DType::f8e4m3);
  c.scale = Tensor::empty({N, H / 128}, DType::f32);
  fp8_quantize_rows(Context{}, c.x, TensorView(), c.q, c.scale);
  return c;
}

// The rows' values: decode(q) * scale, f32.
Tensor dequantized(const Tensor& q, const Tensor& scale) { return ref::fp8_dequantize(q, scale, 1, 128); }

class DeepEPFp8 : public ::testing::TestWithParam<Activation> {};

TEST_P(DeepEPFp8, BitwiseTheEntryOnTheDequantisedRows) {
  const Fp8Case c = make_case(GetParam());
  const Context ctx;
  const Tensor xd = dequantized(c.q, c.scale);
  {  // the premise: the dequantised rows quantise back to the same codes and scales
    Tensor q2 = Tensor::empty({Fp8Case::N, Fp8Case::H}, DType::f8e4m3), s2 = Tensor::empty({Fp8Case::N, 2}, DType::f32);
    fp8_quantize_rows(ctx, xd, TensorView(), q2, s2);
    ASSERT_EQ(0, std::memcmp(q2.data(), c.q.data(), c.q.nbytes()));
    ASSERT_EQ(vec(s2), vec(c.scale));
  }
  const DispatchedForward f8 = moe_forward_deepep_fp8(ctx, c.cfg, c.rows(), c.idx, c.wts, c.w());
  const DispatchedGradients g8 = moe_backward_dispatched_fp8(ctx, c.rows(), c.w(), f8, c.dout);
  const DispatchedForward f = moe_forward_deepep(ctx, c.cfg, xd, c.idx, c.wts, c.w());
  const DispatchedGradients g = moe_backward_dispatched(ctx, xd, c.w(), f, c.dout);
  EXPECT_EQ(vec(f8.output), vec(f.output));
  EXPECT_EQ(vec(g8.dx), vec(g.dx));
  EXPECT_EQ(vec(g8.dweights), vec(g.dweights));
  EXPECT_EQ(vec(g8.dw1), vec(g.dw1));
  EXPECT_EQ(vec(g8.db1), vec(g.db1));
  EXPECT_EQ(vec(g8.dw2), vec(g.dw2));
  EXPECT_EQ(vec(g8.db2), vec(g.db2));
  EXPECT_EQ(f8.saved.z_fp8.nbytes(), f.saved.z_fp8.nbytes());
  const auto out = vec(f8.output);
  EXPECT_EQ(std::vector<float>(out.begin() + 4 * Fp8Case::H, out.begin() + 5 * Fp8Case::H),
            std::vector<float>(Fp8Case::H, 0.0f)) << "a row without local experts comes out zero";
  DispatchedOptions opt;  // num_pairs given: the same
  opt.num_pairs = f8.saved.routing.meta.num_pairs;
  EXPECT_EQ(vec(moe_forward_deepep_fp8(ctx, c.cfg, c.rows(), c.idx, c.wts, c.w(), opt).output), out);
}

INSTANTIATE_TEST_SUITE_P(Activations, DeepEPFp8, ::testing::Values(Activation::swiglu, Activation::gelu));

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// Scales that are not powers of two (DeepEP quantises with amax / 448): the rows' values are the codes times those
// scales. The output tracks the unquantised layer on those values as closely as on power-of-two scales (FP8's error:
// W1, A and W2 are quantised too), and not the layer on the codes times the original scales.
TEST(DeepEPFp8, HonoursScalesThatAreNotPowersOfTwo) {
  Fp8Case c = make_case(Activation::swiglu);
  const Context ctx;
  MoEConfig plain = c.cfg;
  plain.precision = Precision::bf16;
  const auto err = [&](const Tensor& scale, const Tensor& values) {
    const DispatchedForward f8 = moe_forward_deepep_fp8(ctx, c.cfg, {c.q, scale}, c.idx, c.wts, c.w());
    return rel_rms(vec(f8.output), vec(moe_forward_deepep(ctx, plain, values, c.idx, c.wts, c.w()).output));
  };
  const double pow2 = err(c.scale, dequantized(c.q, c.scale));
  Tensor s2 = Tensor::empty({Fp8Case::N, 2}, DType::f32);
  for (std::int64_t i = 0; i < s2.numel(); ++i)
    s2.ptr<float>()[i] = c.scale.ptr<const float>()[i] * (0.7f + 0.05f * static_cast<float>(i % 5));
  const double other = err(s2, dequantized(c.q, s2));
  const double ignored = err(s2, dequantized(c.q, c.scale));  // what a path dropping the new scales would match
  EXPECT_GT(pow2, 0.0);
  EXPECT_LT(other, 1.5 * pow2) << "non-power-of-two scales: " << other << ", power-of-two: " << pow2;
  EXPECT_GT(ignored, 3.0 * other) << ignored;
}

TEST(DeepEPFp8, NoRows) {
  Fp8Case c = make_case(Activation::swiglu);
  const Context ctx;
  Tensor q = Tensor::empty({0, Fp8Case::H}, DType::f8e4m3), s = Tensor::empty({0, 2}, DType::f32);
  Tensor idx = Tensor::empty({0, Fp8Case::K}, DType::i32), w = Tensor::empty({0, Fp8Case::K}, DType::f32);
  const DispatchedForward f = moe_forward_deepep_fp8(ctx, c.cfg, {q, s}, idx, w, c.w());
  EXPECT_EQ(f.output.size(0), 0);
  const DispatchedGradients g = moe_backward_dispatched_fp8(ctx, {q, s}, c.w(), f, Tensor::empty({0, 256}, DType::f32));
  EXPECT_EQ(g.dx.size(0), 0);
  for (float v : vec(g.dw1)) ASSERT_EQ(v, 0.0f);
}

TEST(DeepEPFp8, ErrorsNameTheArgument) {
  const Fp8Case c = make_case(Activation::swiglu);
  const Context ctx;
  MoEConfig bf = c.cfg;
  bf.precision = Precision::bf16;
  EXPECT_NE(error_of([&] { moe_forward_deepep_fp8(ctx, bf, c.rows(), c.idx, c.wts, c.w()); }).find("fp8_blockwise"),
            std::string::npos);
  EXPECT_NE(error_of([&] { moe_forward_deepep_fp8(ctx, c.cfg, {c.x, c.scale}, c.idx, c.wts, c.w()); })
                .find("argument 'recv_x.q'"), std::string::npos);
  Tensor bad_scale = Tensor::empty({Fp8Case::N, 3}, DType::f32);
  EXPECT_NE(error_of([&] { moe_forward_deepep_fp8(ctx, c.cfg, {c.q, bad_scale}, c.idx, c.wts, c.w()); })
                .find("argument 'recv_x.scale'"), std::string::npos);
  Tensor few = Tensor::empty({Fp8Case::N - 1, Fp8Case::K}, DType::i32);
  EXPECT_NE(error_of([&] { moe_forward_deepep_fp8(ctx, c.cfg, c.rows(), few, c.wts, c.w()); })
                .find("argument 'recv_topk_idx'"), std::string::npos);
  const DispatchedForward f8 = moe_forward_deepep_fp8(ctx, c.cfg, c.rows(), c.idx, c.wts, c.w());
  MoEConfig plain = c.cfg;
  plain.precision = Precision::bf16;
  const DispatchedForward fb = moe_forward_deepep(ctx, plain, c.x, c.idx, c.wts, c.w());
  EXPECT_NE(error_of([&] { moe_backward_dispatched_fp8(ctx, c.rows(), c.w(), fb, c.dout); })
                .find("not the state of moe_forward_deepep_fp8"), std::string::npos);
  EXPECT_NE(error_of([&] { moe_backward_dispatched_fp8(ctx, {c.q, bad_scale}, c.w(), f8, c.dout); })
                .find("argument 'x.scale'"), std::string::npos);
}

}  // namespace

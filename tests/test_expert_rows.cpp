// The expert-rows entries (include/sonicmoe/expert_rows.h) on the cpu backend: the forward's Y and the first backward
// half's dXe, summed per token by aggregate(), bitwise the layer's output and dX; the other gradients bitwise
// moe_backward's (with dZ in its own buffer and written over Z); the refusals (a routing mode with a router, FP8).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "ep_test_util.h"
#include "sonicmoe/error.h"
#include "sonicmoe/expert_rows.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;

using eptest::f32;
using eptest::i32;
using eptest::uniform;
using eptest::vec;

struct Problem {
  MoEConfig cfg;
  Tensor x, w1, b1, w2, b2, d_out, token, expert, score;
  RoutingSpec spec;
  MoEWeights w() const {
    return {TensorView(), w1, cfg.add_bias ? b1.view() : TensorView(), w2, cfg.add_bias ? b2.view() : TensorView()};
  }
};

// T tokens, each with 0..3 distinct experts of E (token 0 and every seventh token with none), sorted by token.
Problem make_problem(Activation act, bool bias, std::uint32_t seed) {
  const std::int64_t T = 19, E = 5, H = 24, I = 16;
  Problem p;
  p.cfg = eptest::expert_config(E, H, I, act, bias);
  const std::int64_t ZW = p.cfg.z_width();
  p.x = f32(uniform(T * H, -1.0f, 1.0f, seed), {T, H});
  p.w1 = f32(uniform(E * ZW * H, -0.3f, 0.3f, seed + 1), {E, ZW, H});
  p.b1 = f32(uniform(E * ZW, -0.1f, 0.1f, seed + 2), {E, ZW});
  p.w2 = f32(uniform(E * H * I, -0.3f, 0.3f, seed + 3), {E, H, I});
  p.b2 = f32(uniform(E * H, -0.1f, 0.1f, seed + 4), {E, H});
  p.d_out = f32(uniform(T * H, -1.0f, 1.0f, seed + 5), {T, H});
  std::mt19937 g(seed + 6);
  std::vector<std::int32_t> tok, exp;
  std::vector<float> sc;
  for (std::int32_t t = 0; t < T; ++t) {
    if (t % 7 == 0) continue;
    std::vector<std::int32_t> ids = {0, 1, 2, 3, 4};
    std::shuffle(ids.begin(), ids.end(), g);
    const int k = 1 + static_cast<int>(g() % 3);
    for (int j = 0; j < k; ++j) {
      tok.push_back(t);
      exp.push_back(ids[j]);
      sc.push_back(0.1f + 0.8f * static_cast<float>(g() % 1000) / 1000.0f);
    }
  }
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  p.token = i32(tok, {N});
  p.expert = i32(exp, {N});
  p.score = f32(sc, {N});
  p.spec.mode = RoutingMode::general;
  p.spec.token = p.token;
  p.spec.expert = p.expert;
  p.spec.score = p.score;
  return p;
}

class ExpertRows : public ::testing::TestWithParam<std::tuple<Activation, bool>> {};

TEST_P(ExpertRows, SummedRowsAreTheLayer) {
  const auto [act, bias] = GetParam();
  const Problem p = make_problem(act, bias, 71);
  const Context ctx;
  const std::int64_t T = p.x.size(0), H = p.cfg.hidden_size;
  const ForwardResult ref = moe_forward(ctx, p.cfg, p.x, p.w(), p.spec);
  const Gradients rg = moe_backward(ctx, p.x, p.w(), ref.saved, p.d_out);

  for (bool dz_over_z : {false, true}) {
    const ForwardResult f = moe_forward_expert_rows(ctx, p.cfg, p.x, p.w(), p.spec);
    const Routing& r = f.saved.routing;
    const std::int64_t N = r.meta.num_pairs;
    ASSERT_EQ(f.output.ndim(), 2);
    ASSERT_EQ(f.output.size(0), N);
    ASSERT_EQ(f.output.size(1), H);
    Tensor out = Tensor::empty({T, H}, DType::f32);
    aggregate(ctx, f.output, r.pair_score, r.meta, out);
    EXPECT_EQ(vec(out), vec(ref.output)) << "dz_over_z " << dz_over_z;

    WeightGradOperands keep;
    const Gradients g1 = moe_backward_expert_rows(ctx, p.x, p.w(), f.saved, p.d_out, keep, dz_over_z);
    ASSERT_EQ(g1.dx.size(0), N);
    ASSERT_EQ(g1.dx.size(1), H);
    EXPECT_FALSE(g1.dw1.defined());
    EXPECT_FALSE(keep.as.defined());  // dW2 ran in this half
    Tensor dx = Tensor::empty({T, H}, DType::f32);
    aggregate(ctx, g1.dx, TensorView(), r.meta, dx);
    EXPECT_EQ(vec(dx), vec(rg.dx));
    EXPECT_EQ(vec(g1.dscore), vec(rg.dscore));
    EXPECT_EQ(vec(g1.dw2), vec(rg.dw2));
    const ExpertWeightGradients g2 = moe_backward_weights(ctx, p.x, p.w(), f.saved, p.d_out, keep);
    EXPECT_EQ(vec(g2.dw1), vec(rg.dw1));
    if (bias) {
      EXPECT_EQ(vec(g2.db1), vec(rg.db1));
      EXPECT_EQ(vec(g1.db2), vec(rg.db2));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, ExpertRows,
                         ::testing::Values(std::make_tuple(Activation::swiglu, true),
                                           std::make_tuple(Activation::gelu, false)));

TEST(ExpertRows, RefusesRouterModesAndFp8) {
  Problem p = make_problem(Activation::swiglu, false, 5);
  const Context ctx;
  Tensor router = f32(uniform(5 * 24, -0.1f, 0.1f, 9), {5, 24});
  MoEWeights w = p.w();
  w.router = router;
  RoutingSpec topk;  // top-K: the router's dX joins the summed rows, which these entries do not return
  p.cfg.top_k = 2;
  EXPECT_THAT([&] { moe_forward_expert_rows(ctx, p.cfg, p.x, w, topk); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("general routing only")));
  p.cfg.top_k = 1;
  p.cfg.precision = Precision::fp8_blockwise;
  EXPECT_THAT([&] { moe_forward_expert_rows(ctx, p.cfg, p.x, p.w(), p.spec); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("16-bit layer only")));
  // The backward refuses a state that no expert-rows forward could have made.
  p.cfg.precision = Precision::bf16;
  ForwardResult f = moe_forward_expert_rows(ctx, p.cfg, p.x, p.w(), p.spec);
  f.saved.config.precision = Precision::fp8_blockwise;
  WeightGradOperands keep;
  EXPECT_THAT([&] { moe_backward_expert_rows(ctx, p.x, p.w(), f.saved, p.d_out, keep); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("16-bit layer only")));
}

}  // namespace

// fp32 main_grad accumulation on the CPU reference (MoEWeights::w1_main_grad / w2_main_grad / router_main_grad,
// GradWrite::accumulate):
// the contract of main_grad_check.h (into zeros: the plain dW rounded; into random values: exactly their fp32 sum;
// deterministic; the other gradients bitwise unchanged) for the bf16 and f16 layers, both W1 layouts that take it,
// plain and GLU activations, biases, K = 1 with empty experts, the two-part backward, the FP8 layer with either
// weight-gradient precision; the stages' accumulate mode; the refusals, each naming the argument.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "error_of.h"
#include "main_grad_check.h"
#include "naive_moe.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using sonicmoe::testing_util::error_of;
using sonicmoe::testing_util::expect_main_grad_contract;

struct Case {
  const char* name;
  std::int64_t T, H, I, E, K;
  Activation act;
  bool bias;
  DType dt;
  W1Layout layout;
  Precision precision;
  Precision wgrad;
};

struct Inputs {
  Tensor x, router, w1, b1, w2, b2, d_out;
  MoEWeights weights() const { return {router, w1, b1, w2, b2}; }
};

Inputs inputs(const MoEConfig& cfg, std::int64_t T, DType dt, std::mt19937& rng) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  auto rnd = [&](std::vector<std::int64_t> shape, double sd) {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return naive::to_tensor(naive::randn(rng, static_cast<size_t>(n), sd), shape, dt);
  };
  Inputs in;
  in.x = rnd({T, H}, 1.0);
  in.router = rnd({E, H}, 0.5);
  in.w1 = rnd({E, ZW, H}, 0.3);
  in.w2 = rnd({E, H, I}, 0.3);
  if (cfg.add_bias) {
    in.b1 = rnd({E, ZW}, 0.2);
    in.b2 = rnd({E, H}, 0.2);
  }
  in.d_out = rnd({T, H}, 1.0);
  return in;
}

class MainGradLayer : public testing::TestWithParam<Case> {};

TEST_P(MainGradLayer, AddsTheUnroundedGradientAndNothingElseChanges) {
  const Case c = GetParam();
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  cfg.w1_layout = c.layout;
  cfg.precision = c.precision;
  cfg.weight_grad_precision = c.wgrad;
  std::mt19937 rng(static_cast<unsigned>(c.T * 31 + c.E));
  const Inputs in = inputs(cfg, c.T, c.dt, rng);
  Context ctx;
  const ForwardResult f = moe_forward(ctx, cfg, in.x, in.weights(), {});
  expect_main_grad_contract(ctx, in.x, in.weights(), f.saved, in.d_out, 7u + static_cast<unsigned>(c.E),
                            /*two_part=*/c.precision == Precision::bf16);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MainGradLayer,
    testing::Values(
        Case{"swiglu_bias_bf16", 37, 24, 20, 6, 2, Activation::swiglu, true, DType::bf16, W1Layout::interleaved,
             Precision::bf16, Precision::bf16},
        Case{"swiglu_concatenated", 29, 16, 12, 5, 3, Activation::swiglu, true, DType::bf16, W1Layout::concatenated,
             Precision::bf16, Precision::bf16},
        Case{"relu_f16", 33, 24, 16, 4, 2, Activation::relu, false, DType::f16, W1Layout::interleaved, Precision::bf16,
             Precision::bf16},
        // K = 1, 7 experts for 5 tokens: at least two experts get no rows (their main_grad must stay as it was)
        Case{"k1_empty_experts", 5, 16, 8, 7, 1, Activation::geglu, false, DType::bf16, W1Layout::interleaved,
             Precision::bf16, Precision::bf16},
        Case{"fp8_bf16_wgrad", 19, 128, 128, 3, 2, Activation::swiglu, true, DType::bf16, W1Layout::interleaved,
             Precision::fp8_blockwise, Precision::bf16},
        Case{"fp8_fp8_wgrad", 19, 128, 128, 3, 2, Activation::gelu, false, DType::bf16, W1Layout::interleaved,
             Precision::fp8_blockwise, Precision::fp8_blockwise}),
    [](const testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// The stage alone: weight_grad_w2 / weight_grad_w1 in accumulate mode add the stored mode's fp32 values.
TEST(MainGradStages, AccumulateAddsWhatStoreWrites) {
  const std::int64_t T = 23, H = 16, I = 8, E = 4, K = 2;
  MoEConfig cfg{E, K, H, I, Activation::swiglu, false};
  std::mt19937 rng(3);
  const Inputs in = inputs(cfg, T, DType::f32, rng);  // f32 storage: the stored dW is the fp32 sum itself
  Context ctx;
  const ForwardResult f = moe_forward(ctx, cfg, in.x, in.weights(), {});
  const RoutingMetadata& meta = f.saved.routing.meta;
  const std::int64_t N = meta.num_pairs;
  Tensor dz = naive::to_tensor(naive::randn(rng, static_cast<size_t>(N * 2 * I), 1.0), {N, 2 * I}, DType::f32);
  Tensor as = naive::to_tensor(naive::randn(rng, static_cast<size_t>(N * I), 1.0), {N, I}, DType::f32);
  Tensor dw1 = Tensor::empty({E, 2 * I, H}, DType::f32), dw2 = Tensor::empty({E, H, I}, DType::f32);
  weight_grad_w1(ctx, dz, in.x, meta, dw1, TensorView());
  weight_grad_w2(ctx, in.d_out, as, f.saved.routing.pair_score, meta, dw2, TensorView());
  Tensor acc1 = Tensor::zeros({E, 2 * I, H}, DType::f32), acc2 = Tensor::zeros({E, H, I}, DType::f32);
  for (int rep = 0; rep < 2; ++rep) {
    weight_grad_w1(ctx, dz, in.x, meta, acc1, TensorView(), W1Layout::interleaved, GradWrite::accumulate);
    weight_grad_w2(ctx, in.d_out, as, f.saved.routing.pair_score, meta, acc2, TensorView(), GradWrite::accumulate);
  }
  for (std::int64_t i = 0; i < dw1.numel(); ++i) ASSERT_EQ(acc1.ptr<float>()[i], 2.0f * dw1.ptr<float>()[i]) << i;
  for (std::int64_t i = 0; i < dw2.numel(); ++i) ASSERT_EQ(acc2.ptr<float>()[i], 2.0f * dw2.ptr<float>()[i]) << i;
}

TEST(MainGradRefusals, EachNamesTheArgument) {
  const std::int64_t T = 9, H = 16, I = 8, E = 3, K = 2;
  MoEConfig cfg{E, K, H, I, Activation::swiglu, false};
  std::mt19937 rng(5);
  const Inputs in = inputs(cfg, T, DType::bf16, rng);
  Context ctx;
  const ForwardResult f = moe_forward(ctx, cfg, in.x, in.weights(), {});
  auto backward_with = [&](const TensorView& m1, const TensorView& m2) {
    MoEWeights w = in.weights();
    w.w1_main_grad = m1;
    w.w2_main_grad = m2;
    return error_of([&] { moe_backward(ctx, in.x, w, f.saved, in.d_out); });
  };
  Tensor ok1 = Tensor::zeros({E, 2 * I, H}, DType::f32), ok2 = Tensor::zeros({E, H, I}, DType::f32);
  {
    MoEWeights w = in.weights();
    w.w1_main_grad = ok1;
    w.w2_main_grad = ok2;
    EXPECT_NO_THROW(moe_backward(ctx, in.x, w, f.saved, in.d_out));
  }
  const std::string dtype = backward_with(Tensor::zeros({E, 2 * I, H}, DType::bf16), ok2);
  EXPECT_NE(dtype.find("w1_main_grad"), std::string::npos) << dtype;
  const std::string shape = backward_with(ok1, Tensor::zeros({E, I, H}, DType::f32));
  EXPECT_NE(shape.find("w2_main_grad"), std::string::npos) << shape;
  const std::string shape1 = backward_with(Tensor::zeros({E, I, H}, DType::f32), ok2);
  EXPECT_NE(shape1.find("w1_main_grad"), std::string::npos) << shape1;
  const std::string router = error_of([&] {
    MoEWeights w = in.weights();
    w.router_main_grad = Tensor::zeros({E, H + 1}, DType::f32);
    moe_backward(ctx, in.x, w, f.saved, in.d_out);
  });
  EXPECT_NE(router.find("router_main_grad"), std::string::npos) << router;
  // the stage: accumulate needs f32, and not the separate layout
  const std::string stage = error_of([&] {
    weight_grad_w2(ctx, in.d_out, Tensor::zeros({f.saved.routing.meta.num_pairs, I}, DType::bf16),
                   f.saved.routing.pair_score, f.saved.routing.meta, Tensor::zeros({E, H, I}, DType::bf16),
                   TensorView(), GradWrite::accumulate);
  });
  EXPECT_NE(stage.find("dw2"), std::string::npos) << stage;
  const std::string mode = error_of([&] {
    weight_grad_w2(ctx, in.d_out, Tensor::zeros({f.saved.routing.meta.num_pairs, I}, DType::bf16),
                   f.saved.routing.pair_score, f.saved.routing.meta, ok2, TensorView(), static_cast<GradWrite>(7));
  });
  EXPECT_NE(mode.find("GradWrite"), std::string::npos) << mode;
}

// A main_grad sharing memory with a weight, an input or another main_grad would change what the backward reads while
// it adds into it: refused, naming both; disjoint neighbours in one allocation are fine.
TEST(MainGradRefusals, OverlapsAreRefused) {
  const std::int64_t T = 9, H = 16, I = 8, E = 3, K = 2;
  MoEConfig cfg{E, K, H, I, Activation::swiglu, false};
  std::mt19937 rng(6);
  const Inputs in = inputs(cfg, T, DType::f32, rng);  // f32 weights: a main_grad of their dtype and shape
  Context ctx;
  const ForwardResult f = moe_forward(ctx, cfg, in.x, in.weights(), {});
  const std::int64_t n1 = E * 2 * I * H, n2 = E * H * I;
  Tensor pool = Tensor::zeros({n1 + n2 + E * H}, DType::f32);
  float* base = pool.ptr<float>();
  auto with = [&](const TensorView& m1, const TensorView& m2, const TensorView& mr) {
    MoEWeights w = in.weights();
    w.w1_main_grad = m1;
    w.w2_main_grad = m2;
    w.router_main_grad = mr;
    return w;
  };
  auto backward_with = [&](const TensorView& m1, const TensorView& m2, const TensorView& mr) {
    return error_of([&] { moe_backward(ctx, in.x, with(m1, m2, mr), f.saved, in.d_out); });
  };
  const TensorView m1(base, DType::f32, {E, 2 * I, H}), m2(base + n1, DType::f32, {E, H, I}),
      mr(base + n1 + n2, DType::f32, {E, H});
  EXPECT_NO_THROW(moe_backward(ctx, in.x, with(m1, m2, mr), f.saved, in.d_out));  // adjacent, disjoint
  const std::string self = backward_with(in.w1, m2, mr);
  EXPECT_NE(self.find("'w1_main_grad'"), std::string::npos) << self;
  EXPECT_NE(self.find("overlaps 'w1'"), std::string::npos) << self;
  const std::string pair = backward_with(m1, TensorView(base + n1 - 1, DType::f32, {E, H, I}), mr);
  EXPECT_NE(pair.find("'w1_main_grad'"), std::string::npos) << pair;
  EXPECT_NE(pair.find("overlaps 'w2_main_grad'"), std::string::npos) << pair;
  const std::string input = backward_with(m1, m2, TensorView(in.x.data(), DType::f32, {E, H}));
  EXPECT_NE(input.find("'router_main_grad'"), std::string::npos) << input;
  EXPECT_NE(input.find("overlaps 'x'"), std::string::npos) << input;
}

}  // namespace

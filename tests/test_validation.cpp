// Bad inputs throw sonicmoe::Error whose message names the argument and what was expected.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>

#include "core/device_ops.h"
#include "error_of.h"
#include "naive_moe.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using naive::IVec;
using naive::Vec;
using testing::AllOf;
using testing::HasSubstr;

using sonicmoe::testing_util::error_of;

// A valid little problem: T=5, H=8, I=6, E=4, K=2, swiglu (z_width 12), f32.
struct Fixture {
  int T = 5, H = 8, I = 6, E = 4, K = 2;
  MoEConfig cfg;
  Tensor x, router, w1, w2, b1, b2, dO;
  explicit Fixture(DType dt = DType::f32, bool bias = false) {
    cfg.num_experts = E;
    cfg.top_k = K;
    cfg.hidden_size = H;
    cfg.intermediate_size = I;
    cfg.activation = Activation::swiglu;
    cfg.add_bias = bias;
    std::mt19937 rng(3);
    x = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, dt);
    dO = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, dt);
    router = naive::to_tensor(naive::randn(rng, E * H, 0.3), {E, H}, dt);
    w1 = naive::to_tensor(naive::randn(rng, E * 2 * I * H, 0.3), {E, 2 * I, H}, dt);
    w2 = naive::to_tensor(naive::randn(rng, E * H * I, 0.3), {E, H, I}, dt);
    b1 = naive::to_tensor(naive::randn(rng, E * 2 * I, 0.1), {E, 2 * I}, dt);
    b2 = naive::to_tensor(naive::randn(rng, E * H, 0.1), {E, H}, dt);
  }
  MoEWeights weights() const {
    MoEWeights w;
    w.router = router;
    w.w1 = w1;
    w.w2 = w2;
    if (cfg.add_bias) {
      w.b1 = b1;
      w.b2 = b2;
    }
    return w;
  }
};

Tensor ftensor(std::vector<std::int64_t> shape, DType dt = DType::f32) {
  Tensor t = Tensor::zeros(shape, dt);
  return t;
}

TEST(Validation, ValidProblemRuns) {
  Fixture f;
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, f.weights());
  Gradients g = moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO, 0.1f);
  EXPECT_EQ(r.output.size(0), f.T);
  EXPECT_EQ(g.dx.size(1), f.H);
}

TEST(Validation, WrongShapeW1) {
  Fixture f;
  MoEWeights w = f.weights();
  Tensor bad = ftensor({f.E, f.I, f.H});  // non-GLU width for a GLU activation
  w.w1 = bad;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'w1'"), HasSubstr("[4, 6, 8]"), HasSubstr("[4, 12, 8]")));
}

TEST(Validation, WrongShapeW2) {
  Fixture f;
  MoEWeights w = f.weights();
  Tensor bad = ftensor({f.E, f.I, f.H});  // transposed
  w.w2 = bad;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'w2'"), HasSubstr("[4, 8, 6]")));
}

TEST(Validation, WrongShapeB1) {
  Fixture f(DType::f32, true);
  MoEWeights w = f.weights();
  Tensor bad = ftensor({f.E, f.I});
  w.b1 = bad;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'b1'"), HasSubstr("[4, 12]")));
}

TEST(Validation, WrongShapeRouter) {
  Fixture f;
  MoEWeights w = f.weights();
  Tensor bad = ftensor({f.E - 1, f.H});
  w.router = bad;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'router'"), HasSubstr("[4, 8]")));
}

TEST(Validation, WrongShapeDOut) {
  Fixture f;
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, f.weights());
  Tensor bad = ftensor({f.T + 1, f.H});
  std::string msg = error_of([&] { moe_backward(Context{}, f.x, f.weights(), r.saved, bad); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'d_out'"), HasSubstr("[5, 8]")));
}

// dL/d(aux_loss) as a one-element f32 tensor (what the PyTorch binding passes) gives the host value's gradients,
// and a malformed one is refused by name.
TEST(Validation, AuxLossGradTensor) {
  Fixture f;
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, f.weights());
  Gradients by_value = moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO, 0.25f);
  Tensor d_aux = ftensor({1});
  d_aux.ptr<float>()[0] = 0.25f;
  Gradients by_tensor = moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO, AuxLossGrad(d_aux.view()));
  for (const auto& [a, b] : {std::pair{&by_value.dx, &by_tensor.dx}, std::pair{&by_value.drouter, &by_tensor.drouter},
                             std::pair{&by_value.dw1, &by_tensor.dw1}})
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0);
  Gradients no_aux = moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO);
  EXPECT_NE(std::memcmp(no_aux.drouter.data(), by_value.drouter.data(), no_aux.drouter.nbytes()), 0)
      << "the aux term changes the router gradient";
  Tensor two = ftensor({2});
  std::string msg = error_of([&] { moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO, AuxLossGrad(two.view())); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'d_aux_loss'"), HasSubstr("[1]")));
  Tensor wrong_type = Tensor::zeros({1}, DType::i32);
  msg = error_of([&] { moe_backward(Context{}, f.x, f.weights(), r.saved, f.dO, AuxLossGrad(wrong_type.view())); });
  EXPECT_THAT(msg, HasSubstr("'d_aux_loss'"));
}

TEST(Validation, WrongDtypeInt32X) {
  Fixture f;
  Tensor xi = Tensor::zeros({f.T, f.H}, DType::i32);
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, xi, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("int32"), HasSubstr("bf16, f16 or f32")));
}

TEST(Validation, MixedDtypes) {
  Fixture f;  // f32 weights
  Tensor xb = naive::to_tensor(naive::from_tensor(f.x), {f.T, f.H}, DType::bf16);
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, xb, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("f32"), HasSubstr("expected bf16")));
  // And the other way round, naming the argument.
  Fixture g(DType::bf16);
  MoEWeights w = g.weights();
  w.w2 = f.w2;  // f32 among bf16
  msg = error_of([&] { moe_forward(Context{}, g.cfg, g.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'w2'"), HasSubstr("f32"), HasSubstr("expected bf16")));
}

// f16 runs where bf16 does; one 16-bit type per call: a bf16 tensor among f16 ones is named.
TEST(Validation, MixedF16AndBf16) {
  Fixture h(DType::f16, true), b(DType::bf16, true);
  h.cfg.add_bias = true;
  EXPECT_NO_THROW(moe_forward(Context{}, h.cfg, h.x, h.weights()));
  for (const char* name : {"router", "w1", "b1", "w2", "b2"}) {
    MoEWeights w = h.weights();
    const std::string n(name);
    if (n == "router") w.router = b.router;
    if (n == "w1") w.w1 = b.w1;
    if (n == "b1") w.b1 = b.b1;
    if (n == "w2") w.w2 = b.w2;
    if (n == "b2") w.b2 = b.b2;
    std::string msg = error_of([&] { moe_forward(Context{}, h.cfg, h.x, w); });
    EXPECT_THAT(msg, AllOf(HasSubstr("'" + n + "'"), HasSubstr("bf16"), HasSubstr("expected f16"))) << name;
  }
  // dO of the other type in the backward.
  ForwardResult fwd = moe_forward(Context{}, h.cfg, h.x, h.weights());
  std::string msg = error_of([&] { moe_backward(Context{}, h.x, h.weights(), fwd.saved, b.dO); });
  EXPECT_THAT(msg, AllOf(HasSubstr("d_out"), HasSubstr("bf16"), HasSubstr("expected f16")));
}

// FP8 precision and the expert-parallel layer stay bf16 / f32: f16 is refused with a clear error.
TEST(Validation, F16RefusedByFp8) {
  Fixture h(DType::f16);
  MoEConfig cfg = h.cfg;
  cfg.precision = Precision::fp8_blockwise;
  std::string msg = error_of([&] { moe_forward(Context{}, cfg, h.x, h.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("f16"), HasSubstr("fp8_blockwise")));
}

TEST(Validation, NonContiguousView) {
  Fixture f;
  // x viewed column-major: same shape [T, H], strides [1, T].
  TensorView xs = TensorView::strided(f.x.data(), DType::f32, {f.T, f.H}, {1, f.T});
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, xs, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("contiguous")));
  // A strided weight.
  MoEWeights w = f.weights();
  Tensor big = ftensor({f.E, f.H, 2 * f.I});
  w.w2 = TensorView::strided(big.data(), DType::f32, {f.E, f.H, f.I}, {f.H * 2 * f.I, 2 * f.I, 1});
  msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'w2'"), HasSubstr("contiguous")));
}

struct General {
  Tensor tok, ex, sc;
  RoutingSpec spec() const {
    RoutingSpec s;
    s.mode = RoutingMode::general;
    s.token = tok;
    s.expert = ex;
    s.score = sc;
    return s;
  }
};

General general(const IVec& tok, const IVec& ex) {
  General g;
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  g.tok = naive::to_itensor(tok, {N});
  g.ex = naive::to_itensor(ex, {N});
  g.sc = naive::to_tensor(Vec(tok.size(), 0.5), {N});
  return g;
}

TEST(Validation, GeneralRoutingValid) {
  Fixture f;
  MoEWeights w = f.weights();
  w.router = TensorView();
  General g = general({0, 0, 2, 4}, {1, 3, 0, 2});
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, w, g.spec());
  EXPECT_EQ(r.saved.routing.meta.num_pairs, 4);
  EXPECT_EQ(naive::from_tensor(r.aux_loss).at(0), 0.0) << "general routing has no aux loss";
}

TEST(Validation, GeneralExpertOutOfRange) {
  Fixture f;
  General g = general({0, 1, 2}, {1, 4, 0});  // E = 4
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), g.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("expert"), HasSubstr("4"), HasSubstr("[0, 4)")));
  General n = general({0, 1, 2}, {1, -1, 0});
  msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), n.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("expert"), HasSubstr("-1"), HasSubstr("[0, 4)")));
}

TEST(Validation, GeneralTokenOutOfRange) {
  Fixture f;
  General g = general({0, 1, 5}, {1, 2, 0});  // T = 5
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), g.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("token"), HasSubstr("5"), HasSubstr("[0, 5)")));
}

TEST(Validation, GeneralUnsortedTriples) {
  Fixture f;
  General g = general({0, 3, 1}, {1, 2, 0});
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), g.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("token"), HasSubstr("sorted")));
}

TEST(Validation, GeneralMismatchedLengths) {
  Fixture f;
  General g = general({0, 1, 2}, {1, 2, 0});
  g.ex = naive::to_itensor({1, 2}, {2});
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), g.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("expert"), HasSubstr("[3]")));
}

TEST(Validation, GeneralScoreDtypeAndTokenDtype) {
  Fixture f;
  General g = general({0, 1, 2}, {1, 2, 0});
  g.sc = naive::to_tensor({0.5, 0.5, 0.5}, {3}, DType::bf16);
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), g.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("score"), HasSubstr("bf16"), HasSubstr("expected f32")));
  General h = general({0, 1, 2}, {1, 2, 0});
  h.tok = naive::to_tensor({0, 1, 2}, {3}, DType::f32);
  msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights(), h.spec()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("token"), HasSubstr("expected int32")));
}

TEST(Validation, WrongDtypeDOut) {
  Fixture f;
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, f.weights());
  Tensor bad = naive::to_tensor(naive::from_tensor(f.dO), {f.T, f.H}, DType::bf16);
  std::string msg = error_of([&] { moe_backward(Context{}, f.x, f.weights(), r.saved, bad); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'d_out'"), HasSubstr("bf16"), HasSubstr("expected f32")));
}

TEST(Validation, TopKGreaterThanE) {
  Fixture f;
  f.cfg.top_k = 5;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("top_k"), HasSubstr("5"), HasSubstr("4")));
  // The stage entry too.
  Tensor l = ftensor({f.T, f.E});
  msg = error_of([&] { token_rounding(Context{}, l, 5, 4, RoutingMode::round_up); });
  EXPECT_THAT(msg, HasSubstr("top_k"));
  Tensor ex = Tensor::zeros({f.T, 5}, DType::i32), sc = ftensor({f.T, 5}), cnt = Tensor::zeros({f.E}, DType::i32);
  msg = error_of([&] { topk_softmax(Context{}, l, 5, ex, sc, cnt); });
  EXPECT_THAT(msg, HasSubstr("top_k"));
  Tensor pt = Tensor::zeros({f.T * 5}, DType::i32);
  msg = error_of([&] { topk_routing(Context{}, l, 5, ex, sc, pt); });
  EXPECT_THAT(msg, AllOf(HasSubstr("topk_routing"), HasSubstr("top_k")));
}

// topk_routing names its pair_token argument when its shape is wrong, and matches the three stages it fuses.
TEST(Validation, TopkRoutingPairTokenShape) {
  Fixture f;
  Tensor l = ftensor({f.T, f.E});
  Tensor ex = Tensor::zeros({f.T, 2}, DType::i32), sc = ftensor({f.T, 2});
  Tensor bad = Tensor::zeros({f.T * 2 + 1}, DType::i32);
  const std::string msg = error_of([&] { topk_routing(Context{}, l, 2, ex, sc, bad); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'pair_token'"), HasSubstr("[T*K]")));
  Tensor pt = Tensor::zeros({f.T * 2}, DType::i32), ex2 = Tensor::zeros({f.T, 2}, DType::i32), sc2 = ftensor({f.T, 2});
  Tensor cnt = Tensor::zeros({f.E}, DType::i32);
  const RoutingMetadata m = topk_routing(Context{}, l, 2, ex, sc, pt);
  topk_softmax(Context{}, l, 2, ex2, sc2, cnt);
  for (std::int64_t i = 0; i < f.T * 2; ++i) {
    EXPECT_EQ(ex.ptr<std::int32_t>()[i], ex2.ptr<std::int32_t>()[i]);
    EXPECT_EQ(pt.ptr<std::int32_t>()[i], i / 2);
  }
  for (std::int64_t e = 0; e < f.E; ++e) EXPECT_EQ(m.counts.ptr<std::int32_t>()[e], cnt.ptr<std::int32_t>()[e]);
}

TEST(Validation, TopKZero) {
  Fixture f;
  f.cfg.top_k = 0;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("top_k"), HasSubstr("0")));
  EXPECT_THAT(error_of([&] { validate_config(f.cfg); }), HasSubstr("top_k"));
}

TEST(Validation, BiasesGivenWithoutAddBias) {
  Fixture f(DType::f32, false);
  MoEWeights w = f.weights();
  w.b1 = f.b1;
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("b1"), HasSubstr("add_bias")));
  w = f.weights();
  w.b2 = f.b2;
  msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("b2"), HasSubstr("add_bias")));
}

TEST(Validation, MissingBiasWithAddBias) {
  Fixture f(DType::f32, true);
  MoEWeights w = f.weights();
  w.b2 = TensorView();
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'b2'"), HasSubstr("not given")));
}

TEST(Validation, MissingRouterUnderTopK) {
  Fixture f;
  MoEWeights w = f.weights();
  w.router = TensorView();
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'router'"), HasSubstr("not given")));
  RoutingSpec spec;
  spec.mode = RoutingMode::round_up;
  msg = error_of([&] { moe_forward(Context{}, f.cfg, f.x, w, spec); });
  EXPECT_THAT(msg, HasSubstr("'router'"));
}

TEST(Validation, CudaBackendWithoutCudaSaysWhy) {
  if (cuda_backend_available()) GTEST_SKIP() << "a CUDA device is available; this checks the refusal path";
  Fixture f;
  Context ctx;
  ctx.backend = Backend::cuda;
  // The layer entry: the message must say that the cuda backend is unavailable and why, not merely that
  // the (CPU) tensors are on the wrong device.
  std::string msg = error_of([&] { moe_forward(ctx, f.cfg, f.x, f.weights()); });
  EXPECT_THAT(msg, HasSubstr("Backend::cuda"));
  EXPECT_THAT(msg, testing::AnyOf(HasSubstr("built without CUDA"), HasSubstr("CUDA device")));
  // A stage entry.
  Tensor logits = ftensor({f.T, f.E});
  msg = error_of([&] { router_logits(ctx, f.x, f.router, logits); });
  EXPECT_THAT(msg, HasSubstr("Backend::cuda"));
  EXPECT_THAT(msg, testing::AnyOf(HasSubstr("built without CUDA"), HasSubstr("CUDA device")));
}

TEST(Validation, ZeroTokens) {
  Fixture f;
  Tensor x0 = ftensor({0, f.H});
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, x0, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("T = 0")));
}

TEST(Validation, WrongHiddenSizeOfX) {
  Fixture f;
  Tensor xb = ftensor({f.T, f.H + 1});
  std::string msg = error_of([&] { moe_forward(Context{}, f.cfg, xb, f.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("[5, 9]"), HasSubstr("[*, 8]")));
}

TEST(Validation, BadConfigSizes) {
  Fixture f;
  MoEConfig c = f.cfg;
  c.num_experts = 0;
  EXPECT_THAT(error_of([&] { validate_config(c); }), HasSubstr("num_experts"));
  c = f.cfg;
  c.hidden_size = -3;
  EXPECT_THAT(error_of([&] { validate_config(c); }), HasSubstr("hidden_size"));
  c = f.cfg;
  c.intermediate_size = 0;
  EXPECT_THAT(error_of([&] { validate_config(c); }), HasSubstr("intermediate_size"));
}

TEST(Validation, ParseActivation) {
  std::string msg = error_of([] { parse_activation("bogus"); });
  EXPECT_THAT(msg, AllOf(HasSubstr("bogus"), HasSubstr("swiglu")));
  EXPECT_EQ(parse_activation("swiglu"), Activation::swiglu);
  EXPECT_EQ(parse_activation("relu_sq"), Activation::relu_sq);
  EXPECT_EQ(parse_activation("GeGLU"), Activation::geglu);
  EXPECT_EQ(parse_activation("geglu_tanh"), Activation::geglu_tanh);
  EXPECT_EQ(parse_activation("gelu-tanh"), Activation::gelu_tanh);
  EXPECT_EQ(parse_activation("gelu_pytorch_tanh"), Activation::gelu_tanh);
  EXPECT_EQ(parse_activation("gelu_new"), Activation::gelu_tanh);
  EXPECT_TRUE(is_glu(Activation::geglu_tanh));
  EXPECT_FALSE(is_glu(Activation::gelu_tanh));
  EXPECT_THAT(error_of([] { parse_routing_mode("sideways"); }), HasSubstr("sideways"));
}

TEST(Validation, TokenRoundingBadTileAndMode) {
  Tensor l = ftensor({6, 4});
  EXPECT_THAT(error_of([&] { token_rounding(Context{}, l, 2, 0, RoutingMode::round_up); }), HasSubstr("tile"));
  EXPECT_THAT(error_of([&] { token_rounding(Context{}, l, 2, 4, RoutingMode::topk); }), HasSubstr("mode"));
}

TEST(Validation, BuildMetadataRanges) {
  IVec tok = {0, 1, 1, 2}, ex = {0, 3, 1, 2};
  Tensor tt = naive::to_itensor(tok, {4}), te = naive::to_itensor(ex, {4});
  EXPECT_THAT(error_of([&] { build_metadata(Context{}, tt, te, 2, 4); }),
              AllOf(HasSubstr("pair_token"), HasSubstr("[0, 2)")));
  EXPECT_THAT(error_of([&] { build_metadata(Context{}, tt, te, 3, 3); }),
              AllOf(HasSubstr("pair_expert"), HasSubstr("[0, 3)")));
}

TEST(Validation, BackwardWithMismatchedX) {
  Fixture f;
  ForwardResult r = moe_forward(Context{}, f.cfg, f.x, f.weights());
  Fixture g;
  Tensor x2 = ftensor({f.T + 2, f.H}), d2 = ftensor({f.T + 2, f.H});
  std::string msg = error_of([&] { moe_backward(Context{}, x2, f.weights(), r.saved, d2); });
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("7"), HasSubstr("5")));
}

}  // namespace

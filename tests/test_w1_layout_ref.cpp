// MoEConfig::w1_layout on the CPU reference: the layer with W1 / b1 stored concatenated ([gate; up] halves) equals
// the interleaved layer on the same weights permuted to the interleaved order (bitwise: the reference permutes on
// load and store and runs the same products), output and every gradient, dW1 / db1 coming back concatenated; plain
// activations ignore the field; the three stages that touch W1 one by one; the refusals (fp8_blockwise, a
// plain activation in up_projection, an odd z_width, a value that is not a W1Layout).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "naive_moe.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using naive::Vec;

// W1 [E, 2I, H] (or b1 [E, 2I] with H = 1) interleaved -> concatenated: row 2j + p goes to p * I + j.
Vec to_concat(const Vec& v, int E, int ZW, int H) {
  Vec out(v.size());
  const int I = ZW / 2;
  for (int e = 0; e < E; ++e)
    for (int n = 0; n < ZW; ++n)
      for (int h = 0; h < H; ++h)
        out[(static_cast<size_t>(e) * ZW + (n % 2) * I + n / 2) * H + h] = v[(static_cast<size_t>(e) * ZW + n) * H + h];
  return out;
}

struct LayerRun {
  Vec out, aux, dx, dw1, db1, dw2, db2, drouter, dscore;
};

// One forward + backward (top-K) with the given W1 / b1 values and layout.
LayerRun run(const MoEConfig& cfg, DType dt, const Vec& x, const Vec& router, const Vec& w1, const Vec& b1,
             const Vec& w2, const Vec& b2, const Vec& dO, int T) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  Context ctx;
  Tensor X = naive::to_tensor(x, {T, H}, dt), R = naive::to_tensor(router, {E, H}, dt),
         W1 = naive::to_tensor(w1, {E, ZW, H}, dt), W2 = naive::to_tensor(w2, {E, H, I}, dt),
         DO = naive::to_tensor(dO, {T, H}, dt);
  Tensor B1, B2;
  MoEWeights w;
  w.router = R;
  w.w1 = W1;
  w.w2 = W2;
  if (cfg.add_bias) {
    B1 = naive::to_tensor(b1, {E, ZW}, dt);
    B2 = naive::to_tensor(b2, {E, H}, dt);
    w.b1 = B1;
    w.b2 = B2;
  }
  ForwardResult f = moe_forward(ctx, cfg, X, w, {});
  Gradients g = moe_backward(ctx, X, w, f.saved, DO, 0.25f);
  LayerRun r;
  r.out = naive::from_tensor(f.output);
  r.aux = naive::from_tensor(f.aux_loss);
  r.dx = naive::from_tensor(g.dx);
  r.dw1 = naive::from_tensor(g.dw1);
  r.dw2 = naive::from_tensor(g.dw2);
  r.drouter = naive::from_tensor(g.drouter);
  r.dscore = naive::from_tensor(g.dscore);
  if (cfg.add_bias) {
    r.db1 = naive::from_tensor(g.db1);
    r.db2 = naive::from_tensor(g.db2);
  }
  return r;
}

using LayoutParam = std::tuple<Activation, bool, DType>;

class W1LayoutLayer : public testing::TestWithParam<LayoutParam> {};

TEST_P(W1LayoutLayer, ConcatenatedEqualsInterleavedOnPermutedWeights) {
  const auto [act, bias, dt] = GetParam();
  const int T = 41, H = 24, I = 20, E = 6, K = 2;
  MoEConfig cfg{E, K, H, I, act, bias};
  const int ZW = static_cast<int>(cfg.z_width());
  std::mt19937 rng(17 + static_cast<unsigned>(act) * 3u + (bias ? 1u : 0u));
  const Vec x = naive::stored(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), dt);
  const Vec router = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H, 0.5), dt);
  const Vec w1 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * ZW * H, 0.3), dt);
  const Vec b1 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * ZW, 0.3), dt);
  const Vec w2 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H * I, 0.3), dt);
  const Vec b2 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H, 0.3), dt);
  const Vec dO = naive::stored(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), dt);

  const LayerRun want = run(cfg, dt, x, router, w1, b1, w2, b2, dO, T);
  MoEConfig ccfg = cfg;
  ccfg.w1_layout = W1Layout::concatenated;
  // GLU: W1 / b1 handed over concatenated; plain activations: the same tensors (the field is ignored).
  const bool glu = is_glu(act);
  const Vec w1c = glu ? to_concat(w1, E, ZW, H) : w1, b1c = glu ? to_concat(b1, E, ZW, 1) : b1;
  const LayerRun got = run(ccfg, dt, x, router, w1c, b1c, w2, b2, dO, T);

  EXPECT_EQ(got.out, want.out) << "output";
  EXPECT_EQ(got.aux, want.aux) << "aux_loss";
  EXPECT_EQ(got.dx, want.dx) << "dx";
  EXPECT_EQ(got.dw1, glu ? to_concat(want.dw1, E, ZW, H) : want.dw1) << "dw1 (concatenated)";
  EXPECT_EQ(got.dw2, want.dw2) << "dw2";
  EXPECT_EQ(got.drouter, want.drouter) << "drouter";
  EXPECT_EQ(got.dscore, want.dscore) << "dscore";
  if (bias) {
    EXPECT_EQ(got.db1, glu ? to_concat(want.db1, E, ZW, 1) : want.db1) << "db1 (concatenated)";
    EXPECT_EQ(got.db2, want.db2) << "db2";
  }
  // Not vacuous: the concatenated W1 differs from the interleaved one for GLU.
  if (glu) EXPECT_NE(w1c, w1);
}

INSTANTIATE_TEST_SUITE_P(
    Activations, W1LayoutLayer,
    testing::Combine(testing::Values(Activation::swiglu, Activation::geglu, Activation::reglu,
                                     Activation::geglu_tanh, Activation::gelu, Activation::relu_sq),
                     testing::Bool(), testing::Values(DType::f32, DType::bf16)),
    [](const testing::TestParamInfo<LayoutParam>& i) {
      return std::string(activation_name(std::get<0>(i.param))) + (std::get<1>(i.param) ? "_bias" : "_nobias") +
             "_" + dtype_name(std::get<2>(i.param));
    });

// The stages one by one: concatenated W1 / b1 give the interleaved stage's Z, A and dXe, and dW1 / db1 permuted.
TEST(W1LayoutStages, EachW1StageMatchesInterleaved) {
  const int T = 19, H = 16, I = 12, E = 4, ZW = 2 * I;
  std::mt19937 rng(5);
  Context ctx;
  const Vec x = naive::randn(rng, static_cast<size_t>(T) * H, 1.0);
  const Vec w1 = naive::randn(rng, static_cast<size_t>(E) * ZW * H, 0.3);
  const Vec b1 = naive::randn(rng, static_cast<size_t>(E) * ZW, 0.3);
  std::vector<int> tok, ex;
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < 2; ++k) {
      tok.push_back(t);
      ex.push_back((t * 3 + k * 2) % E);
    }
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  RoutingMetadata m = build_metadata(ctx, naive::to_itensor(tok, {N}), naive::to_itensor(ex, {N}), T, E);
  Tensor X = naive::to_tensor(x, {T, H}), W1 = naive::to_tensor(w1, {E, ZW, H}), B1 = naive::to_tensor(b1, {E, ZW});
  Tensor W1c = naive::to_tensor(to_concat(w1, E, ZW, H), {E, ZW, H}), B1c = naive::to_tensor(to_concat(b1, E, ZW, 1), {E, ZW});

  Tensor z = Tensor::empty({N, ZW}, DType::f32), a = Tensor::empty({N, I}, DType::f32);
  Tensor zc = Tensor::empty({N, ZW}, DType::f32), ac = Tensor::empty({N, I}, DType::f32);
  up_projection(ctx, Activation::swiglu, X, W1, B1, m, z, a);
  up_projection(ctx, Activation::swiglu, X, W1c, B1c, m, zc, ac, W1Layout::concatenated);
  EXPECT_EQ(naive::from_tensor(zc), naive::from_tensor(z)) << "z (interleaved in both)";
  EXPECT_EQ(naive::from_tensor(ac), naive::from_tensor(a)) << "a";

  Tensor dxe = Tensor::empty({N, H}, DType::f32), dxec = Tensor::empty({N, H}, DType::f32);
  expert_input_grad(ctx, z, W1, m, dxe);  // Z as a stand-in dZ
  expert_input_grad(ctx, z, W1c, m, dxec, W1Layout::concatenated);
  EXPECT_EQ(naive::from_tensor(dxec), naive::from_tensor(dxe)) << "dxe";

  Tensor dw1 = Tensor::empty({E, ZW, H}, DType::f32), db1 = Tensor::empty({E, ZW}, DType::f32);
  Tensor dw1c = Tensor::empty({E, ZW, H}, DType::f32), db1c = Tensor::empty({E, ZW}, DType::f32);
  weight_grad_w1(ctx, z, X, m, dw1, db1);
  weight_grad_w1(ctx, z, X, m, dw1c, db1c, W1Layout::concatenated);
  EXPECT_EQ(naive::from_tensor(dw1c), to_concat(naive::from_tensor(dw1), E, ZW, H)) << "dw1";
  EXPECT_EQ(naive::from_tensor(db1c), to_concat(naive::from_tensor(db1), E, ZW, 1)) << "db1";

  // A plain activation has no gate/up halves: up_projection refuses concatenated.
  Tensor zp = Tensor::empty({N, I}, DType::f32), ap = Tensor::empty({N, I}, DType::f32);
  Tensor W1p = naive::to_tensor(Vec(static_cast<size_t>(E) * I * H, 0.1), {E, I, H});
  EXPECT_THROW(up_projection(ctx, Activation::gelu, X, W1p, TensorView(), m, zp, ap, W1Layout::concatenated), Error);
  // An odd z_width cannot be split in halves.
  Tensor dzo = Tensor::empty({N, 7}, DType::f32), dw1o = Tensor::empty({E, 7, H}, DType::f32);
  EXPECT_THROW(weight_grad_w1(ctx, dzo, X, m, dw1o, TensorView(), W1Layout::concatenated), Error);
  EXPECT_THROW(weight_grad_w1(ctx, dzo, X, m, dw1o, TensorView(), static_cast<W1Layout>(7)), Error);
}

TEST(W1LayoutConfig, ValidationAndNames) {
  MoEConfig c{8, 2, 128, 128, Activation::swiglu, false};
  c.w1_layout = W1Layout::concatenated;
  EXPECT_NO_THROW(validate_config(c));
  EXPECT_EQ(c.effective_w1_layout(), W1Layout::concatenated);
  c.activation = Activation::gelu;
  EXPECT_EQ(c.effective_w1_layout(), W1Layout::interleaved);  // plain: ignored
  c.activation = Activation::swiglu;
  c.precision = Precision::fp8_blockwise;
  try {
    validate_config(c);
    ADD_FAILURE() << "fp8_blockwise with a concatenated W1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w1_layout concatenated"), std::string::npos) << e.what();
  }
  c.precision = Precision::bf16;
  c.w1_layout = static_cast<W1Layout>(3);
  EXPECT_THROW(validate_config(c), Error);
  EXPECT_EQ(parse_w1_layout("concat"), W1Layout::concatenated);
  EXPECT_EQ(parse_w1_layout("concatenated"), W1Layout::concatenated);
  EXPECT_EQ(parse_w1_layout("interleaved"), W1Layout::interleaved);
  EXPECT_THROW(parse_w1_layout("separate"), Error);
  EXPECT_STREQ(w1_layout_name(W1Layout::concatenated), "concatenated");
}

}  // namespace

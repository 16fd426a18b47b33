// MoEConfig::w1_layout on the CPU reference: the layer with W1 / b1 stored concatenated ([gate; up] halves) or as
// separate gate / up tensors equals the interleaved layer on the same weights permuted to the interleaved order
// (bitwise: the reference permutes on load and store and runs the same products), output and every gradient, dW1 /
// db1 coming back in the layout; plain activations ignore the field; the three stages that touch W1 one by one; the
// refusals (fp8_blockwise, a plain activation in up_projection, an odd z_width, a value that is not a W1Layout, a
// separate pair whose addresses the descriptor cannot span).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "moe/w1_layout.h"
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

// W1 [E, 2I, H] (or b1 [E, 2I] with H = 1) interleaved -> separate [2, E, I, H]: row 2j + p of expert e goes to part
// p, row j.
Vec to_separate(const Vec& v, int E, int ZW, int H) {
  Vec out(v.size());
  const int I = ZW / 2;
  for (int e = 0; e < E; ++e)
    for (int n = 0; n < ZW; ++n)
      for (int h = 0; h < H; ++h)
        out[((static_cast<size_t>(n % 2) * E + e) * I + n / 2) * H + h] = v[(static_cast<size_t>(e) * ZW + n) * H + h];
  return out;
}

// A separate gate / up pair [E, I, ...] of the values v ([2, E, I, ...], to_separate) in one buffer, the up part
// `gap` elements after the gate's end (a part stride other than E * I * ...). Views into `buf`.
struct SeparatePair {
  Tensor buf;
  TensorView gate, up;
};
SeparatePair separate_pair(const Vec& v, std::vector<std::int64_t> part_shape, DType dt, std::int64_t gap) {
  const std::int64_t part = static_cast<std::int64_t>(v.size()) / 2;
  Vec padded(v.begin(), v.begin() + part);
  padded.resize(static_cast<size_t>(part + gap), 0.0);
  padded.insert(padded.end(), v.begin() + part, v.end());
  SeparatePair p;
  p.buf = naive::to_tensor(padded, {static_cast<std::int64_t>(padded.size())}, dt);
  char* base = static_cast<char*>(p.buf.data());
  p.gate = TensorView(base, dt, part_shape);
  p.up = TensorView(base + (part + gap) * static_cast<std::int64_t>(dtype_size(dt)), dt, part_shape);
  return p;
}

struct LayerRun {
  Vec out, aux, dx, dw1, db1, dw2, db2, drouter, dscore;
};

// One forward + backward (top-K) with the given W1 / b1 values and layout.
// Under W1Layout::separate (GLU) w1 / b1 are the [2, E, I, ...] values (to_separate), handed over as two tensors
// `gap` elements apart in one buffer.
LayerRun run(const MoEConfig& cfg, DType dt, const Vec& x, const Vec& router, const Vec& w1, const Vec& b1,
             const Vec& w2, const Vec& b2, const Vec& dO, int T, std::int64_t gap = 0) {
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
  SeparatePair w1s, b1s;
  if (cfg.effective_w1_layout() == W1Layout::separate) {
    w1s = separate_pair(w1, {E, I, H}, dt, gap);
    w.w1 = w1s.gate;
    w.w1_up = w1s.up;
    if (cfg.add_bias) {
      b1s = separate_pair(b1, {E, I}, dt, gap);
      w.b1 = b1s.gate;
      w.b1_up = b1s.up;
    }
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

// W1Layout::separate: gate and up as two tensors (here 8 elements = 16 or 32 bytes apart beyond the gate's end, so the
// part stride is not E * I * H) give the interleaved layer's values bitwise; dW1 / db1 come back as [2, E, I, ...].
class W1LayoutLayerSeparate : public testing::TestWithParam<LayoutParam> {};

TEST_P(W1LayoutLayerSeparate, SeparateEqualsInterleavedOnPermutedWeights) {
  const auto [act, bias, dt] = GetParam();
  const int T = 41, H = 24, I = 20, E = 6, K = 2;
  MoEConfig cfg{E, K, H, I, act, bias};
  const int ZW = static_cast<int>(cfg.z_width());
  std::mt19937 rng(23 + static_cast<unsigned>(act) * 3u + (bias ? 1u : 0u));
  const Vec x = naive::stored(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), dt);
  const Vec router = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H, 0.5), dt);
  const Vec w1 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * ZW * H, 0.3), dt);
  const Vec b1 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * ZW, 0.3), dt);
  const Vec w2 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H * I, 0.3), dt);
  const Vec b2 = naive::stored(naive::randn(rng, static_cast<size_t>(E) * H, 0.3), dt);
  const Vec dO = naive::stored(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), dt);

  const LayerRun want = run(cfg, dt, x, router, w1, b1, w2, b2, dO, T);
  MoEConfig scfg = cfg;
  scfg.w1_layout = W1Layout::separate;
  const bool glu = is_glu(act);
  const Vec w1s = glu ? to_separate(w1, E, ZW, H) : w1, b1s = glu ? to_separate(b1, E, ZW, 1) : b1;
  const LayerRun got = run(scfg, dt, x, router, w1s, b1s, w2, b2, dO, T, /*gap=*/8);

  EXPECT_EQ(got.out, want.out) << "output";
  EXPECT_EQ(got.aux, want.aux) << "aux_loss";
  EXPECT_EQ(got.dx, want.dx) << "dx";
  EXPECT_EQ(got.dw1, glu ? to_separate(want.dw1, E, ZW, H) : want.dw1) << "dw1 ([2, E, I, H])";
  EXPECT_EQ(got.dw2, want.dw2) << "dw2";
  EXPECT_EQ(got.drouter, want.drouter) << "drouter";
  EXPECT_EQ(got.dscore, want.dscore) << "dscore";
  if (bias) {
    EXPECT_EQ(got.db1, glu ? to_separate(want.db1, E, ZW, 1) : want.db1) << "db1 ([2, E, I])";
    EXPECT_EQ(got.db2, want.db2) << "db2";
  }
  if (glu) EXPECT_NE(w1s, w1);
}

INSTANTIATE_TEST_SUITE_P(
    Activations, W1LayoutLayerSeparate,
    testing::Combine(testing::Values(Activation::swiglu, Activation::geglu, Activation::reglu,
                                     Activation::geglu_tanh, Activation::gelu, Activation::relu_sq),
                     testing::Bool(), testing::Values(DType::f32, DType::bf16)),
    [](const testing::TestParamInfo<LayoutParam>& i) {
      return std::string(activation_name(std::get<0>(i.param))) + (std::get<1>(i.param) ? "_bias" : "_nobias") +
             "_" + dtype_name(std::get<2>(i.param));
    });

// The two-part backward (moe_backward_activations, then moe_backward_weights) takes the config's W1 layout in both
// parts: under concatenated and separate it gives moe_backward's gradients bitwise.
TEST(W1LayoutSeparate, TwoPartBackwardEqualsTheWholeOne) {
  const int T = 23, H = 16, I = 8, E = 4, K = 2;
  for (W1Layout layout : {W1Layout::concatenated, W1Layout::separate}) {
    SCOPED_TRACE(w1_layout_name(layout));
    MoEConfig cfg{E, K, H, I, Activation::swiglu, true};
    cfg.w1_layout = layout;
    std::mt19937 rng(11);
    Context ctx;
    Tensor X = naive::to_tensor(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), {T, H});
    Tensor R = naive::to_tensor(naive::randn(rng, static_cast<size_t>(E) * H, 0.5), {E, H});
    Tensor W1 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(2) * E * I * H, 0.3), {2, E, I, H});
    Tensor B1 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(2) * E * I, 0.3), {2, E, I});
    Tensor W2 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(E) * H * I, 0.3), {E, H, I});
    Tensor B2 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(E) * H, 0.3), {E, H});
    Tensor DO = naive::to_tensor(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), {T, H});
    MoEWeights w;
    w.router = R;
    w.w2 = W2;
    w.b2 = B2;
    if (layout == W1Layout::separate) {
      w.w1 = w1_part(W1, 0);
      w.w1_up = w1_part(W1, 1);
      w.b1 = w1_part(B1, 0);
      w.b1_up = w1_part(B1, 1);
    } else {  // the same memory read as [E, 2I, H] / [E, 2I]
      w.w1 = TensorView(W1.data(), DType::f32, {E, 2 * I, H});
      w.b1 = TensorView(B1.data(), DType::f32, {E, 2 * I});
    }
    ForwardResult f = moe_forward(ctx, cfg, X, w, {});
    Gradients whole = moe_backward(ctx, X, w, f.saved, DO, 0.25f);
    WeightGradOperands keep;
    Gradients part1 = moe_backward_activations(ctx, X, w, f.saved, DO, keep, 0.25f);
    ExpertWeightGradients part2 = moe_backward_weights(ctx, X, w, f.saved, DO, keep);
    EXPECT_EQ(naive::from_tensor(part1.dx), naive::from_tensor(whole.dx)) << "dx";
    EXPECT_EQ(naive::from_tensor(part2.dw1), naive::from_tensor(whole.dw1)) << "dw1";
    EXPECT_EQ(naive::from_tensor(part2.db1), naive::from_tensor(whole.db1)) << "db1";
    EXPECT_EQ(naive::from_tensor(part2.dw2), naive::from_tensor(whole.dw2)) << "dw2";
    EXPECT_EQ(part2.dw1.ndim(), layout == W1Layout::separate ? 4 : 3);
  }
}

// The address rule of the separate layout (w1_separate_addresses_ok): up above gate; on a cuda device by a multiple
// of 16 bytes below 2^40; the layer refuses other pairs naming both tensors, and refuses w1_up under another layout.
TEST(W1LayoutSeparate, AddressRuleAndRefusals) {
  alignas(16) static char buf[256];
  const Device cpu = Device::cpu(), gpu = Device::cuda();
  for (Device d : {cpu, gpu}) {
    EXPECT_TRUE(w1_separate_addresses_ok(buf, buf + 16, d));
    EXPECT_TRUE(w1_separate_addresses_ok(buf, buf + 160, d));
    EXPECT_FALSE(w1_separate_addresses_ok(buf + 16, buf, d));  // up below gate
    EXPECT_FALSE(w1_separate_addresses_ok(buf, buf, d));
  }
  EXPECT_FALSE(w1_separate_addresses_ok(buf, buf + 8, gpu));   // not a multiple of 16 bytes
  EXPECT_TRUE(w1_separate_addresses_ok(buf, buf + 8, cpu));
  EXPECT_FALSE(w1_separate_addresses_ok(reinterpret_cast<void*>(std::uintptr_t{16}),
                                        reinterpret_cast<void*>((std::uintptr_t{1} << 40) + 16), gpu));  // 2^40

  const int T = 9, H = 16, I = 8, E = 3, K = 2;
  MoEConfig cfg{E, K, H, I, Activation::swiglu, false};
  cfg.w1_layout = W1Layout::separate;
  std::mt19937 rng(3);
  Context ctx;
  Tensor X = naive::to_tensor(naive::randn(rng, static_cast<size_t>(T) * H, 1.0), {T, H});
  Tensor R = naive::to_tensor(naive::randn(rng, static_cast<size_t>(E) * H, 0.5), {E, H});
  Tensor W2 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(E) * H * I, 0.3), {E, H, I});
  Tensor buf2 = naive::to_tensor(naive::randn(rng, static_cast<size_t>(2) * E * I * H, 0.3), {2, E, I, H});
  char* base = static_cast<char*>(buf2.data());
  const std::int64_t part = static_cast<std::int64_t>(E) * I * H * 4;
  MoEWeights w;
  w.router = R;
  w.w2 = W2;
  w.w1 = TensorView(base + part, DType::f32, {E, I, H});  // up below gate: refused
  w.w1_up = TensorView(base, DType::f32, {E, I, H});
  try {
    (void)moe_forward(ctx, cfg, X, w, {});
    ADD_FAILURE() << "an up tensor below the gate was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'w1'"), std::string::npos) << m;
    EXPECT_NE(m.find("'w1_up'"), std::string::npos) << m;
    EXPECT_NE(m.find("must lie above"), std::string::npos) << m;
  }
  w.w1 = TensorView(base, DType::f32, {E, I, H});  // the two halves of one [2, E, I, H]: accepted
  w.w1_up = TensorView(base + part, DType::f32, {E, I, H});
  EXPECT_NO_THROW((void)moe_forward(ctx, cfg, X, w, {}));
  w.w1_up = TensorView();  // missing up half
  EXPECT_THROW((void)moe_forward(ctx, cfg, X, w, {}), Error);
  w.w1_up = TensorView(base + part, DType::f32, {E, I, H - 1});  // shapes differ
  EXPECT_THROW((void)moe_forward(ctx, cfg, X, w, {}), Error);
  MoEConfig icfg = cfg;  // w1_up under the interleaved layout: refused
  icfg.w1_layout = W1Layout::interleaved;
  w.w1 = TensorView(base, DType::f32, {E, 2 * I, H});
  w.w1_up = TensorView(base + part, DType::f32, {E, I, H});
  EXPECT_THROW((void)moe_forward(ctx, icfg, X, w, {}), Error);
}

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

  // Separate: the stages take [2, E, I, H] / [2, E, I] views (w1_separate_view) of two tensors.
  Tensor W1s = naive::to_tensor(to_separate(w1, E, ZW, H), {2, E, I, H});
  Tensor B1s = naive::to_tensor(to_separate(b1, E, ZW, 1), {2, E, I});
  const auto halves = [](const Tensor& t) {
    return w1_separate_view("test", "gate", w1_part(t, 0), "up", w1_part(t, 1));
  };
  Tensor zs = Tensor::empty({N, ZW}, DType::f32), as = Tensor::empty({N, I}, DType::f32);
  up_projection(ctx, Activation::swiglu, X, halves(W1s), halves(B1s), m, zs, as, W1Layout::separate);
  EXPECT_EQ(naive::from_tensor(zs), naive::from_tensor(z)) << "z (separate)";
  EXPECT_EQ(naive::from_tensor(as), naive::from_tensor(a)) << "a (separate)";
  Tensor dxes = Tensor::empty({N, H}, DType::f32);
  expert_input_grad(ctx, z, halves(W1s), m, dxes, W1Layout::separate);
  EXPECT_EQ(naive::from_tensor(dxes), naive::from_tensor(dxe)) << "dxe (separate)";
  Tensor dw1s = Tensor::empty({2, E, I, H}, DType::f32), db1s = Tensor::empty({2, E, I}, DType::f32);
  weight_grad_w1(ctx, z, X, m, halves(dw1s), halves(db1s), W1Layout::separate);
  EXPECT_EQ(naive::from_tensor(dw1s), to_separate(naive::from_tensor(dw1), E, ZW, H)) << "dw1 (separate)";
  EXPECT_EQ(naive::from_tensor(db1s), to_separate(naive::from_tensor(db1), E, ZW, 1)) << "db1 (separate)";
  // A contiguous [2, E, I, H] is such a view too; a [E, 2I, H] tensor is not.
  expert_input_grad(ctx, z, W1s, m, dxes, W1Layout::separate);
  EXPECT_EQ(naive::from_tensor(dxes), naive::from_tensor(dxe)) << "dxe (separate, one tensor)";
  EXPECT_THROW(expert_input_grad(ctx, z, W1, m, dxes, W1Layout::separate), Error);

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
  EXPECT_EQ(parse_w1_layout("separate"), W1Layout::separate);
  EXPECT_STREQ(w1_layout_name(W1Layout::separate), "separate");
  EXPECT_THROW(parse_w1_layout("split"), Error);
  c.w1_layout = W1Layout::separate;
  EXPECT_NO_THROW(validate_config(c));
  c.precision = Precision::fp8_blockwise;
  EXPECT_THROW(validate_config(c), Error);
  EXPECT_STREQ(w1_layout_name(W1Layout::concatenated), "concatenated");
}

}  // namespace

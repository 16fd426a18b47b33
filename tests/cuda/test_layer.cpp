// The whole layer on the GPU (Backend::cuda) against the CPU reference on the same bf16 inputs: output and
// every gradient, all activations, bias, every routing mode, awkward shapes; determinism; graph capture.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <tuple>

#include "cuda/gpu_test_util.h"
#include "cuda/layer_case.h"
#include "moe/w1_layout.h"
#include "routing_util.h"
#include "sonicmoe/error.h"
#include "sonicmoe/stages.h"
#include "w1_layout_util.h"

namespace sonicmoe {
namespace {

using testing::rel_err;

using Case = testing_util::LayerCase;
using Inputs = testing_util::LayerInputs;
using testing_util::layer_case_name;

Inputs make_inputs(const Case& c, const MoEConfig& cfg, unsigned seed, DType dt = DType::bf16) {
  std::mt19937 rng(seed);
  return testing_util::make_layer_inputs(c, cfg.z_width(), rng, dt);
}

// General routing: 0-3 distinct experts per token (some tokens routed nowhere), random positive scores,
// sorted by token; host tensors (token, expert, score).
struct Triples {
  Tensor token, expert, score;
  Triples to(Device d) const { return {token.to(d), expert.to(d), score.to(d)}; }
  RoutingSpec in(RoutingSpec spec) const {  // spec with these triples
    spec.token = token;
    spec.expert = expert;
    spec.score = score;
    return spec;
  }
};
Triples make_triples(std::int64_t T, std::int64_t E, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> tok, ex;
  std::vector<float> sc;
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    const int m = static_cast<int>(rng() % 4);
    std::vector<std::int32_t> es(E);
    for (std::int64_t e = 0; e < E; ++e) es[e] = static_cast<std::int32_t>(e);
    std::shuffle(es.begin(), es.end(), rng);
    es.resize(std::min<std::int64_t>(m, E));
    std::sort(es.begin(), es.end());
    for (std::int32_t e : es) {
      tok.push_back(static_cast<std::int32_t>(t));
      ex.push_back(e);
      sc.push_back(u(rng));
    }
  }
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  Tensor a = Tensor::empty({N}, DType::i32), b = Tensor::empty({N}, DType::i32), c = Tensor::empty({N}, DType::f32);
  std::copy(tok.begin(), tok.end(), a.ptr<std::int32_t>());
  std::copy(ex.begin(), ex.end(), b.ptr<std::int32_t>());
  std::copy(sc.begin(), sc.end(), c.ptr<float>());
  return {a, b, c};
}

// GPU (fg, gg) against CPU (fc, gc): output, aux loss and every gradient the layer has.
// Routing is computed from bf16 inputs with fp32 accumulation on both sides; the GEMM order differs, so
// a near-tie in the logits could flip a choice. The metadata must agree for the comparison to mean
// anything; random data makes such ties rare.
void expect_layer_close(const ForwardResult& fg, const Gradients& gg, const ForwardResult& fc, const Gradients& gc,
                        bool bias, bool router) {
  ASSERT_TRUE(testing::bitwise_equal(fg.saved.routing.meta.offsets, fc.saved.routing.meta.offsets))
      << "expert row counts differ between GPU and CPU routing";
  const double tol = 2e-2;
  EXPECT_LT(rel_err(fg.output, fc.output), tol) << "output";
  EXPECT_LT(rel_err(fg.aux_loss, fc.aux_loss), 1e-4) << "aux loss";
  EXPECT_LT(rel_err(gg.dx, gc.dx), tol) << "dx";
  EXPECT_LT(rel_err(gg.dw1, gc.dw1), tol) << "dw1";
  EXPECT_LT(rel_err(gg.dw2, gc.dw2), tol) << "dw2";
  EXPECT_LT(rel_err(gg.dscore, gc.dscore), tol) << "dscore";
  if (bias) {
    EXPECT_LT(rel_err(gg.db1, gc.db1), tol) << "db1";
    EXPECT_LT(rel_err(gg.db2, gc.db2), tol) << "db2";
  }
  if (router) EXPECT_LT(rel_err(gg.drouter, gc.drouter), tol) << "drouter";
}

class LayerVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(LayerVsReference, OutputAndGradients) {
  SONICMOE_REQUIRE_GPU();
  const Case c = GetParam();
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  RoutingSpec spec;
  spec.mode = c.mode;
  spec.tile = c.tile;
  Inputs host = make_inputs(c, cfg, 11);
  Inputs dev = host.to(Device::cuda());
  const Context gpu = testing_util::gpu_ctx();
  const Context cpu;
  RoutingSpec spec_g = spec;
  Triples tr, tr_g;  // general routing's triples, on the host and on the GPU
  if (c.mode == RoutingMode::general) {
    tr = make_triples(c.T, c.E, 5);
    tr_g = tr.to(Device::cuda());
    spec = tr.in(spec);
    spec_g = tr_g.in(spec_g);
  }

  ForwardResult fg = moe_forward(gpu, cfg, dev.x, dev.weights(), spec_g);
  Gradients gg = moe_backward(gpu, dev.x, dev.weights(), fg.saved, dev.d_out, 0.5f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ForwardResult fc = moe_forward(cpu, cfg, host.x, host.weights(), spec);
  Gradients gc = moe_backward(cpu, host.x, host.weights(), fc.saved, host.d_out, 0.5f);

  expect_layer_close(fg, gg, fc, gc, c.bias, c.mode != RoutingMode::general);
}

// The layer with a router variant (RouterSpec): Qwen3 (softmax over E, renormalised) at E = 60, and DeepSeek-V3
// (sigmoid + bias, 8 groups / 4 kept, scaled) at E = 64, K = 6.
TEST(LayerCuda, RouterVariantsVsReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(8);
  for (int v = 0; v < 2; ++v) {
    SCOPED_TRACE(v == 0 ? "qwen3" : "deepseek-v3");
    const Case c{300, 256, 128, v == 0 ? 60 : 64, v == 0 ? 4 : 6, Activation::swiglu, false, RoutingMode::topk, 128,
                 false};
    MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
    const Inputs host = make_inputs(c, cfg, 23);
    const Inputs dev = host.to(Device::cuda());
    const Tensor bias = testing::host_randn({c.E}, DType::f32, 0.05f, rng), bias_g = bias.to(Device::cuda());
    RoutingSpec spec, spec_g;
    spec.router = v == 0 ? testing_util::qwen3_router() : testing_util::deepseek_v3_router();
    spec_g = spec;
    if (v == 1) {
      spec.router.e_score_correction_bias = bias;
      spec_g.router.e_score_correction_bias = bias_g;
    }
    const Context gpu = testing_util::gpu_ctx();
    ForwardResult fg = moe_forward(gpu, cfg, dev.x, dev.weights(), spec_g);
    Gradients gg = moe_backward(gpu, dev.x, dev.weights(), fg.saved, dev.d_out, 0.5f);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ForwardResult fc = moe_forward(Context{}, cfg, host.x, host.weights(), spec);
    Gradients gc = moe_backward(Context{}, host.x, host.weights(), fc.saved, host.d_out, 0.5f);
    expect_layer_close(fg, gg, fc, gc, false, true);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayerVsReference,
    ::testing::Values(Case{300, 256, 128, 8, 2, Activation::swiglu, false, RoutingMode::topk, 128, false},
                      Case{1, 128, 64, 4, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{517, 256, 128, 60, 4, Activation::geglu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 1, Activation::reglu, false, RoutingMode::topk, 128, true},
                      Case{300, 128, 128, 8, 8, Activation::gelu, false, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 60, 4, Activation::geglu_tanh, true, RoutingMode::topk, 128, false},
                      Case{257, 128, 64, 8, 2, Activation::gelu_tanh, false, RoutingMode::topk, 128, true},
                      Case{300, 256, 64, 16, 4, Activation::relu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 4, Activation::silu, false, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 4, Activation::relu_sq, false, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::swiglu, false, RoutingMode::round_nearest, 64, false},
                      Case{1000, 256, 128, 16, 4, Activation::swiglu, true, RoutingMode::round_up, 64, false},
                      Case{1000, 256, 128, 16, 4, Activation::swiglu, false, RoutingMode::round_down, 64, true},
                      // Every expert rounds down to zero tokens: N = 0, output zero, gradients zero.
                      Case{40, 128, 64, 16, 2, Activation::swiglu, true, RoutingMode::round_down, 128, false},
                      Case{300, 256, 128, 12, 1, Activation::swiglu, false, RoutingMode::general, 128, false},
                      Case{257, 128, 64, 5, 1, Activation::gelu, true, RoutingMode::general, 128, false}),
    layer_case_name);

// f16 storage: the same kernels instantiated for f16 operands (wgmma F32F16F16), the layer against the CPU reference
// on the same f16 inputs (f16 rounding: 8x finer than bf16's); glu and plain activations, bias, every routing mode
// but general's own suite above, the dgated kernel's both layouts (I = 64: short K, the wide one), the swapped dW1
// (>= 1024 rows an expert), and W1 stored concatenated (bitwise against interleaved, as for bf16).
class LayerF16VsReference : public ::testing::TestWithParam<Case> {};

TEST_P(LayerF16VsReference, OutputAndGradients) {
  SONICMOE_REQUIRE_GPU();
  const Case c = GetParam();
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  RoutingSpec spec;
  spec.mode = c.mode;
  spec.tile = c.tile;
  Inputs host = make_inputs(c, cfg, 17, DType::f16);
  Inputs dev = host.to(Device::cuda());
  ASSERT_EQ(dev.x.dtype(), DType::f16);
  const Context gpu = testing_util::gpu_ctx();
  RoutingSpec spec_g = spec;
  Triples tr, tr_g;
  if (c.mode == RoutingMode::general) {
    tr = make_triples(c.T, c.E, 7);
    tr_g = tr.to(Device::cuda());
    spec = tr.in(spec);
    spec_g = tr_g.in(spec_g);
  }
  ForwardResult fg = moe_forward(gpu, cfg, dev.x, dev.weights(), spec_g);
  Gradients gg = moe_backward(gpu, dev.x, dev.weights(), fg.saved, dev.d_out, 0.5f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(fg.output.dtype(), DType::f16);
  EXPECT_EQ(gg.dw1.dtype(), DType::f16);
  ForwardResult fc = moe_forward(Context{}, cfg, host.x, host.weights(), spec);
  Gradients gc = moe_backward(Context{}, host.x, host.weights(), fc.saved, host.d_out, 0.5f);
  expect_layer_close(fg, gg, fc, gc, c.bias, c.mode != RoutingMode::general);
  if (is_glu(c.act)) {  // W1 / b1 concatenated: bitwise the interleaved f16 layer
    MoEConfig ccfg = cfg;
    ccfg.w1_layout = W1Layout::concatenated;
    Inputs cdev = dev;
    cdev.w1 = testing_util::w1_rows_to_concat(host.w1).to(Device::cuda());
    if (c.bias) cdev.b1 = testing_util::w1_rows_to_concat(host.b1).to(Device::cuda());
    RoutingSpec cspec = spec_g;
    ForwardResult fcc = moe_forward(gpu, ccfg, cdev.x, cdev.weights(), cspec);
    Gradients gcc = moe_backward(gpu, cdev.x, cdev.weights(), fcc.saved, cdev.d_out, 0.5f);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(fcc.output, fg.output)) << "concat output";
    EXPECT_TRUE(testing::bitwise_equal(gcc.dx, gg.dx)) << "concat dx";
    EXPECT_TRUE(testing::bitwise_equal(gcc.dw2, gg.dw2)) << "concat dw2";
    EXPECT_TRUE(testing::bitwise_equal(testing_util::w1_rows_to_concat(gg.dw1), gcc.dw1)) << "concat dw1";
  }
}

INSTANTIATE_TEST_SUITE_P(
    F16, LayerF16VsReference,
    ::testing::Values(Case{300, 256, 128, 8, 2, Activation::swiglu, false, RoutingMode::topk, 128, false},
                      Case{517, 256, 128, 60, 4, Activation::geglu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 64, 16, 4, Activation::relu, true, RoutingMode::topk, 128, false},
                      Case{257, 128, 64, 8, 2, Activation::gelu_tanh, false, RoutingMode::topk, 128, true},
                      Case{300, 256, 128, 16, 4, Activation::silu, false, RoutingMode::topk, 128, false},
                      Case{2048, 256, 128, 4, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::reglu, false, RoutingMode::round_nearest, 64, false},
                      Case{300, 256, 128, 12, 1, Activation::swiglu, false, RoutingMode::general, 128, false}),
    layer_case_name);

// MoEConfig::w1_layout concatenated: the layer on W1 / b1 stored [gate; up] gives bitwise the interleaved layer's
// output and gradients on the same weights interleaved (the kernels read the concatenated W1 through the 4-mode TMA
// descriptor into the same shared-memory tiles; dW1 / db1 are the same values written concatenated). Cases: partial
// tiles (2I = 400 is no multiple of 128 or 256; H = 264 of 64), bias, an empty expert (skew), token rounding, the
// swapped dW1 kernel (>= 1024 rows an expert: heuristics.h), and a plain activation (the layout is ignored).
class LayerW1Concat : public ::testing::TestWithParam<Case> {};

TEST_P(LayerW1Concat, BitwiseEqualsInterleaved) {
  SONICMOE_REQUIRE_GPU();
  const Case c = GetParam();
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  MoEConfig ccfg = cfg;
  ccfg.w1_layout = W1Layout::concatenated;
  RoutingSpec spec;
  spec.mode = c.mode;
  spec.tile = c.tile;
  const Inputs host = make_inputs(c, cfg, 29);
  const Inputs dev = host.to(Device::cuda());
  const bool glu = is_glu(c.act);
  Inputs cdev = dev;  // W1 / b1 stored concatenated (plain activations: the same tensors)
  if (glu) {
    cdev.w1 = testing_util::w1_rows_to_concat(host.w1).to(Device::cuda());
    if (c.bias) cdev.b1 = testing_util::w1_rows_to_concat(host.b1).to(Device::cuda());
  }
  const Context gpu = testing_util::gpu_ctx();
  ForwardResult fi = moe_forward(gpu, cfg, dev.x, dev.weights(), spec);
  Gradients gi = moe_backward(gpu, dev.x, dev.weights(), fi.saved, dev.d_out, 0.5f);
  ForwardResult fc = moe_forward(gpu, ccfg, cdev.x, cdev.weights(), spec);
  Gradients gc = moe_backward(gpu, cdev.x, cdev.weights(), fc.saved, cdev.d_out, 0.5f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(fc.output, fi.output)) << "output";
  EXPECT_TRUE(testing::bitwise_equal(fc.saved.z, fi.saved.z)) << "saved Z (interleaved in both)";
  EXPECT_TRUE(testing::bitwise_equal(gc.dx, gi.dx)) << "dx";
  EXPECT_TRUE(testing::bitwise_equal(gc.dw1, glu ? testing_util::w1_rows_to_concat(gi.dw1) : gi.dw1))
      << "dw1 (concatenated)";
  EXPECT_TRUE(testing::bitwise_equal(gc.dw2, gi.dw2)) << "dw2";
  EXPECT_TRUE(testing::bitwise_equal(gc.dscore, gi.dscore)) << "dscore";
  EXPECT_TRUE(testing::bitwise_equal(gc.drouter, gi.drouter)) << "drouter";
  if (c.bias) {
    EXPECT_TRUE(testing::bitwise_equal(gc.db1, glu ? testing_util::w1_rows_to_concat(gi.db1) : gi.db1))
        << "db1 (concatenated)";
    EXPECT_TRUE(testing::bitwise_equal(gc.db2, gi.db2)) << "db2";
  }
  // And close to the CPU reference with the same layout (its own permutation, src/reference/expert_ref.cpp).
  const Inputs chost = cdev.to(Device::cpu());
  ForwardResult fr = moe_forward(Context{}, ccfg, chost.x, chost.weights(), spec);
  Gradients gr = moe_backward(Context{}, chost.x, chost.weights(), fr.saved, chost.d_out, 0.5f);
  expect_layer_close(fc, gc, fr, gr, c.bias, true);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayerW1Concat,
    ::testing::Values(Case{300, 256, 128, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{517, 264, 200, 12, 4, Activation::geglu, true, RoutingMode::topk, 128, true},
                      Case{300, 136, 72, 6, 2, Activation::reglu, false, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::geglu_tanh, true, RoutingMode::round_up, 64, false},
                      // 4096 * 2 / 8 = 1024 rows an expert: the swapped (D^T) dW1 kernel, n = 2I = 400 partial
                      Case{4096, 264, 200, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 8, 2, Activation::gelu, true, RoutingMode::topk, 128, false}),
    layer_case_name);

// MoEConfig::w1_layout separate: the layer on gate / up tensors (MoEWeights::w1 / w1_up, b1 / b1_up: the two halves of
// one [2, E, I, H] allocation, read through the same 4-mode descriptor with part stride E * I * H) gives bitwise the
// interleaved layer's output and gradients; dW1 / db1 come back [2, E, I, H] / [2, E, I]. The cases of LayerW1Concat.
class LayerW1Separate : public ::testing::TestWithParam<Case> {};

TEST_P(LayerW1Separate, BitwiseEqualsInterleaved) {
  SONICMOE_REQUIRE_GPU();
  const Case c = GetParam();
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  MoEConfig scfg = cfg;
  scfg.w1_layout = W1Layout::separate;
  RoutingSpec spec;
  spec.mode = c.mode;
  spec.tile = c.tile;
  const Inputs host = make_inputs(c, cfg, 31);
  const Inputs dev = host.to(Device::cuda());
  const bool glu = is_glu(c.act);
  const Tensor w1s = glu ? testing_util::w1_rows_to_separate(host.w1).to(Device::cuda()) : Tensor();
  const Tensor b1s = glu && c.bias ? testing_util::w1_rows_to_separate(host.b1).to(Device::cuda()) : Tensor();
  MoEWeights ws = dev.weights();  // plain activations: the same tensors (the field is ignored)
  if (glu) {
    ws.w1 = w1_part(w1s, 0);
    ws.w1_up = w1_part(w1s, 1);
    if (c.bias) {
      ws.b1 = w1_part(b1s, 0);
      ws.b1_up = w1_part(b1s, 1);
    }
  }
  const Context gpu = testing_util::gpu_ctx();
  ForwardResult fi = moe_forward(gpu, cfg, dev.x, dev.weights(), spec);
  Gradients gi = moe_backward(gpu, dev.x, dev.weights(), fi.saved, dev.d_out, 0.5f);
  ForwardResult fs = moe_forward(gpu, scfg, dev.x, ws, spec);
  Gradients gs = moe_backward(gpu, dev.x, ws, fs.saved, dev.d_out, 0.5f);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(fs.output, fi.output)) << "output";
  EXPECT_TRUE(testing::bitwise_equal(fs.saved.z, fi.saved.z)) << "saved Z (interleaved in both)";
  EXPECT_TRUE(testing::bitwise_equal(gs.dx, gi.dx)) << "dx";
  EXPECT_TRUE(testing::bitwise_equal(gs.dw1, glu ? testing_util::w1_rows_to_separate(gi.dw1) : gi.dw1))
      << "dw1 ([2, E, I, H])";
  EXPECT_TRUE(testing::bitwise_equal(gs.dw2, gi.dw2)) << "dw2";
  EXPECT_TRUE(testing::bitwise_equal(gs.dscore, gi.dscore)) << "dscore";
  EXPECT_TRUE(testing::bitwise_equal(gs.drouter, gi.drouter)) << "drouter";
  if (c.bias) {
    EXPECT_TRUE(testing::bitwise_equal(gs.db1, glu ? testing_util::w1_rows_to_separate(gi.db1) : gi.db1))
        << "db1 ([2, E, I])";
    EXPECT_TRUE(testing::bitwise_equal(gs.db2, gi.db2)) << "db2";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LayerW1Separate,
    ::testing::Values(Case{300, 256, 128, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{517, 264, 200, 12, 4, Activation::geglu, true, RoutingMode::topk, 128, true},
                      Case{300, 136, 72, 6, 2, Activation::reglu, false, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::geglu_tanh, true, RoutingMode::round_up, 64, false},
                      // 1024 rows an expert: the swapped (D^T) dW1 kernel writing the two parts
                      Case{4096, 264, 200, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 8, 2, Activation::gelu, true, RoutingMode::topk, 128, false}),
    layer_case_name);

// Two independent GPU allocations as gate and up: accepted when up lies above gate by a multiple of 16 bytes (bitwise
// the halves-of-one-tensor run), refused with an Error naming both tensors when up lies below gate (the binding then
// copies them into one [2, E, I, H]: python/sonicmoe_cpp/w1_separate.py).
TEST(LayerW1SeparateAddresses, IndependentAllocations) {
  SONICMOE_REQUIRE_GPU();
  const Case c{300, 256, 128, 8, 2, Activation::swiglu, false, RoutingMode::topk, 128, false};
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  cfg.w1_layout = W1Layout::separate;
  const Inputs host = make_inputs(c, cfg, 37);
  const Inputs dev = host.to(Device::cuda());
  const Tensor w1s = testing_util::w1_rows_to_separate(host.w1);
  Tensor a = Tensor::empty({c.E, c.I, c.H}, w1s.dtype(), Device::cuda());  // two allocations
  Tensor b = Tensor::empty({c.E, c.I, c.H}, w1s.dtype(), Device::cuda());
  const Context gpu = testing_util::gpu_ctx();
  MoEWeights w = dev.weights();
  // Whichever of the two allocations lies lower holds the gate; the other the up values.
  const bool a_low = a.data() < b.data();
  Tensor gate = a_low ? a : b, up = a_low ? b : a;
  copy(gate, w1_part(w1s, 0));
  copy(up, w1_part(w1s, 1));
  w.w1 = gate;
  w.w1_up = up;
  if (w1_separate_addresses_ok(gate.data(), up.data(), Device::cuda())) {
    ForwardResult f = moe_forward(gpu, cfg, dev.x, w, {});
    MoEWeights wh = w;  // the same values as halves of one tensor
    const Tensor w1d = w1s.to(Device::cuda());
    wh.w1 = w1_part(w1d, 0);
    wh.w1_up = w1_part(w1d, 1);
    ForwardResult fh = moe_forward(gpu, cfg, dev.x, wh, {});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(f.output, fh.output)) << "output";
  }
  // Swapped roles: up below gate, refused.
  copy(up, w1_part(w1s, 0));
  copy(gate, w1_part(w1s, 1));
  w.w1 = up;
  w.w1_up = gate;
  try {
    (void)moe_forward(gpu, cfg, dev.x, w, {});
    ADD_FAILURE() << "an up tensor below the gate was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'w1_up'"), std::string::npos) << m;
    EXPECT_NE(m.find("must lie above"), std::string::npos) << m;
  }
}

// Two runs on the same inputs: bitwise-equal outputs and gradients.
TEST(LayerCuda, Deterministic) {
  SONICMOE_REQUIRE_GPU();
  Case c{700, 256, 128, 12, 4, Activation::swiglu, true, RoutingMode::topk, 128, false};
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  Inputs dev = make_inputs(c, cfg, 5).to(Device::cuda());
  const Context gpu = testing_util::gpu_ctx();
  auto run = [&] {
    ForwardResult f = moe_forward(gpu, cfg, dev.x, dev.weights());
    Gradients g = moe_backward(gpu, dev.x, dev.weights(), f.saved, dev.d_out, 1.0f);
    return std::make_tuple(f.output, g.dx, g.dw1, g.dw2, g.db1, g.db2, g.drouter, g.dscore);
  };
  auto a = run();
  auto b = run();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(std::get<0>(a), std::get<0>(b))) << "output";
  EXPECT_TRUE(testing::bitwise_equal(std::get<1>(a), std::get<1>(b))) << "dx";
  EXPECT_TRUE(testing::bitwise_equal(std::get<2>(a), std::get<2>(b))) << "dw1";
  EXPECT_TRUE(testing::bitwise_equal(std::get<3>(a), std::get<3>(b))) << "dw2";
  EXPECT_TRUE(testing::bitwise_equal(std::get<4>(a), std::get<4>(b))) << "db1";
  EXPECT_TRUE(testing::bitwise_equal(std::get<5>(a), std::get<5>(b))) << "db2";
  EXPECT_TRUE(testing::bitwise_equal(std::get<6>(a), std::get<6>(b))) << "drouter";
  EXPECT_TRUE(testing::bitwise_equal(std::get<7>(a), std::get<7>(b))) << "dscore";
}

// A whole forward + backward captured in a CUDA graph and replayed gives the eager results.
TEST(LayerCuda, GraphCapture) {
  SONICMOE_REQUIRE_GPU();
  Case c{640, 256, 128, 8, 2, Activation::swiglu, false, RoutingMode::topk, 128, false};
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  Inputs dev = make_inputs(c, cfg, 9).to(Device::cuda());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Context gpu = testing_util::gpu_ctx(stream);
  // Every tensor below is freed on `stream` (stream-ordered allocator): they must die before the stream,
  // hence the scope.
  {
    ForwardResult eager_f = moe_forward(gpu, cfg, dev.x, dev.weights());
    Gradients eager_g = moe_backward(gpu, dev.x, dev.weights(), eager_f.saved, dev.d_out);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    cudaGraph_t graph;
    ForwardResult f;
    Gradients g;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    try {
      f = moe_forward(gpu, cfg, dev.x, dev.weights());
      g = moe_backward(gpu, dev.x, dev.weights(), f.saved, dev.d_out);
    } catch (const std::exception& e) {
      cudaStreamEndCapture(stream, &graph);
      FAIL() << "capture failed: " << e.what();
    }
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(f.output, eager_f.output));
    EXPECT_TRUE(testing::bitwise_equal(g.dx, eager_g.dx));
    EXPECT_TRUE(testing::bitwise_equal(g.dw1, eager_g.dw1));
    EXPECT_TRUE(testing::bitwise_equal(g.drouter, eager_g.drouter));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace sonicmoe

// The FP8 blockwise layer on the GPU (MoEConfig::precision = fp8_blockwise, Backend::cuda; DESIGN.md section 9):
//  - against the CPU reference FP8 layer on the same bf16 inputs (X, dO and the weights quantise to the same bits on
//    both sides): output, saved Z, dx and every gradient, within kVsReference (its reason below);
//  - the precision gate of issue 27 against the bf16 CUDA layer (cosine >= 0.997, relative RMS < 7.6% for out, dx,
//    ds, dW1, dW2; numbers printed; where the recipe misses the gate the CPU suite's measured bound is held instead);
//  - every activation, bias, top-K / general routing / token rounding, awkward sizes (T not a multiple of 128, empty
//    experts, K = 1, E = 60, H = 384, I = 384, N = 0); bitwise repeats; forward+backward in a CUDA graph;
//    pre-quantised weights; the backward reading the forward's saved quantised weights (bitwise the per-call and the
//    pre-quantised paths); the memory estimate against the measured peak, the saved state's size; the refusals;
//  - the FP8 dequantiser and scale-transpose kernels bitwise against the CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <tuple>
#include <random>
#include <string>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "cuda/layer_case.h"
#include "cuda/quant/dequant.h"
#include "counting_allocator.h"
#include "error_of.h"
#include "fp8_gate.h"
#include "moe/limits.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/quant.h"
#include "sonicmoe/stages.h"

namespace sonicmoe {
namespace {

using testing::rel_err;
using testing_util::CountingAllocator;
using testing_util::error_of;

// GPU FP8 layer vs CPU FP8 reference layer, relative error ||gpu - cpu|| / ||cpu|| of every output. Both quantise X,
// dO, W1 and W2 to identical codes and scales (the quantisers agree bitwise); they differ in (1) fp32 accumulation
// order (~1e-6), (2) bf16 storage of the GEMM outputs before A, Z and dZ are quantised 1x128 on the GPU where the
// reference quantises the fp32 epilogue values: the bf16 rounding (relative 2^-9) moves about 2^-9 / 2^-4 = 1/32 of
// the e4m3 codes (relative step 2^-3) by one step, i.e. ~1% RMS on each of these operands, and (3) the dscore bias
// term reading the unquantised dO. The forward chains two such operands (A; Z for the backward) and the backward two
// more (Z, dZ): a few percent at most; the bf16 CUDA layer is held to 2e-2 against the CPU reference, the FP8
// layer's operands are ~16x coarser. Measured numbers are printed.
constexpr double kVsReference = 4e-2;

using Case = testing_util::LayerCase;
using testing_util::gpu_ctx;
using testing_util::layer_case_name;

MoEConfig config_of(const Case& c, Precision p) {
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  cfg.precision = p;
  return cfg;
}

struct Inputs : testing_util::LayerInputs {
  Tensor tok, ex, sc;  // general routing's triples
  MoEWeights weights(bool with_router = true) const {
    return {with_router ? router_view() : TensorView(), w1, b1, w2, b2};
  }
  TensorView router_view() const { return router; }
  RoutingSpec spec(const Case& c) const {
    RoutingSpec s;
    s.mode = c.mode;
    s.tile = c.tile;
    if (c.mode == RoutingMode::general) s.token = tok, s.expert = ex, s.score = sc;
    return s;
  }
  Inputs to(Device d) const {
    auto mv = [&](const Tensor& t) { return t.defined() ? t.to(d) : Tensor(); };
    return {LayerInputs::to(d), mv(tok), mv(ex), mv(sc)};
  }
};

// N(0, 1) X and dO, weights N(0, 1/fan_in) (the CPU suite's problems); general routing: 0-3 distinct experts a token.
Inputs make_inputs(const Case& c, unsigned seed) {
  std::mt19937 rng(seed);
  Inputs in{testing_util::make_layer_inputs(c, config_of(c, Precision::bf16).z_width(), rng)};
  std::vector<std::int32_t> tok, ex;
  std::vector<float> sc;
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int64_t t = 0; t < c.T; ++t) {
    const std::int64_t m = std::min<std::int64_t>(rng() % 4, c.E);
    const std::int64_t first = rng() % c.E;
    for (std::int64_t j = 0; j < m; ++j) {  // m distinct experts, increasing ids
      tok.push_back(static_cast<std::int32_t>(t));
      ex.push_back(static_cast<std::int32_t>((first + j * (c.E / std::max<std::int64_t>(m, 1))) % c.E));
      sc.push_back(u(rng));
    }
    std::sort(ex.end() - m, ex.end());
  }
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  in.tok = Tensor::empty({N}, DType::i32);
  in.ex = Tensor::empty({N}, DType::i32);
  in.sc = Tensor::empty({N}, DType::f32);
  std::copy(tok.begin(), tok.end(), in.tok.ptr<std::int32_t>());
  std::copy(ex.begin(), ex.end(), in.ex.ptr<std::int32_t>());
  std::copy(sc.begin(), sc.end(), in.sc.ptr<float>());
  return in;
}

struct LayerRun {
  ForwardResult f;
  Gradients g;
};

LayerRun run(const Context& ctx, const MoEConfig& cfg, const Inputs& in, const Case& c) {
  const bool router = c.mode != RoutingMode::general;
  LayerRun r{moe_forward(ctx, cfg, in.x, in.weights(router), in.spec(c)), {}};
  r.g = moe_backward(ctx, in.x, in.weights(router), r.f.saved, in.d_out, AuxLossGrad(0.25f));
  return r;
}

using Metric = testing_util::GateMetric;
Metric compare(const Tensor& got_any, const Tensor& want_any) {
  const Tensor a = got_any.to(Device::cpu()), b = want_any.to(Device::cpu());
  EXPECT_EQ(a.numel(), b.numel());
  double ab = 0, aa = 0, bb = 0, dd = 0;
  for (std::int64_t i = 0; i < b.numel() && i < a.numel(); ++i) {
    const double x = testing::value(a, i), y = testing::value(b, i);
    ab += x * y, aa += x * x, bb += y * y, dd += (x - y) * (x - y);
  }
  return {ab / std::sqrt(aa * bb), std::sqrt(dd / bb)};
}

// What each line of the gate holds. out, dW1, dW2: the gate of issue 27 itself (the CPU reference measures at most
// 6.8% on these problems: docs/ALGORITHM.md). dx, ds and the step activations: the level the CPU suite measures and
// holds (tests/test_fp8_layer.cpp, bound_for: dx up to 7.5%, ds up to 9.2%, relu / reglu dx and dW1 up to 16.8%),
// plus the GPU's own rounding points (about 1% RMS more, in quadrature: docs/ALGORITHM.md, "The FP8 layer on the
// GPU"), so that a miss of the strict gate is printed ("MISSED") rather than failed there.
using Bound = testing_util::GateBound;
Bound bound_for(const std::string& metric, Activation act) {
  const bool step = act == Activation::relu || act == Activation::reglu;
  if (step && (metric == "dx" || metric == "dW1"))
    return {0.983, 0.19, "relu' is a step: the FP8 forward's Z error moves entries across 0, flipping dZ there"};
  if (metric == "ds") return {0.994, 0.11, "ds = <G, act(Z)> reads Z saved in FP8 (one more rounding of Z)"};
  if (metric == "dx")
    return {0.996, 0.082, "dx: the CPU reference measures up to 7.5%, the GPU rounds A, Z and dZ once more"};
  return testing_util::kGate;
}

// One line of the gate: the FP8 GPU run against the bf16 GPU run (same routing), printed and checked. ds over the
// valid pairs (under token rounding the GPU's pair arrays have a capacity beyond them).
constexpr std::int64_t kMinGatePairs = 256;
void gate(const std::string& name, const LayerRun& fp8, const LayerRun& bf, Activation act, std::int64_t valid) {
  ASSERT_TRUE(testing::bitwise_equal(fp8.f.saved.routing.meta.offsets, bf.f.saved.routing.meta.offsets))
      << name << ": the runs routed differently";
  const Tensor ds8 = fp8.g.dscore.to(Device::cpu()).carve(0, {valid}, DType::f32);
  const Tensor dsb = bf.g.dscore.to(Device::cpu()).carve(0, {valid}, DType::f32);
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> items[] = {
      {"out", {&fp8.f.output, &bf.f.output}}, {"dx", {&fp8.g.dx, &bf.g.dx}}, {"ds", {&ds8, &dsb}},
      {"dW1", {&fp8.g.dw1, &bf.g.dw1}},       {"dW2", {&fp8.g.dw2, &bf.g.dw2}}};
  std::string line = "[fp8 gpu gate] " + name + ":", missed;
  // The gate is a statistic of the quantisation error: below kMinGatePairs pairs (T = 1: two ds values) it
  // measures a handful of samples, so such cases are held to the CPU reference only (VsCpuReference above).
  const bool hold = valid >= kMinGatePairs;
  for (const auto& [what, t] : items)
    testing_util::gate_item(name, what, compare(*t.first, *t.second), bound_for(what, act), hold, line, missed);
  std::printf("%s%s%s\n", line.c_str(), missed.empty() ? "" : ("  MISSED:" + missed).c_str(),
              valid < kMinGatePairs ? "  (too few pairs for the gate: not held)" : "");
}

class Fp8LayerCuda : public ::testing::TestWithParam<Case> {};

// One case with the dgated GEMM's operands in `dgated` (MoEConfig::dgated_precision), the CPU reference likewise.
void vs_reference_and_gate(const Case& c, Precision dgated) {
  MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  cfg.dgated_precision = dgated;
  const std::string tag = layer_case_name({c, 0}) + " dgated=" + precision_name(dgated);
  const Inputs host = make_inputs(c, 17);
  const Inputs dev = host.to(Device::cuda());
  const LayerRun g = run(gpu_ctx(), cfg, dev, c);
  const LayerRun b = run(gpu_ctx(), config_of(c, Precision::bf16), dev, c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const LayerRun r = run(Context{}, cfg, host, c);
  ASSERT_TRUE(testing::bitwise_equal(g.f.saved.routing.meta.offsets, r.f.saved.routing.meta.offsets))
      << "expert row counts differ between GPU and CPU routing";
  EXPECT_FALSE(g.f.saved.z.defined());
  ASSERT_TRUE(g.f.saved.z_fp8.defined() && g.f.saved.z_scale.defined());
  EXPECT_EQ(g.f.saved.z_fp8.dtype(), DType::f8e4m3);
  const std::int64_t N = r.f.saved.routing.meta.num_pairs;
  const Tensor off = r.f.saved.routing.meta.offsets;
  const std::int64_t valid = off.ptr<const std::int32_t>()[c.E];
  if (valid == 0) {  // nothing routed: zero output and expert gradients, no NaN
    EXPECT_EQ(rel_err(g.f.output, r.f.output), 0.0);
    EXPECT_EQ(rel_err(g.g.dw1, r.g.dw1), 0.0);
    EXPECT_EQ(rel_err(g.g.dw2, r.g.dw2), 0.0);
    return;
  }
  // The saved Z (valid rows; under token rounding the GPU's N is a capacity), dequantised on the CPU.
  auto z_of = [&](const LayerRun& x) {
    const Tensor q = x.f.saved.z_fp8.to(Device::cpu()), s = x.f.saved.z_scale.to(Device::cpu());
    const std::int64_t ZW = cfg.z_width();
    return ref::fp8_dequantize(q.carve(0, {valid, ZW}, DType::f8e4m3),
                               s.carve(0, {valid, ZW / 128}, DType::f32), 1, 128);
  };
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> items[] = {
      {"out", {&g.f.output, &r.f.output}}, {"dx", {&g.g.dx, &r.g.dx}},     {"ds", {&g.g.dscore, &r.g.dscore}},
      {"dW1", {&g.g.dw1, &r.g.dw1}},       {"dW2", {&g.g.dw2, &r.g.dw2}},  {"db1", {&g.g.db1, &r.g.db1}},
      {"db2", {&g.g.db2, &r.g.db2}},       {"drouter", {&g.g.drouter, &r.g.drouter}}};
  std::string line = "[fp8 gpu vs cpu] " + tag + ":";
  for (const auto& [what, t] : items) {
    if (!t.second->defined()) continue;
    double e = 0;
    if (std::string(what) == "ds" && N != valid) {  // token rounding: only the valid pairs' scores
      const Tensor a = t.first->to(Device::cpu());
      e = rel_err(a.carve(0, {valid}, DType::f32), t.second->carve(0, {valid}, DType::f32));
    } else {
      e = rel_err(*t.first, *t.second);
    }
    char buf[48];
    std::snprintf(buf, sizeof buf, "  %s %.2e", what, e);
    line += buf;
    EXPECT_LT(e, kVsReference) << what;
  }
  const double ez = rel_err(z_of(g), z_of(r));
  char buf[48];
  std::snprintf(buf, sizeof buf, "  Z %.2e", ez);
  std::printf("%s%s\n", line.c_str(), buf);
  EXPECT_LT(ez, kVsReference) << "saved Z";
  gate(tag, g, b, c.act, valid);
}

TEST_P(Fp8LayerCuda, VsCpuReferenceAndGateVsBf16) {
  SONICMOE_REQUIRE_GPU();
  for (Precision dgated : {Precision::fp8_blockwise, Precision::bf16}) {
    SCOPED_TRACE(std::string("dgated_precision ") + precision_name(dgated));
    vs_reference_and_gate(GetParam(), dgated);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8LayerCuda,
    ::testing::Values(Case{300, 256, 256, 8, 2, Activation::swiglu, false, RoutingMode::topk, 128, false},
                      // T not a multiple of 128, K = 1, E = 60 (empty experts), H = I = 384 (not multiples of 256)
                      Case{130, 384, 384, 60, 1, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{1, 128, 128, 4, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{517, 256, 128, 16, 4, Activation::geglu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 1, Activation::reglu, false, RoutingMode::topk, 128, true},
                      Case{300, 128, 256, 8, 8, Activation::gelu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 4, Activation::relu, true, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 4, Activation::silu, false, RoutingMode::topk, 128, false},
                      Case{300, 256, 128, 16, 4, Activation::relu_sq, true, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::swiglu, false, RoutingMode::round_nearest, 64, false},
                      Case{1000, 256, 128, 16, 4, Activation::gelu, true, RoutingMode::round_up, 64, false},
                      Case{1000, 256, 128, 16, 4, Activation::swiglu, false, RoutingMode::round_down, 64, true},
                      // Every expert rounds down to zero rows: N = 0.
                      Case{40, 128, 128, 16, 2, Activation::swiglu, true, RoutingMode::round_down, 128, false},
                      Case{300, 256, 128, 12, 1, Activation::swiglu, true, RoutingMode::general, 128, false},
                      Case{257, 384, 128, 60, 3, Activation::relu_sq, false, RoutingMode::general, 128, false}),
    layer_case_name);

// An FP8 operand quantised 1x128 in the epilogue of the GEMM that makes it and by the 1x128 quantiser after that GEMM
// (environment variable `var` = epilogue / pass): the same codes, so the same saved state, output and gradients bit
// for bit; partial tiles, GLU with a bias and plain, top-K and general routing.
void expect_epilogue_is_pass(const char* var, unsigned seed) {
  for (const Case& c : {Case{700, 256, 256, 12, 4, Activation::swiglu, true, RoutingMode::topk, 128, false},
                        Case{257, 384, 128, 60, 3, Activation::relu_sq, false, RoutingMode::general, 128, false}}) {
    SCOPED_TRACE(std::string(var) + ", " + activation_name(c.act));
    const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
    const Inputs dev = make_inputs(c, seed).to(Device::cuda());
    ASSERT_EQ(setenv(var, "epilogue", 1), 0);  // forced both ways (the default: the epilogue)
    const LayerRun epi = run(gpu_ctx(), cfg, dev, c);
    ASSERT_EQ(setenv(var, "pass", 1), 0);
    const LayerRun pass = run(gpu_ctx(), cfg, dev, c);
    unsetenv(var);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (auto [name, x, y] : {std::tuple{"z_fp8", &epi.f.saved.z_fp8, &pass.f.saved.z_fp8},
                              {"z_scale", &epi.f.saved.z_scale, &pass.f.saved.z_scale},
                              {"output", &epi.f.output, &pass.f.output}, {"dx", &epi.g.dx, &pass.g.dx},
                              {"dw1", &epi.g.dw1, &pass.g.dw1}, {"dw2", &epi.g.dw2, &pass.g.dw2},
                              {"dscore", &epi.g.dscore, &pass.g.dscore}})
      EXPECT_TRUE(testing::bitwise_equal(*x, *y)) << name;
    if (c.mode == RoutingMode::topk)  // general routing has no router
      EXPECT_TRUE(testing::bitwise_equal(epi.g.drouter, pass.g.drouter)) << "drouter";
  }
}

// The saved Z (SONICMOE_FP8_Z) and dXe's operand dZ (SONICMOE_FP8_DZ).
TEST(Fp8LayerCudaMisc, ZFromTheEpilogueIsTheQuantisedBf16Z) {
  SONICMOE_REQUIRE_GPU();
  expect_epilogue_is_pass("SONICMOE_FP8_Z", 9);
}
TEST(Fp8LayerCudaMisc, DzFromTheEpilogueIsTheQuantisedBf16Dz) {
  SONICMOE_REQUIRE_GPU();
  expect_epilogue_is_pass("SONICMOE_FP8_DZ", 10);
}

// Two runs on the same inputs: bitwise-equal outputs, saved state and gradients (no float atomics anywhere).
TEST(Fp8LayerCudaMisc, BitExactRepeats) {
  SONICMOE_REQUIRE_GPU();
  const Case c{700, 256, 256, 12, 4, Activation::swiglu, true, RoutingMode::topk, 128, false};
  const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  const Inputs dev = make_inputs(c, 5).to(Device::cuda());
  const LayerRun a = run(gpu_ctx(), cfg, dev, c), b = run(gpu_ctx(), cfg, dev, c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(a.f.output, b.f.output)) << "output";
  EXPECT_TRUE(testing::bitwise_equal(a.f.saved.z_fp8, b.f.saved.z_fp8)) << "z_fp8";
  EXPECT_TRUE(testing::bitwise_equal(a.f.saved.z_scale, b.f.saved.z_scale)) << "z_scale";
  for (auto [name, x, y] : {std::tuple{"dx", &a.g.dx, &b.g.dx}, {"dw1", &a.g.dw1, &b.g.dw1},
                            {"dw2", &a.g.dw2, &b.g.dw2}, {"db1", &a.g.db1, &b.g.db1}, {"db2", &a.g.db2, &b.g.db2},
                            {"drouter", &a.g.drouter, &b.g.drouter}, {"dscore", &a.g.dscore, &b.g.dscore}})
    EXPECT_TRUE(testing::bitwise_equal(*x, *y)) << name;
  // The backward that consumes the state gives the same bits.
  SavedState s = a.f.saved;
  const Gradients g = moe_backward(gpu_ctx(), dev.x, dev.weights(), std::move(s), dev.d_out, AuxLossGrad(0.25f));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(g.dx, a.g.dx) && testing::bitwise_equal(g.dw1, a.g.dw1));
  // Inference runs the same forward.
  EXPECT_TRUE(testing::bitwise_equal(moe_inference(gpu_ctx(), cfg, dev.x, dev.weights(), {}), a.f.output));
}

// Forward + backward captured in a CUDA graph and replayed give the eager bits (top-K: no host read anywhere).
TEST(Fp8LayerCudaMisc, GraphCapture) {
  SONICMOE_REQUIRE_GPU();
  const Case c{640, 256, 256, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false};
  const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  const Inputs dev = make_inputs(c, 9).to(Device::cuda());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Context ctx = gpu_ctx();
  ctx.stream = stream;
  {
    const LayerRun eager = run(ctx, cfg, dev, c);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraph_t graph;
    LayerRun cap;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    try {
      cap = run(ctx, cfg, dev, c);
    } catch (const std::exception& e) {
      cudaStreamEndCapture(stream, &graph);
      FAIL() << "capture failed: " << e.what();
    }
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(cap.f.output, eager.f.output));
    EXPECT_TRUE(testing::bitwise_equal(cap.f.saved.z_fp8, eager.f.saved.z_fp8));
    EXPECT_TRUE(testing::bitwise_equal(cap.g.dx, eager.g.dx));
    EXPECT_TRUE(testing::bitwise_equal(cap.g.dw1, eager.g.dw1));
    EXPECT_TRUE(testing::bitwise_equal(cap.g.dw2, eager.g.dw2));
    EXPECT_TRUE(testing::bitwise_equal(cap.g.dscore, eager.g.dscore));
    EXPECT_TRUE(testing::bitwise_equal(cap.g.drouter, eager.g.drouter));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

// fp8_quantize_expert_weights on the GPU: the CPU's bits; passed as MoEWeights::fp8 they give the layer's own bits.
TEST(Fp8LayerCudaMisc, PreQuantisedWeights) {
  SONICMOE_REQUIRE_GPU();
  const Case c{300, 256, 384, 6, 2, Activation::geglu, true, RoutingMode::topk, 128, false};
  const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  const Inputs host = make_inputs(c, 3);
  const Inputs dev = host.to(Device::cuda());
  const Fp8ExpertWeights qg = fp8_quantize_expert_weights(gpu_ctx(), cfg, dev.weights());
  // W2^T is made only where the backward reads it (FP8 dgated operands): compared on that config's quantisation.
  MoEConfig cfg8 = cfg;
  cfg8.dgated_precision = Precision::fp8_blockwise;
  const Fp8ExpertWeights qg8 = fp8_quantize_expert_weights(gpu_ctx(), cfg8, dev.weights());
  const Fp8ExpertWeights qc = fp8_quantize_expert_weights(Context{}, cfg8, host.weights());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_FALSE(qg.w2_t.defined() || qg.w2_scale_t.defined());
  for (auto [name, a, b] : {std::tuple{"w1", &qg.w1, &qc.w1}, {"w1_t", &qg.w1_t, &qc.w1_t},
                            {"w1_scale", &qg.w1_scale, &qc.w1_scale}, {"w1_scale_t", &qg.w1_scale_t, &qc.w1_scale_t},
                            {"w2", &qg.w2, &qc.w2}, {"w2_t", &qg8.w2_t, &qc.w2_t},
                            {"w2_scale", &qg.w2_scale, &qc.w2_scale}, {"w2_scale_t", &qg8.w2_scale_t, &qc.w2_scale_t}})
    EXPECT_TRUE(testing::bitwise_equal(*a, *b)) << name;
  const LayerRun own = run(gpu_ctx(), cfg, dev, c);
  MoEWeights w = dev.weights();
  w.fp8 = &qg;
  const ForwardResult f = moe_forward(gpu_ctx(), cfg, dev.x, w, {});
  const Gradients g = moe_backward(gpu_ctx(), dev.x, w, f.saved, dev.d_out, AuxLossGrad(0.25f));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(f.output, own.f.output));
  EXPECT_TRUE(testing::bitwise_equal(g.dx, own.g.dx));
  EXPECT_TRUE(testing::bitwise_equal(g.dw1, own.g.dw1));
  EXPECT_TRUE(testing::bitwise_equal(g.dw2, own.g.dw2));
  // Host-side weights on a GPU context are refused, naming the field.
  w.fp8 = &qc;
  EXPECT_THAT(error_of([&] { moe_forward(gpu_ctx(), cfg, dev.x, w, {}); }), ::testing::HasSubstr("w.fp8->w1"));
}

// The training forward quantises W1 and W2 once with their transposed copies (one pass each; W2's only for the dgated
// GEMM on FP8 operands) and keeps the copies in its state; the backward reads them. They are
// fp8_quantize_expert_weights' copies and the CPU reference's, bit for bit, and the gradients are bitwise those of the
// per-call path (a state without the copies: the backward quantises the weights itself, as before) and of the
// pre-quantised path (MoEWeights::fp8: the state keeps none). Each case with the dgated GEMM on bf16 operands (the
// default) and on FP8 ones.
TEST(Fp8LayerCudaMisc, BackwardReusesTheForwardsQuantisedWeights) {
  SONICMOE_REQUIRE_GPU();
  for (const Case& c : {Case{300, 256, 384, 6, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                        Case{257, 384, 128, 12, 1, Activation::gelu, false, RoutingMode::general, 128, false},
                        Case{520, 256, 256, 8, 2, Activation::geglu, true, RoutingMode::round_up, 64, false}})
  for (Precision dgated : {Precision::bf16, Precision::fp8_blockwise}) {
    const std::string tag = std::string(activation_name(c.act)) + " " + routing_mode_name(c.mode) + " dgated " +
                            precision_name(dgated);
    MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
    cfg.dgated_precision = dgated;
    const Inputs host = make_inputs(c, 17);
    const Inputs dev = host.to(Device::cuda());
    const bool router = c.mode != RoutingMode::general;
    const MoEWeights w = dev.weights(router);
    const ForwardResult f = moe_forward(gpu_ctx(), cfg, dev.x, w, dev.spec(c));
    const SavedState& s = f.saved;
    const Fp8ExpertWeights q = fp8_quantize_expert_weights(gpu_ctx(), cfg, w);
    const ForwardResult fc = moe_forward(Context{}, cfg, host.x, host.weights(router), host.spec(c));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const bool w2_t = dgated == Precision::fp8_blockwise;
    for (auto [name, a, b, r] : {std::tuple{"w1_t", &s.w1_t_fp8, &q.w1_t, &fc.saved.w1_t_fp8},
                                 {"w1_scale_t", &s.w1_t_scale, &q.w1_scale_t, &fc.saved.w1_t_scale},
                                 {"w2_t", &s.w2_t_fp8, &q.w2_t, &fc.saved.w2_t_fp8},
                                 {"w2_scale_t", &s.w2_t_scale, &q.w2_scale_t, &fc.saved.w2_t_scale}}) {
      if (!w2_t && name[1] == '2') {  // no W2^T: neither backend makes it
        EXPECT_FALSE(a->defined() || r->defined()) << tag << ": " << name;
        continue;
      }
      ASSERT_TRUE(a->defined()) << tag << ": " << name;
      EXPECT_TRUE(testing::bitwise_equal(*a, *b)) << tag << ": " << name << " vs fp8_quantize_expert_weights";
      EXPECT_TRUE(testing::bitwise_equal(*a, *r)) << tag << ": " << name << " vs the CPU reference";
    }
    const Gradients reused = moe_backward(gpu_ctx(), dev.x, w, s, dev.d_out, AuxLossGrad(0.25f));
    SavedState bare = s;
    bare.w1_t_fp8 = bare.w1_t_scale = bare.w2_t_fp8 = bare.w2_t_scale = Tensor();
    const Gradients per_call = moe_backward(gpu_ctx(), dev.x, w, bare, dev.d_out, AuxLossGrad(0.25f));
    MoEWeights wq = w;
    wq.fp8 = &q;
    const ForwardResult fq = moe_forward(gpu_ctx(), cfg, dev.x, wq, dev.spec(c));
    const Gradients pre = moe_backward(gpu_ctx(), dev.x, wq, fq.saved, dev.d_out, AuxLossGrad(0.25f));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_FALSE(fq.saved.w1_t_fp8.defined() || fq.saved.w2_t_fp8.defined()) << tag;
    EXPECT_TRUE(testing::bitwise_equal(fq.output, f.output)) << tag;
    EXPECT_TRUE(testing::bitwise_equal(fq.saved.z_fp8, s.z_fp8)) << tag;
    // The consuming backward writes dZ's codes and scales over the saved Z's (s shares the buffers with `moved`):
    // the same gradients, and Z's memory no longer holds Z.
    SavedState moved = s;
    const Gradients consumed = moe_backward(gpu_ctx(), dev.x, w, std::move(moved), dev.d_out, AuxLossGrad(0.25f));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_FALSE(testing::bitwise_equal(fq.saved.z_fp8, s.z_fp8)) << tag << ": dZ's codes over Z's";
    // dscore over the valid pairs (token rounding's pair arrays have a capacity beyond them)
    const Tensor off = s.routing.meta.offsets.to(Device::cpu());
    const std::int64_t valid = off.ptr<const std::int32_t>()[c.E];
    auto ds = [&](const Gradients& g) { return g.dscore.to(Device::cpu()).carve(0, {valid}, DType::f32); };
    auto same = [](const Tensor& a, const Tensor& b) {
      return a.defined() && b.defined() ? testing::bitwise_equal(a, b) : a.defined() == b.defined();
    };
    for (const auto& [how, g] : {std::pair{"per call", &per_call}, {"pre-quantised", &pre}, {"consumed", &consumed}}) {
      for (auto [name, a, b] : {std::tuple{"dx", &g->dx, &reused.dx}, {"dw1", &g->dw1, &reused.dw1},
                                {"dw2", &g->dw2, &reused.dw2}, {"db1", &g->db1, &reused.db1},
                                {"db2", &g->db2, &reused.db2}, {"drouter", &g->drouter, &reused.drouter}})
        EXPECT_TRUE(same(*a, *b)) << tag << ": " << name << " (" << how << ")";
      EXPECT_TRUE(same(ds(*g), ds(reused))) << tag << ": dscore (" << how << ")";
    }
  }
}

// The estimate bounds the measured peak of each pass, and the saved state is <= 0.6x bf16's Z.
TEST(Fp8LayerCudaMisc, MemoryEstimateAndSavedState) {
  SONICMOE_REQUIRE_GPU();
  for (bool bias : {false, true}) {
    const Case c{1024, 512, 256, 8, 2, Activation::swiglu, bias, RoutingMode::topk, 128, false};
    const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
    const Inputs dev = make_inputs(c, 4).to(Device::cuda());
    CountingAllocator alloc;
    Context ctx = gpu_ctx();
    ctx.allocator = &alloc;
    std::size_t fwd = 0, bwd = 0, saved = 0, state = 0, bwd_per_call = 0, fwd_pre = 0, bwd_pre = 0;
    {
      ForwardResult f = moe_forward(ctx, cfg, dev.x, dev.weights(), {});
      fwd = alloc.peak_;
      saved = f.saved.z_fp8.nbytes() + f.saved.z_scale.nbytes();
      state = saved_state_bytes(f.saved);
      EXPECT_LE(state + f.output.nbytes(), alloc.live_);  // each buffer counted once: no more than is allocated
      EXPECT_GT(state, saved + f.saved.w1_t_fp8.nbytes());
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      { Gradients g = moe_backward(ctx, dev.x, dev.weights(), f.saved, dev.d_out, 1.0f); }
      bwd = alloc.peak_ - base;
      // a state without the forward's quantised weights: the backward quantises them itself
      SavedState bare = f.saved;
      bare.w1_t_fp8 = bare.w1_t_scale = bare.w2_t_fp8 = bare.w2_t_scale = Tensor();
      f.saved = SavedState();
      const std::size_t base2 = alloc.live_;
      alloc.peak_ = base2;
      { Gradients g = moe_backward(ctx, dev.x, dev.weights(), bare, dev.d_out, 1.0f); }
      bwd_per_call = alloc.peak_ - base2;
    }
    {  // pre-quantised weights (allocated before the measurement, as a cache holds them)
      const Fp8ExpertWeights q = fp8_quantize_expert_weights(ctx, cfg, dev.weights());
      MoEWeights w = dev.weights();
      w.fp8 = &q;
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      ForwardResult f = moe_forward(ctx, cfg, dev.x, w, {});
      fwd_pre = alloc.peak_ - base;
      const std::size_t base2 = alloc.live_;
      alloc.peak_ = base2;
      { Gradients g = moe_backward(ctx, dev.x, w, f.saved, dev.d_out, 1.0f); }
      bwd_pre = alloc.peak_ - base2;
    }
    std::size_t bwd_consumed = 0;
    {  // the consuming backward: dZ's codes over the saved Z's
      ForwardResult f = moe_forward(ctx, cfg, dev.x, dev.weights(), {});
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      { Gradients g = moe_backward(ctx, dev.x, dev.weights(), std::move(f.saved), dev.d_out, 1.0f); }
      bwd_consumed = alloc.peak_ - base;
    }
    std::size_t bf16_bwd = 0;
    {  // the bf16 layer's backward on the same inputs (its own dZ buffer: the state is kept, as here)
      const MoEConfig bcfg = config_of(c, Precision::bf16);
      ForwardResult f = moe_forward(ctx, bcfg, dev.x, dev.weights(), {});
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      { Gradients g = moe_backward(ctx, dev.x, dev.weights(), f.saved, dev.d_out, 1.0f); }
      bf16_bwd = alloc.peak_ - base;
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::size_t est_fwd = moe_memory_estimate(cfg, c.T, DType::bf16, {}, MemoryPass::forward);
    const std::size_t est_bwd = moe_memory_estimate(cfg, c.T, DType::bf16, {}, MemoryPass::backward);
    const std::size_t est_bwd_per_call = limits::layer_bytes(cfg, c.T, c.T * c.K, DType::bf16, RoutingMode::topk,
                                                             MemoryPass::backward, false, /*quantises=*/true);
    const double bf16_z = double(c.T * c.K * cfg.z_width() * 2);
    std::printf("[fp8 memory] bias=%d forward peak %zu (estimate %zu), backward peak %zu (estimate %zu); saved state "
                "%zu bytes (Z %zu = %.4fx bf16's Z); backward quantising the weights itself %zu (estimate %zu); "
                "pre-quantised weights: forward %zu, backward %zu\n", bias, fwd, est_fwd, bwd, est_bwd, state, saved,
                double(saved) / bf16_z, bwd_per_call, est_bwd_per_call, fwd_pre, bwd_pre);
    EXPECT_LE(fwd, est_fwd);
    EXPECT_LE(bwd, est_bwd);
    EXPECT_GE(double(bwd), 0.9 * double(est_bwd));  // the estimate follows the backward's order, not a loose bound
    // dW1 made after dXe is gone and dZ written over the dequantised Z: no more than the bf16 backward (its peak,
    // dX with dW1, is the FP8 one's too at this shape) plus dZ's quantised copy.
    EXPECT_LE(double(bwd), 1.15 * double(bf16_bwd)) << "bf16 backward peak " << bf16_bwd;
    EXPECT_LE(bwd_per_call, est_bwd_per_call);
    EXPECT_LT(bwd, bwd_per_call);  // the backward allocates no quantised weights
    EXPECT_LE(bwd_consumed, bwd) << "the consuming backward allocates no dZ codes";
    EXPECT_LE(fwd_pre, est_fwd);
    EXPECT_LE(bwd_pre, est_bwd);
    EXPECT_LE(double(saved), 0.6 * bf16_z);
  }
}

TEST(Fp8LayerCudaMisc, Refusals) {
  SONICMOE_REQUIRE_GPU();
  const Case c{64, 256, 128, 4, 2, Activation::swiglu, false, RoutingMode::topk, 128, false};
  MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  const Inputs dev = make_inputs(c, 6).to(Device::cuda());
  // Shapes FP8 cannot quantise.
  for (auto [H, I, field] : {std::tuple{200, 128, "hidden_size = 200"}, {256, 192, "intermediate_size = 192"}}) {
    const Case b{16, H, I, 4, 2, Activation::swiglu, false, RoutingMode::topk, 128, false};
    const Inputs in = make_inputs(b, 2).to(Device::cuda());
    const std::string msg = error_of([&] { run(gpu_ctx(), config_of(b, Precision::fp8_blockwise), in, b); });
    EXPECT_THAT(msg, ::testing::HasSubstr(field));
    EXPECT_THAT(msg, ::testing::HasSubstr("multiple of 128"));
  }
  // f32 storage: the cuda backend computes in bf16 only.
  Inputs f32;
  {
    const Inputs h = make_inputs(c, 6);
    auto to32 = [](const Tensor& t) {
      Tensor o = Tensor::empty({t.size(0), t.size(1), t.ndim() > 2 ? t.size(2) : 1}, DType::f32);
      for (std::int64_t i = 0; i < t.numel(); ++i) o.ptr<float>()[i] = bf16_to_float(t.ptr<const bf16>()[i]);
      return o.reshape(std::vector<std::int64_t>(t.view().shape.begin(), t.view().shape.begin() + t.ndim()));
    };
    const Inputs host32{{to32(h.x), to32(h.router), to32(h.w1), Tensor(), to32(h.w2), Tensor(), to32(h.d_out)}};
    f32 = host32.to(Device::cuda());
  }
  EXPECT_THAT(error_of([&] { moe_forward(gpu_ctx(), cfg, f32.x, f32.weights(), {}); }),
              ::testing::HasSubstr("bf16"));
  // A backward without the FP8 saved Z.
  SavedState s = moe_forward(gpu_ctx(), config_of(c, Precision::bf16), dev.x, dev.weights(), {}).saved;
  s.config.precision = Precision::fp8_blockwise;
  EXPECT_THAT(error_of([&] { moe_backward(gpu_ctx(), dev.x, dev.weights(), s, dev.d_out); }),
              ::testing::HasSubstr("saved.z_fp8"));
}

// The FP8 layer's dequantiser (1x128 rows -> bf16) against the CPU dequantiser rounded to bf16, bitwise (NaN blocks:
// NaN on both sides), with rows not a multiple of anything, a zero block, tiny and huge blocks; and the 128x128
// scale-grid transpose.
TEST(Fp8DequantCuda, RowsBitwiseVsCpu) {
  SONICMOE_REQUIRE_GPU();
  const std::int64_t M = 301, C = 384;
  std::mt19937 rng(12);
  Tensor x = testing::host_randn({M, C}, DType::f32, 1.0f, rng);
  float* v = x.ptr<float>();
  for (std::int64_t c = 0; c < 128; ++c) v[5 * C + c] = 0.0f;            // a zero block
  for (std::int64_t c = 128; c < 256; ++c) v[7 * C + c] *= 1e-37f;       // scales at the clamp, subnormal values
  for (std::int64_t c = 0; c < 128; ++c) v[9 * C + c] *= 1e30f;          // huge values
  v[11 * C + 300] = NAN;                                                   // a NaN block
  v[13 * C + 3] = INFINITY;                                                // an infinite block
  Tensor q = Tensor::empty({M, C}, DType::f8e4m3), s = Tensor::empty({M, C / 128}, DType::f32);
  fp8_quantize_rows(Context{}, x, TensorView(), q, s);
  const Tensor want = ref::fp8_dequantize(q, s, 1, 128);
  const Tensor qg = q.to(Device::cuda()), sg = s.to(Device::cuda());
  Tensor out = Tensor::empty({M, C}, DType::bf16, Device::cuda());
  cuda::fp8_dequantize_rows_bf16(gpu_ctx(), qg, sg, out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = out.to(Device::cpu());
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < M * C; ++i) {
    const float w = want.ptr<const float>()[i];
    const bf16 gb = got.ptr<const bf16>()[i];
    if (std::isnan(w)) {
      bad += !std::isnan(bf16_to_float(gb));
      continue;
    }
    bad += gb.bits != float_to_bf16(w).bits;
  }
  EXPECT_EQ(bad, 0);

  const std::int64_t E = 3, R = 5, K = 7;
  Tensor g = testing::host_randn({E, R, K}, DType::f32, 1.0f, rng), gt = Tensor::empty({E, K, R}, DType::f32,
                                                                                        Device::cuda());
  const Tensor gd = g.to(Device::cuda());
  cuda::fp8_transpose_scales(gpu_ctx(), gd, gt);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor h = gt.to(Device::cpu());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < R; ++i)
      for (std::int64_t j = 0; j < K; ++j)
        ASSERT_EQ(h.ptr<const float>()[(e * K + j) * R + i], g.ptr<const float>()[(e * R + i) * K + j]);
}

}  // namespace
}  // namespace sonicmoe

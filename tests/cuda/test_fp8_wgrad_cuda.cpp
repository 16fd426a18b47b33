// FP8 weight gradients on the GPU (MoEConfig::weight_grad_precision = fp8_blockwise; src/cuda/fp8/fp8_weight_grads.h):
//  - the per-expert 128x1 quantiser (src/cuda/quant/quant_segments.h) bitwise against the CPU quantiser run on each
//    expert's rows, gathered or not, with empty experts and partial blocks; its block offsets (past one scan chunk too);
//  - the FP8 varlen-K GEMM (fp8_varlen_k) against a double-precision sum over the same codes and scales, stored in
//    bf16 and added into fp32, an expert without rows included;
//  - the layer: dW1, dW2, db1, db2 against the CPU reference's FP8 weight gradients; out, dx and ds bitwise those of
//    the bf16-weight-gradient FP8 layer; the precision against the bf16 layer (printed, held to the CPU suite's bound
//    for FP8 weight gradients); bitwise repeats; fp32 main_grad accumulation; the backward's peak against
//    moe_memory_estimate.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_e4m3.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gpu_test_util.h"
#include "cuda/layer_case.h"
#include "cuda/quant/quant_segments.h"
#include "counting_allocator.h"
#include "fp8_gate.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/quant.h"

namespace sonicmoe {
namespace {

using testing::rel_err;
using Case = testing_util::LayerCase;
using testing_util::gpu_ctx;
using testing_util::layer_case_name;

Tensor i32_tensor(const std::vector<std::int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::i32);
  std::copy(v.begin(), v.end(), t.ptr<std::int32_t>());
  return t;
}

Tensor random_bf16(std::int64_t rows, std::int64_t cols, std::mt19937& rng, float sd = 1.0f) {
  Tensor t = Tensor::empty({rows, cols}, DType::bf16);
  std::normal_distribution<float> nd(0.0f, sd);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16>()[i] = float_to_bf16(nd(rng));
  return t;
}

// The routing's rows of one problem: expert row counts (empty experts, partial and whole blocks) and a gather.
struct Segs {
  std::vector<std::int32_t> off, gather;
  std::int64_t N() const { return off.back(); }
  std::int64_t E() const { return static_cast<std::int64_t>(off.size()) - 1; }
};
Segs make_segs(const std::vector<std::int32_t>& counts, std::int64_t T, std::mt19937& rng) {
  Segs s;
  s.off.push_back(0);
  for (std::int32_t c : counts) s.off.push_back(s.off.back() + c);
  for (std::int64_t r = 0; r < s.N(); ++r) s.gather.push_back(static_cast<std::int32_t>(rng() % T));
  return s;
}

// One operand's K-major copy from the GPU quantiser, on the host.
struct Copy {
  Tensor q, scale, block_offsets;
  std::int64_t cap = 0;
};
Copy quantize_on_gpu(const Tensor& x, const Segs& s, bool gathered) {
  const Context ctx = gpu_ctx();
  const std::int64_t C = x.size(1), cap = cuda::fp8_segment_block_capacity(s.N(), s.E());
  const Tensor off = i32_tensor(s.off).to(Device::cuda()), g = i32_tensor(s.gather).to(Device::cuda());
  Tensor bo = Tensor::empty({s.E() + 1}, DType::i32, Device::cuda());
  Tensor q = Tensor::empty({C, cap * 128}, DType::f8e4m3, Device::cuda());
  Tensor sc = Tensor::empty({cap, C}, DType::f32, Device::cuda());
  cuda::fp8_segment_block_offsets(ctx, off, bo);
  cuda::fp8_quantize_segment_cols(ctx, x.to(Device::cuda()), gathered ? g.view() : TensorView(), off, bo, q, sc);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {q.to(Device::cpu()), sc.to(Device::cpu()), bo.to(Device::cpu()), cap};
}

TEST(Fp8WeightGradsCuda, SegmentQuantiserIsTheCpuQuantiserPerExpert) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(3);
  const std::int64_t T = 300, C = 384;
  const Segs s = make_segs({0, 1, 130, 0, 256, 77, 128}, T, rng);
  // gathered: rows of a [T, C] input through the gather; contiguous: the routing's own [N, C] rows
  const Tensor xg = random_bf16(T, C, rng, 2.0f), xc = random_bf16(s.N(), C, rng, 2.0f);
  for (bool gathered : {true, false}) {
    SCOPED_TRACE(gathered ? "gathered" : "contiguous");
    const Tensor& x = gathered ? xg : xc;
    const Copy c = quantize_on_gpu(x, s, gathered);
    const std::int32_t* bo = c.block_offsets.ptr<const std::int32_t>();
    std::int32_t want_bo = 0;
    for (std::int64_t e = 0; e <= s.E(); ++e) {
      ASSERT_EQ(bo[e], want_bo) << "block offset of expert " << e;
      if (e < s.E()) want_bo += (s.off[e + 1] - s.off[e] + 127) / 128;
    }
    const std::int64_t ld = c.cap * 128;
    for (std::int64_t e = 0; e < s.E(); ++e) {
      const std::int64_t rows = s.off[e + 1] - s.off[e];
      if (rows == 0) continue;
      Tensor seg = Tensor::empty({rows, C}, DType::bf16);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t src = gathered ? s.gather[s.off[e] + r] : s.off[e] + r;
        std::copy(x.ptr<const bf16>() + src * C, x.ptr<const bf16>() + (src + 1) * C, seg.ptr<bf16>() + r * C);
      }
      Tensor q = Tensor::empty({C, rows}, DType::f8e4m3), sc = Tensor::empty({C, fp8_num_blocks(rows)}, DType::f32);
      fp8_quantize_cols_transposed(Context{}, seg, q, sc);
      const std::int64_t nb = fp8_num_blocks(rows);
      int bad = 0;
      for (std::int64_t ch = 0; ch < C; ++ch) {
        for (std::int64_t b = 0; b < nb; ++b) {
          if (c.scale.ptr<const float>()[(bo[e] + b) * C + ch] != sc.ptr<const float>()[ch * nb + b]) ++bad;
          for (std::int64_t i = 0; i < 128; ++i) {
            const std::int64_t r = b * 128 + i;
            const std::uint8_t want = r < rows ? q.ptr<const std::uint8_t>()[ch * rows + r] : 0;
            if (c.q.ptr<const std::uint8_t>()[ch * ld + (bo[e] + b) * 128 + i] != want) ++bad;
          }
        }
      }
      EXPECT_EQ(bad, 0) << "expert " << e << " (" << rows << " rows)";
    }
  }
}

// The block offsets over more experts than one scan chunk (1024), empty experts, and counts at block edges.
TEST(Fp8WeightGradsCuda, BlockOffsetsPastOneScanChunk) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(8);
  for (std::int64_t E : {1, 1023, 1024, 1025, 2500}) {
    SCOPED_TRACE("E = " + std::to_string(E));
    std::vector<std::int32_t> off{0};
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int32_t pick[] = {0, 1, 127, 128, 129, 256, static_cast<std::int32_t>(rng() % 700)};
      off.push_back(off.back() + pick[rng() % 7]);
    }
    const Tensor d_off = i32_tensor(off).to(Device::cuda());
    Tensor bo = Tensor::empty({E + 1}, DType::i32, Device::cuda());
    cuda::fp8_segment_block_offsets(gpu_ctx(), d_off, bo);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor h = bo.to(Device::cpu());
    std::int32_t want = 0;
    for (std::int64_t e = 0; e <= E; ++e) {
      ASSERT_EQ(h.ptr<const std::int32_t>()[e], want) << "block offset of expert " << e;
      if (e < E) want += (off[e + 1] - off[e] + 127) / 128;
    }
    EXPECT_LE(want, cuda::fp8_segment_block_capacity(off.back(), E));
  }
}

// D[e] = sum over the expert's blocks of dequant(A) dequant(B)^T in double, from the copies' codes and scales.
std::vector<double> gemm_reference(const Copy& a, const Copy& b, std::int64_t E) {
  const std::int64_t m = a.q.size(0), n = b.q.size(0), ld = a.cap * 128;
  std::vector<double> d(static_cast<std::size_t>(E * m * n), 0.0);
  const std::int32_t* bo = a.block_offsets.ptr<const std::int32_t>();
  auto deq = [&](const Copy& c, std::int64_t rows, std::int64_t ch, std::int64_t k) {
    return static_cast<double>(fp8::e4m3_decode(c.q.ptr<const std::uint8_t>()[ch * ld + k])) *
           c.scale.ptr<const float>()[(k / 128) * rows + ch];
  };
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (std::int64_t k = std::int64_t{bo[e]} * 128; k < std::int64_t{bo[e + 1]} * 128; ++k)
          acc += deq(a, m, i, k) * deq(b, n, j, k);
        d[static_cast<std::size_t>((e * m + i) * n + j)] = acc;
      }
  return d;
}

TEST(Fp8WeightGradsCuda, VarlenKGemmIsTheScaledSum) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(4);
  const std::int64_t T = 300, M = 256, Nn = 384;
  const Segs s = make_segs({130, 0, 77, 300, 1}, T, rng);  // an expert without rows; partial blocks
  const Tensor x = random_bf16(T, M, rng), y = random_bf16(s.N(), Nn, rng, 0.5f);
  const Copy a = quantize_on_gpu(x, s, /*gathered=*/true), b = quantize_on_gpu(y, s, /*gathered=*/false);
  const std::vector<double> want = gemm_reference(a, b, s.E());
  const std::int64_t E = s.E();
  auto params = [&](const Tensor& qa, const Tensor& sa, const Tensor& qb, const Tensor& sb, const Tensor& bo) {
    cuda::gemm::Fp8VarlenK g;
    g.a = qa.ptr<const std::uint8_t>();
    g.a_scale = sa.ptr<const float>();
    g.b = qb.ptr<const std::uint8_t>();
    g.b_scale = sb.ptr<const float>();
    g.block_offsets = bo.ptr<const std::int32_t>();
    g.k_cap = a.cap * 128;
    g.num_experts = static_cast<int>(E);
    g.m = static_cast<int>(M);
    g.n = static_cast<int>(Nn);
    return g;
  };
  const Tensor qa = a.q.to(Device::cuda()), sa = a.scale.to(Device::cuda()), qb = b.q.to(Device::cuda()),
               sb = b.scale.to(Device::cuda()), bo = a.block_offsets.to(Device::cuda());
  // bf16 store over a poisoned D
  Tensor d = Tensor::empty({E, M, Nn}, DType::bf16);
  for (std::int64_t i = 0; i < d.numel(); ++i) d.ptr<bf16>()[i] = float_to_bf16(12345.0f);
  Tensor d_dev = d.to(Device::cuda());
  cuda::gemm::Fp8VarlenK g = params(qa, sa, qb, sb, bo);
  g.d = d_dev.ptr<__nv_bfloat16>();
  cuda::gemm::fp8_varlen_k(g);
  // fp32 accumulation into random values
  Tensor acc = Tensor::empty({E, M, Nn}, DType::f32);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t i = 0; i < acc.numel(); ++i) acc.ptr<float>()[i] = nd(rng);
  Tensor acc_dev = acc.to(Device::cuda());
  g = params(qa, sa, qb, sb, bo);
  g.d_f32 = acc_dev.ptr<float>();
  cuda::gemm::fp8_varlen_k(g);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = d_dev.to(Device::cpu()), got_acc = acc_dev.to(Device::cpu());
  double err = 0, norm = 0, err_acc = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double w = want[static_cast<std::size_t>(i)];
    err += std::pow(bf16_to_float(got.ptr<const bf16>()[i]) - w, 2), norm += w * w;
    err_acc += std::pow(got_acc.ptr<const float>()[i] - (acc.ptr<const float>()[i] + w), 2);
  }
  // bf16 storage: relative 2^-9 an element. Without it, the wgmma's own accumulation: Hopper's FP8 MMA keeps fewer
  // accumulator bits than fp32 inside a 128-deep k-block (the reason the recipe promotes every 128; the DeepSeek-V3
  // report measures about 14 bits), 1.2e-4 relative here on the H100; the promotion itself is fp32.
  EXPECT_LT(std::sqrt(err / norm), 4e-3);
  EXPECT_LT(std::sqrt(err_acc / norm), 5e-4);
  // the expert without rows: zeros stored, nothing added
  for (std::int64_t i = M * Nn; i < 2 * M * Nn; ++i) {
    ASSERT_EQ(bf16_to_float(got.ptr<const bf16>()[i]), 0.0f) << "element " << i;
    ASSERT_EQ(got_acc.ptr<const float>()[i], acc.ptr<const float>()[i]) << "element " << i;
  }
}

MoEConfig config_of(const Case& c, Precision wgrad) {
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  cfg.precision = Precision::fp8_blockwise;
  cfg.weight_grad_precision = wgrad;
  return cfg;
}

struct LayerRun {
  ForwardResult f;
  Gradients g;
};
LayerRun run(const Context& ctx, const MoEConfig& cfg, const testing_util::LayerInputs& in, const Case& c,
             const MoEWeights* with = nullptr) {
  RoutingSpec spec;
  spec.mode = c.mode;
  spec.tile = c.tile;
  const MoEWeights w = with ? *with : MoEWeights{in.router, in.w1, in.b1, in.w2, in.b2};
  LayerRun r{moe_forward(ctx, cfg, in.x, w, spec), {}};
  r.g = moe_backward(ctx, in.x, w, r.f.saved, in.d_out, AuxLossGrad(0.25f));
  return r;
}

testing_util::GateMetric compare(const Tensor& got_any, const Tensor& want_any) {
  const Tensor a = got_any.to(Device::cpu()), b = want_any.to(Device::cpu());
  double ab = 0, aa = 0, bb = 0, dd = 0;
  for (std::int64_t i = 0; i < b.numel() && i < a.numel(); ++i) {
    const double x = testing::value(a, i), y = testing::value(b, i);
    ab += x * y, aa += x * x, bb += y * y, dd += (x - y) * (x - y);
  }
  return {ab / std::sqrt(aa * bb), std::sqrt(dd / bb)};
}

class Fp8WeightGradsLayerCuda : public ::testing::TestWithParam<Case> {};

// The GPU's FP8 weight gradients against the CPU reference's (the same quantised operands: the quantisers agree
// bitwise; the operands themselves, dO, As, dZ and X, differ as the FP8 layer's do, tests/cuda/test_fp8_layer_cuda.cpp:
// 4e-2), against the bf16 layer (the CPU suite's bound for FP8 weight gradients), and the rest of the backward
// bitwise that of bf16 weight gradients.
TEST_P(Fp8WeightGradsLayerCuda, VsCpuReferenceAndBf16) {
  SONICMOE_REQUIRE_GPU();
  const Case c = GetParam();
  std::mt19937 rng(21);
  const testing_util::LayerInputs host = testing_util::make_layer_inputs(c, MoEConfig{c.E, c.K, c.H, c.I, c.act}.z_width(), rng);
  const testing_util::LayerInputs dev = host.to(Device::cuda());
  const LayerRun g8 = run(gpu_ctx(), config_of(c, Precision::fp8_blockwise), dev, c);
  const LayerRun g16 = run(gpu_ctx(), config_of(c, Precision::bf16), dev, c);
  MoEConfig bf = config_of(c, Precision::bf16);
  bf.precision = Precision::bf16;
  const LayerRun b = run(gpu_ctx(), bf, dev, c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const LayerRun r = run(Context{}, config_of(c, Precision::fp8_blockwise), host, c);
  for (auto [name, x, y] : {std::tuple{"out", &g8.f.output, &g16.f.output}, {"dx", &g8.g.dx, &g16.g.dx},
                            {"dscore", &g8.g.dscore, &g16.g.dscore}, {"drouter", &g8.g.drouter, &g16.g.drouter}})
    EXPECT_TRUE(testing::bitwise_equal(*x, *y)) << name << ": the weight gradients' precision changed it";
  std::string line = "[fp8 wgrad gpu] " + layer_case_name({c, 0}) + ": vs cpu";
  for (auto [name, x, y] : {std::tuple{"dW1", &g8.g.dw1, &r.g.dw1}, {"dW2", &g8.g.dw2, &r.g.dw2},
                            {"db1", &g8.g.db1, &r.g.db1}, {"db2", &g8.g.db2, &r.g.db2}}) {
    if (!y->defined()) continue;
    const double e = rel_err(*x, *y);
    char buf[48];
    std::snprintf(buf, sizeof buf, " %s %.2e", name, e);
    line += buf;
    EXPECT_LT(e, 4e-2) << name;
  }
  // db1 / db2 read the unquantised operands on both weight-gradient paths: the bf16 path's bits
  if (c.bias) {
    EXPECT_TRUE(testing::bitwise_equal(g8.g.db1, g16.g.db1)) << "db1";
    EXPECT_TRUE(testing::bitwise_equal(g8.g.db2, g16.g.db2)) << "db2";
  }
  line += "; vs the bf16 layer";
  std::string missed;
  const testing_util::GateBound bound{0.996, 0.085, "FP8 weight gradients: both operands quantised 128x1 once more"};
  const std::int64_t valid = r.f.saved.routing.meta.offsets.ptr<const std::int32_t>()[c.E];
  for (auto [name, x, y] : {std::tuple{"dW1", &g8.g.dw1, &b.g.dw1}, {"dW2", &g8.g.dw2, &b.g.dw2}})
    testing_util::gate_item(layer_case_name({c, 0}), name, compare(*x, *y), bound, valid >= 256, line, missed);
  std::printf("%s%s\n", line.c_str(), missed.empty() ? "" : ("  MISSED:" + missed).c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8WeightGradsLayerCuda,
    ::testing::Values(Case{300, 256, 256, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      // T not a multiple of 128, K = 1, E = 60 (empty experts), H = I = 384
                      Case{130, 384, 384, 60, 1, Activation::swiglu, true, RoutingMode::topk, 128, false},
                      Case{517, 256, 128, 16, 4, Activation::geglu, false, RoutingMode::topk, 128, false},
                      Case{1000, 256, 128, 16, 4, Activation::gelu, true, RoutingMode::round_up, 64, false},
                      Case{700, 128, 256, 12, 4, Activation::relu_sq, true, RoutingMode::topk, 128, false}),
    layer_case_name);

// Bitwise repeats, and the weight gradients added into fp32 main_grad buffers (MoEWeights::w1_main_grad /
// w2_main_grad): initial values + the unrounded gradient, within the bf16 store's rounding of the same sums.
TEST(Fp8WeightGradsLayerCudaMisc, RepeatsAndMainGrad) {
  SONICMOE_REQUIRE_GPU();
  const Case c{700, 256, 256, 12, 4, Activation::swiglu, true, RoutingMode::topk, 128, false};
  std::mt19937 rng(8);
  const testing_util::LayerInputs dev =
      testing_util::make_layer_inputs(c, MoEConfig{c.E, c.K, c.H, c.I, c.act}.z_width(), rng).to(Device::cuda());
  const MoEConfig cfg = config_of(c, Precision::fp8_blockwise);
  const LayerRun a = run(gpu_ctx(), cfg, dev, c), b = run(gpu_ctx(), cfg, dev, c);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::bitwise_equal(a.g.dw1, b.g.dw1)) << "dw1";
  EXPECT_TRUE(testing::bitwise_equal(a.g.dw2, b.g.dw2)) << "dw2";
  const std::int64_t ZW = cfg.z_width();
  Tensor m1 = Tensor::empty({c.E, ZW, c.H}, DType::f32), m2 = Tensor::empty({c.E, c.H, c.I}, DType::f32);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (Tensor* t : {&m1, &m2})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->ptr<float>()[i] = nd(rng);
  std::vector<Tensor> got;
  for (int rep = 0; rep < 2; ++rep) {
    Tensor d1 = m1.to(Device::cuda()), d2 = m2.to(Device::cuda());
    MoEWeights w{dev.router, dev.w1, dev.b1, dev.w2, dev.b2};
    w.w1_main_grad = d1;
    w.w2_main_grad = d2;
    const LayerRun m = run(gpu_ctx(), cfg, dev, c, &w);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_FALSE(m.g.dw1.defined() || m.g.dw2.defined()) << "dW1 / dW2 go to the main_grad buffers";
    got.push_back(d1.to(Device::cpu()));
    got.push_back(d2.to(Device::cpu()));
  }
  EXPECT_TRUE(testing::bitwise_equal(got[0], got[2]) && testing::bitwise_equal(got[1], got[3])) << "repeats";
  for (auto [name, init, sum, dw] : {std::tuple{"w1", &m1, &got[0], &a.g.dw1}, {"w2", &m2, &got[1], &a.g.dw2}}) {
    const Tensor stored = dw->to(Device::cpu());
    double err = 0, norm = 0;
    for (std::int64_t i = 0; i < stored.numel(); ++i) {
      const double added = double(sum->ptr<const float>()[i]) - init->ptr<const float>()[i];
      const double want = bf16_to_float(stored.ptr<const bf16>()[i]);
      err += (added - want) * (added - want), norm += want * want;
    }
    EXPECT_LT(std::sqrt(err / norm), 4e-3) << name << ": main_grad - its initial values vs the stored bf16 dW";
  }
}

// The backward's peak (its transposed FP8 copies included) within moe_memory_estimate, and close to it.
TEST(Fp8WeightGradsLayerCudaMisc, MemoryEstimate) {
  SONICMOE_REQUIRE_GPU();
  const Case c{1024, 512, 256, 8, 2, Activation::swiglu, true, RoutingMode::topk, 128, false};
  std::mt19937 rng(6);
  const testing_util::LayerInputs dev =
      testing_util::make_layer_inputs(c, MoEConfig{c.E, c.K, c.H, c.I, c.act}.z_width(), rng).to(Device::cuda());
  std::size_t peak[2] = {0, 0};
  for (int wg8 = 0; wg8 < 2; ++wg8) {
    const MoEConfig cfg = config_of(c, wg8 ? Precision::fp8_blockwise : Precision::bf16);
    testing_util::CountingAllocator alloc;
    Context ctx = gpu_ctx();
    ctx.allocator = &alloc;
    ForwardResult f = moe_forward(ctx, cfg, dev.x, dev.weights(), {});
    const std::size_t base = alloc.live_;
    alloc.peak_ = base;
    { Gradients g = moe_backward(ctx, dev.x, dev.weights(), f.saved, dev.d_out, 1.0f); }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    peak[wg8] = alloc.peak_ - base;
    const std::size_t est = moe_memory_estimate(cfg, c.T, DType::bf16, {}, MemoryPass::backward);
    std::printf("[fp8 wgrad memory] weight gradients %s: backward peak %zu, estimate %zu\n", wg8 ? "fp8" : "bf16",
                peak[wg8], est);
    EXPECT_LE(peak[wg8], est);
    EXPECT_GE(double(peak[wg8]), 0.9 * double(est));
  }
  EXPECT_GT(peak[1], peak[0]);  // the copies are extra
}

}  // namespace
}  // namespace sonicmoe

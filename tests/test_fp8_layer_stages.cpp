// Each stage of the FP8 layer's CPU reference (src/reference/fp8_layer_ref.h) against the bf16 reference stage of
// include/sonicmoe/stages.h run in f32 storage on the fake-quantised operands (ref::fp8_fake_quant, quantise +
// dequantise in fp32), and the FP8 outputs against the quantisers applied to that stage's fp32 result. Bitwise
// (memcmp): both sides do the same fp32 arithmetic in the same order on identical operand values, so any difference
// is a difference in what was quantised (blocking, gathering, the values quantised).
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>

#include "fp8_layer_problem.h"
#include "reference/fp8_layer_ref.h"
#include "reference/fp8_ref.h"
#include "reference/reference.h"
#include "sonicmoe/quant.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using fp8_test::Problem;

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}
#define EXPECT_BITWISE(a, b, what) EXPECT_TRUE(same_bytes((a), (b))) << what << " differs"

Tensor f32(const TensorView& v) {
  if (!v.given()) return Tensor();
  return naive::to_tensor(naive::from_view(v), {v.shape.begin(), v.shape.begin() + v.ndim}, DType::f32);
}
Tensor fq(const TensorView& v, int br, int bc) { return ref::fp8_fake_quant(v, br, bc); }
Tensor empty_f32(std::vector<std::int64_t> s) { return Tensor::empty(s, DType::f32); }
// Bitwise: q and scale equal fp8_quantize_rows of `want` (an fp32 [M, C] stage output).
void expect_rows_quant_of(const ref::Fp8Tensor& got, const Tensor& want, const std::string& what) {
  const std::int64_t M = want.size(0), C = want.size(1);
  Tensor q = Tensor::empty({M, C}, DType::f8e4m3), s = empty_f32({M, fp8_num_blocks(C)});
  fp8_quantize_rows(Context{}, want, TensorView(), q, s);
  EXPECT_BITWISE(got.q, q, what + " codes");
  EXPECT_BITWISE(got.scale, s, what + " scales");
}

struct StageCase {
  Activation act;
  bool bias;
};

class Fp8Stages : public ::testing::TestWithParam<StageCase> {};

TEST_P(Fp8Stages, EqualBf16StagesOnFakeQuantisedOperands) {
  const auto [act, bias] = GetParam();
  const fp8_test::Shape sh{150, 256, 128, 6, 2};  // T = 150: experts with a partial 128-row block
  Problem p = fp8_test::make_problem(sh, act, bias, DType::bf16, 11u + static_cast<unsigned>(act));
  p.cfg.precision = Precision::fp8_blockwise;
  const Context ctx;
  const Routing r = route(ctx, p.cfg, p.x, p.router, {});
  const RoutingMetadata& m = r.meta;
  const std::int64_t N = m.num_pairs, H = sh.H, I = sh.I, ZW = p.cfg.z_width(), E = sh.E;
  const Tensor w1f = fq(p.w1, 128, 128), w2f = fq(p.w2, 128, 128), b1f = f32(p.b1), b2f = f32(p.b2);
  const ref::Fp8Tensor w1q = ref::fp8_quant_weight(p.w1), w2q = ref::fp8_quant_weight(p.w2);

  // Step 4: X quantised per token (the gathered rows reuse it), W1 128x128; Z and A quantised 1x128.
  ref::Fp8Tensor zq, aq;
  ref::fp8_up_projection(ctx, act, ref::fp8_quant_rows(p.x), w1q, p.b1, m, &zq, aq);
  Tensor z = empty_f32({N, ZW}), a = empty_f32({N, I});
  up_projection(ctx, act, fq(p.x, 1, 128), w1f, b1f, m, z, a);
  expect_rows_quant_of(zq, z, "up-projection Z");
  expect_rows_quant_of(aq, a, "up-projection A");

  // Step 5 on A's FP8 copy and W2 128x128.
  Tensor y = empty_f32({N, H}), y_want = empty_f32({N, H});
  ref::fp8_down_projection(ctx, aq, w2q, p.b2, m, y);
  down_projection(ctx, fq(a, 1, 128), w2f, b2f, m, y_want);
  EXPECT_BITWISE(y, y_want, "down-projection Y");

  // Step 7: dO per token, W2^T (the same blocks), Z dequantised; dZ's FP8 copy 1x128.
  Tensor dz = empty_f32({N, ZW}), as = empty_f32({N, I}), ds = empty_f32({N});
  Tensor dz_w = empty_f32({N, ZW}), as_w = empty_f32({N, I}), ds_w = empty_f32({N});
  ref::Fp8Tensor dzq;
  ref::fp8_dgated(ctx, act, ref::fp8_quant_rows(p.d_out), w2q, p.b2, zq, r.pair_score, m, dz, dzq, as, ds);
  dgated(ctx, act, fq(p.d_out, 1, 128), w2f, b2f, fq(z, 1, 128), r.pair_score, m, dz_w, as_w, ds_w);
  EXPECT_BITWISE(dz, dz_w, "dgated dZ");
  EXPECT_BITWISE(as, as_w, "dgated As");
  EXPECT_BITWISE(ds, ds_w, "dgated dscore");
  expect_rows_quant_of(dzq, dz_w, "dgated dZ");

  // Step 10a: dZ's FP8 copy and W1^T (the same 128x128 blocks).
  Tensor dxe = empty_f32({N, H}), dxe_w = empty_f32({N, H});
  ref::fp8_expert_input_grad(ctx, dzq, w1q, m, dxe);
  expert_input_grad(ctx, fq(dz_w, 1, 128), w1f, m, dxe_w);
  EXPECT_BITWISE(dxe, dxe_w, "dXe");

  // Steps 8-9 in FP8: each expert's gathered rows quantised 128x1 (here by the 2-D core with 128x1 blocks, an
  // independent path from the stage's transposed-copy quantiser), then the bf16 stages with identity gathering.
  std::vector<std::int32_t> ident(static_cast<std::size_t>(N));
  std::iota(ident.begin(), ident.end(), 0);
  const Tensor row_expert = Tensor::empty({N}, DType::i32), sorted_score = empty_f32({N});
  const std::int32_t* off = m.offsets.ptr<const std::int32_t>();
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int32_t rr = off[e]; rr < off[e + 1]; ++rr) {
      row_expert.ptr<std::int32_t>()[rr] = static_cast<std::int32_t>(e);
      sorted_score.ptr<float>()[rr] = r.pair_score.ptr<const float>()[m.pair.ptr<const std::int32_t>()[rr]];
    }
  const RoutingMetadata mid = build_metadata(ctx, TensorView(ident.data(), DType::i32, {N}), row_expert, N, E);
  auto col_fq = [&](const TensorView& v, bool gathered) {  // [N, C] in row order, 128x1 per expert
    Tensor g = f32(v);
    if (gathered) g = naive::to_tensor([&] {
        naive::Vec all = naive::from_view(v), out;
        const std::int64_t C = v.shape[1];
        for (std::int64_t rr = 0; rr < N; ++rr) {
          const std::int64_t t = m.gather.ptr<const std::int32_t>()[rr];
          out.insert(out.end(), all.begin() + t * C, all.begin() + (t + 1) * C);
        }
        return out;
      }(), {N, v.shape[1]}, DType::f32);
    for (std::int64_t e = 0; e < E; ++e)
      ref::fp8_fake_quant_2d(g.ptr<float>() + off[e] * g.size(1), off[e + 1] - off[e], g.size(1), 128, 1);
    return g;
  };
  Tensor dw2 = empty_f32({E, H, I}), dw2_w = empty_f32({E, H, I}), dw1 = empty_f32({E, ZW, H}),
         dw1_w = empty_f32({E, ZW, H});
  Tensor db2, db2_w, db1, db1_w;
  if (bias) {
    db2 = empty_f32({E, H}), db2_w = empty_f32({E, H}), db1 = empty_f32({E, ZW}), db1_w = empty_f32({E, ZW});
  }
  ref::fp8_weight_grad_w2(ctx, p.d_out, as, r.pair_score, m, dw2, db2);
  weight_grad_w2(ctx, col_fq(p.d_out, true), col_fq(as, false), sorted_score, mid, dw2_w, db2_w);
  EXPECT_BITWISE(dw2, dw2_w, "FP8 dW2");
  ref::fp8_weight_grad_w1(ctx, dz, p.x, m, dw1, db1);
  weight_grad_w1(ctx, col_fq(dz, false), col_fq(p.x, true), mid, dw1_w, db1_w);
  EXPECT_BITWISE(dw1, dw1_w, "FP8 dW1");
  if (bias) {  // the bias gradients read the unquantised operands: the bf16 stages' bits
    Tensor scratch2 = empty_f32({E, H, I}), scratch1 = empty_f32({E, ZW, H});
    ref::weight_grad_w2(ctx, p.d_out, as, r.pair_score, m, scratch2, db2_w, GradWrite::store);
    ref::weight_grad_w1(ctx, dz, p.x, m, scratch1, db1_w, W1Layout::interleaved, GradWrite::store);
    EXPECT_BITWISE(db2, db2_w, "FP8 db2");
    EXPECT_BITWISE(db1, db1_w, "FP8 db1");
  }
}

INSTANTIATE_TEST_SUITE_P(Acts, Fp8Stages,
                         ::testing::Values(StageCase{Activation::swiglu, false}, StageCase{Activation::swiglu, true},
                                           StageCase{Activation::geglu, true}, StageCase{Activation::gelu, false},
                                           StageCase{Activation::relu_sq, true}),
                         [](const auto& info) {
                           return std::string(activation_name(info.param.act)) + (info.param.bias ? "_bias" : "");
                         });

}  // namespace

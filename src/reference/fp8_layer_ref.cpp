// The expert part of the layer under fp8_blockwise on the CPU reference backend: the stages of
// src/reference/fp8_layer_ref.h in the order of the GPU pipeline (DESIGN.md sections 2-3 and 9). Routing (steps
// 1-3) and the router backward (step 11) stay in src/moe/layer.cpp, unquantised, as under bf16.
#include "reference/fp8_layer_ref.h"

#include "moe/fp8_weights.h"
#include "reference/reference.h"

namespace sonicmoe::ref {

namespace {

// W1 and W2 128x128: the caller's pre-quantised ones (MoEWeights::fp8, checked) or quantised here. The backward's
// transposed operands read the same codes and scales.
struct WeightsQ {
  Fp8Tensor w1, w2;
};
WeightsQ weights_q(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w) {
  if (!w.fp8) return {fp8_quant_weight(w.w1), fp8_quant_weight(w.w2)};
  const Fp8ExpertWeights q = fp8_layer_weights(fn, ctx, cfg, w, /*transposed=*/false);
  const int b = static_cast<int>(kFp8BlockSize);
  return {{q.w1, q.w1_scale, b, b}, {q.w2, q.w2_scale, b, b}};
}

}  // namespace

Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, Tensor* z_fp8, Tensor* z_scale) {
  const std::int64_t T = x.shape[0], H = cfg.hidden_size, N = r.meta.num_pairs;
  const WeightsQ wq = weights_q(z_fp8 ? "moe_forward" : "moe_inference", ctx, cfg, w);
  Fp8Tensor aq;
  {
    Fp8Tensor zq;
    ref::fp8_up_projection(ctx, cfg.activation, fp8_quant_rows(x), wq.w1, w.b1, r.meta,
                           z_fp8 ? &zq : nullptr, aq);  // step 4: X once per token, W1 128x128
    if (z_fp8) {
      *z_fp8 = zq.q;
      *z_scale = zq.scale;
    }
  }
  Tensor y = Tensor::empty({N, H}, x.dtype);
  ref::fp8_down_projection(ctx, aq, wq.w2, w.b2, r.meta, y);  // step 5
  Tensor out = Tensor::empty({T, H}, x.dtype);
  ref::aggregate(ctx, y, r.pair_score, r.meta, out);  // step 6, as under bf16
  return out;
}

void fp8_experts_backward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const SavedState& saved, const TensorView& d_out, Gradients& g) {
  const Routing& r = saved.routing;
  const std::int64_t H = cfg.hidden_size, N = r.meta.num_pairs;
  const DType dt = x.dtype;
  const bool fp8_wgrad = cfg.weight_grad_precision == Precision::fp8_blockwise;
  const Fp8Tensor zq{saved.z_fp8, saved.z_scale, 1, static_cast<int>(kFp8BlockSize)};
  const WeightsQ wq = weights_q("moe_backward", ctx, cfg, w);
  Tensor dz = Tensor::empty({N, cfg.z_width()}, dt);
  Fp8Tensor dzq;
  {
    Tensor as = Tensor::empty({N, cfg.intermediate_size}, dt);
    ref::fp8_dgated(ctx, cfg.activation, fp8_quant_rows(d_out), wq.w2, w.b2, zq, r.pair_score,
                    r.meta, dz, dzq, as, g.dscore);  // step 7: dO once per token, W2^T 128x128
    if (fp8_wgrad) ref::fp8_weight_grad_w2(ctx, d_out, as, r.pair_score, r.meta, g.dw2, g.db2);  // step 8
    else ref::weight_grad_w2(ctx, d_out, as, r.pair_score, r.meta, g.dw2, g.db2);
  }
  {
    Tensor dxe = Tensor::empty({N, H}, dt);
    ref::fp8_expert_input_grad(ctx, dzq, wq.w1, r.meta, dxe);  // step 10a: W1^T 128x128
    ref::aggregate(ctx, dxe, TensorView(), r.meta, g.dx);                     // step 10b
  }
  if (fp8_wgrad) ref::fp8_weight_grad_w1(ctx, dz, x, r.meta, g.dw1, g.db1);  // step 9
  else ref::weight_grad_w1(ctx, dz, x, r.meta, g.dw1, g.db1, W1Layout::interleaved);  // (fp8: interleaved only)
}

}  // namespace sonicmoe::ref

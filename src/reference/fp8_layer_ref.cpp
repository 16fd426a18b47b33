// The expert part of the layer under fp8_blockwise on the CPU reference backend: the stages of
// src/reference/fp8_layer_ref.h in the order of the GPU pipeline (DESIGN.md sections 2-3 and 9). Routing (steps
// 1-3) and the router backward (step 11) stay in src/moe/layer.cpp, unquantised, as under bf16.
#include "reference/fp8_layer_ref.h"

#include <cstring>

#include "moe/fp8_weights.h"
#include "moe/grad_buffers.h"
#include "reference/reference.h"

namespace sonicmoe::ref {

namespace {

constexpr int kB = static_cast<int>(kFp8BlockSize);

// [E, R, C] -> [E, C, R] on the host, elements of `elem` bytes (the codes or the scales of a transposed copy).
Tensor transpose_last2(const Tensor& t) {
  const std::int64_t E = t.size(0), R = t.size(1), C = t.size(2);
  Tensor o = Tensor::empty({E, C, R}, t.dtype());
  const std::size_t b = dtype_size(t.dtype());
  const auto* a = static_cast<const unsigned char*>(t.data());
  auto* d = static_cast<unsigned char*>(o.data());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < R; ++i)
      for (std::int64_t j = 0; j < C; ++j)
        std::memcpy(d + ((e * C + j) * R + i) * b, a + ((e * R + i) * C + j) * b, b);
  return o;
}

// A weight W [E, N, K] as the stages take it (codes and scales in W's own layout), from its transposed copy
// (codes [E, K, N], scales [E, K/128, N/128]): the same codes and scales, moved back (exact).
Fp8Tensor from_transposed(const Tensor& q_t, const Tensor& s_t) {
  return {transpose_last2(q_t), transpose_last2(s_t), kB, kB};
}

}  // namespace

Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, SavedState* saved, const Fp8Rows* xq) {
  const std::int64_t T = x.shape[0], H = cfg.hidden_size, N = r.meta.num_pairs;
  const char* fn = saved ? "moe_forward" : "moe_inference";
  // W1 and W2 128x128: the caller's pre-quantised ones (MoEWeights::fp8, checked), or quantised here, with the
  // transposed copies in a training forward (one pass over each weight; the copies are kept for the backward; W2's
  // only where the backward reads it).
  const bool own = !w.fp8, keep_t = own && saved != nullptr;
  Fp8ExpertWeights q;
  if (own) {
    fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/true, keep_t, q);
    fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/false, keep_t, q);
  } else {
    q = fp8_layer_weights(fn, ctx, cfg, w, /*transposed=*/false);
  }
  const Fp8Tensor w1q{q.w1, q.w1_scale, kB, kB}, w2q{q.w2, q.w2_scale, kB, kB};
  Fp8Tensor aq;
  {
    Fp8Tensor zq;
    ref::fp8_up_projection(ctx, cfg.activation, xq ? fp8_rows_copy(*xq) : fp8_quant_rows(x), w1q, w.b1, r.meta,
                           saved ? &zq : nullptr, aq);  // step 4: X once per token, W1 128x128
    if (saved) {
      saved->z_fp8 = zq.q;
      saved->z_scale = zq.scale;
    }
  }
  Tensor y = Tensor::empty({N, H}, x.dtype);
  ref::fp8_down_projection(ctx, aq, w2q, w.b2, r.meta, y);  // step 5
  if (keep_t) {
    saved->w1_t_fp8 = q.w1_t;
    saved->w1_t_scale = q.w1_scale_t;
    saved->w2_t_fp8 = q.w2_t;
    saved->w2_t_scale = q.w2_scale_t;
  }
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
  const Fp8Tensor zq{saved.z_fp8, saved.z_scale, 1, kB};
  // W1^T and W2^T as the GPU reads them (the caller's, the forward's kept copies, or quantised here), handed to the
  // stages in W's layout: the stages read W^T from the same codes and scales.
  const Fp8ExpertWeights q = fp8_backward_weights("moe_backward", ctx, cfg, w, saved);
  Tensor dz = Tensor::empty({N, cfg.z_width()}, dt);
  Fp8Tensor dzq;
  {
    Tensor as = Tensor::empty({N, cfg.intermediate_size}, dt);
    if (cfg.dgated_precision == Precision::bf16)  // step 7 on the stored dO and W2
      ref::bf16_dgated_fp8_z(ctx, cfg.activation, d_out, w.w2, w.b2, zq, r.pair_score, r.meta, dz, dzq, as, g.dscore);
    else  // step 7: dO once per token, W2^T 128x128
      ref::fp8_dgated(ctx, cfg.activation, fp8_quant_rows(d_out), from_transposed(q.w2_t, q.w2_scale_t), w.b2, zq,
                      r.pair_score, r.meta, dz, dzq, as, g.dscore);
    const DwTarget d2 = alloc_dw2(ctx, cfg, dt, w, g);
    if (fp8_wgrad) ref::fp8_weight_grad_w2(ctx, d_out, as, r.pair_score, r.meta, d2.view, g.db2, d2.write);  // 8
    else ref::weight_grad_w2(ctx, d_out, as, r.pair_score, r.meta, d2.view, g.db2, d2.write);
  }
  g.dx = alloc_on(ctx, {x.shape[0], H}, dt);
  {
    Tensor dxe = Tensor::empty({N, H}, dt);
    ref::fp8_expert_input_grad(ctx, dzq, from_transposed(q.w1_t, q.w1_scale_t), r.meta, dxe);  // step 10a: W1^T
    ref::aggregate(ctx, dxe, TensorView(), r.meta, g.dx);                                     // step 10b
  }
  const DwTarget d1 = alloc_dw1(ctx, cfg, dt, w, g);
  if (fp8_wgrad) ref::fp8_weight_grad_w1(ctx, dz, x, r.meta, d1.view, g.db1, d1.write);  // step 9
  else ref::weight_grad_w1(ctx, dz, x, r.meta, d1.view, g.db1, W1Layout::interleaved, d1.write);  // (interleaved)
}

}  // namespace sonicmoe::ref

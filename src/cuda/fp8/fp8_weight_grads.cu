// The FP8 layer's weight gradients with FP8 operands (fp8_weight_grads.h).
#include "cuda/fp8/fp8_weight_grads.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "core/context_alloc.h"
#include "cuda/elementwise/expert_bias_grad.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/launch_util.h"
#include "cuda/quant/quant_segments.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

namespace {

using bf = __nv_bfloat16;

// One operand's K-major FP8 copy: codes [C, 128 capacity], scales [capacity, C].
struct SegmentCols {
  Tensor q, scale;
};

SegmentCols quantize_segments(const Context& ctx, const TensorView& v, const TensorView& gather,
                              const RoutingMetadata& meta, const Fp8Segments& seg) {
  const std::int64_t C = v.shape[1];
  SegmentCols c{alloc_on(ctx, {C, seg.capacity * kFp8BlockSize}, DType::f8e4m3),
                alloc_on(ctx, {seg.capacity, C}, DType::f32)};
  // The GEMM reads only the experts' blocks; those past block_offsets[E] stay unwritten and unread.
  fp8_quantize_segment_cols(ctx, v, gather, meta.offsets, seg.block_offsets, c.q, c.scale);
  return c;
}

void varlen_k(const Context& ctx, const RoutingMetadata& meta, const Fp8Segments& seg, const SegmentCols& a,
              const SegmentCols& b, const TensorView& dw, GradWrite dw_write) {
  gemm::Fp8VarlenK g;
  g.a = a.q.ptr<const std::uint8_t>();
  g.a_scale = a.scale.ptr<const float>();
  g.b = b.q.ptr<const std::uint8_t>();
  g.b_scale = b.scale.ptr<const float>();
  g.block_offsets = seg.block_offsets.ptr<const std::int32_t>();
  g.k_cap = seg.capacity * kFp8BlockSize;
  g.num_experts = static_cast<int>(meta.num_experts);
  g.m = static_cast<int>(a.q.size(0));
  g.n = static_cast<int>(b.q.size(0));
  if (dw_write == GradWrite::accumulate) g.d_f32 = dw.ptr<float>();
  else g.d = dw.ptr<bf>();
  g.stream = stream_of(ctx);
  gemm::fp8_varlen_k(g);
}

}  // namespace

Fp8Segments fp8_weight_grad_segments(const Context& ctx, const RoutingMetadata& meta) {
  Fp8Segments s{alloc_on(ctx, {meta.num_experts + 1}, DType::i32),
                fp8_segment_block_capacity(meta.num_pairs, meta.num_experts)};
  fp8_segment_block_offsets(ctx, meta.offsets, s.block_offsets);
  return s;
}

void fp8_weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as,
                        const TensorView& pair_score, const RoutingMetadata& meta, const Fp8Segments& seg,
                        const TensorView& dw2, const TensorView& db2, GradWrite dw_write) {
  {
    const SegmentCols dot = quantize_segments(ctx, d_out, meta.gather, meta, seg);  // [H, k_cap]
    const SegmentCols ast = quantize_segments(ctx, as, TensorView(), meta, seg);     // [I, k_cap]
    varlen_k(ctx, meta, seg, dot, ast, dw2, dw_write);
  }
  if (db2.given())
    expert_bias_grad(d_out.ptr<const bf>(), meta.gather.ptr<const std::int32_t>(), pair_score.ptr<const float>(),
                     meta.pair.ptr<const std::int32_t>(), meta.num_pairs, d_out.shape[1],
                     meta.offsets.ptr<const std::int32_t>(), static_cast<int>(meta.num_experts), db2.ptr<bf>(),
                     stream_of(ctx));
}

void fp8_weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                        const Fp8Segments& seg, const TensorView& dw1, const TensorView& db1, GradWrite dw_write) {
  {
    const SegmentCols dzt = quantize_segments(ctx, dz, TensorView(), meta, seg);  // [z_width, k_cap]
    const SegmentCols xt = quantize_segments(ctx, x, meta.gather, meta, seg);     // [H, k_cap]
    varlen_k(ctx, meta, seg, dzt, xt, dw1, dw_write);
  }
  if (db1.given())
    expert_bias_grad(dz.ptr<const bf>(), nullptr, nullptr, nullptr, meta.num_pairs, dz.shape[1],
                     meta.offsets.ptr<const std::int32_t>(), static_cast<int>(meta.num_experts), db1.ptr<bf>(),
                     stream_of(ctx));
}

}  // namespace sonicmoe::cuda

// Steps 8 and 9 of the FP8 layer with FP8 operands on the cuda backend (MoEConfig::weight_grad_precision =
// fp8_blockwise; the GPU counterpart of ref::fp8_weight_grad_w2 / fp8_weight_grad_w1, src/reference/fp8_layer_ref.h):
// both operands of each expert's GEMM quantised 128x1 along the token dimension into K-major copies
// (fp8_quantize_segment_cols: each expert's rows in whole 128-column blocks), then the FP8 varlen-K GEMM
// (fp8_varlen_k). The bias gradients from the unquantised operands, as the bf16 stages compute them. Arguments
// arrive checked by the layer (bf16 operands; dw bf16, or f32 with GradWrite::accumulate); launches on ctx.stream, no
// host synchronisation. The FP8 copies are transient (the context's allocator), dropped after the GEMM.
#pragma once

#include "sonicmoe/moe.h"

namespace sonicmoe::cuda {

// The experts' 128-row blocks of the routing (block_offsets int32 [E + 1], fp8_segment_block_offsets) and the blocks
// the copies hold: made once per backward, read by both weight gradients.
struct Fp8Segments {
  Tensor block_offsets;
  std::int64_t capacity = 0;
};
Fp8Segments fp8_weight_grad_segments(const Context& ctx, const RoutingMetadata& meta);

// dW2[e] = sum over rows r of e of dOq[gather[r]]^T Asq[r]; db2[e] = sum s[pair[r]] dO[gather[r]].
void fp8_weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as,
                        const TensorView& pair_score, const RoutingMetadata& meta, const Fp8Segments& seg,
                        const TensorView& dw2, const TensorView& db2, GradWrite dw_write);
// dW1[e] = sum over rows r of e of dZq[r]^T Xq[gather[r]]; db1[e] = sum dZ[r].
void fp8_weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                        const Fp8Segments& seg, const TensorView& dw1, const TensorView& db1, GradWrite dw_write);

}  // namespace sonicmoe::cuda

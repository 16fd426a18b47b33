// The expert part of the layer under MoEConfig::precision = fp8_blockwise on the cuda backend (steps 4-10; DESIGN.md
// section 9, docs/ALGORITHM.md "FP8 blockwise recipe"): the GPU counterpart of ref::fp8_experts_forward /
// fp8_experts_backward (src/reference/fp8_layer_ref.h), stage for stage, on the FP8 varlen-M GEMMs
// (src/cuda/gemm/fp8_gemm.h), the FP8 quantisers (src/cuda/quant/) and the bf16 stages where the recipe keeps bf16
// (aggregation, bf16 weight gradients). Routing (steps 1-3) and the router backward (step 11) stay in
// src/moe/layer.cpp. Arguments arrive checked by the layer; every launch is on ctx.stream, no host synchronisation
// (CUDA-graph capturable wherever the routing is).
#pragma once

#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

// Steps 4-6: returns O [T, H] (bf16). W1 / W2 from w.fp8 when given, else quantised here, each just before its
// GEMM. When saved is given (training), the saved Z (1x128 codes [N, z_width] and scales [N, z_width / 128]) is
// stored there, and, when the weights were quantised here, their transposed copies from the same pass
// (SavedState::w1_t_fp8 ...); inference quantises the forward copies only. xq: X already quantised 1x128 (checked
// by the caller), used instead of quantising x, whose data is then not read (its shape and dtype are).
Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, SavedState* saved, const Fp8Rows* xq = nullptr);

// Steps 7-10 (W1^T, W2^T: w.fp8, else saved's copies, else quantised here): fills g.dscore (allocated by the
// caller) and allocates and fills g.dw2, g.db2, g.dx (the experts' part), g.dw1, g.db1, each at the step that writes
// it (src/moe/grad_buffers.h). The dgated epilogue reads the saved FP8 Z itself; with reuse_z (the consuming
// moe_backward: the caller gives Z up) it writes dZ's 1x128 codes and scales over saved.z_fp8 / z_scale (each lane
// reads its Z words and its block's scale before it writes dZ's there), one [N, z_width] FP8 buffer fewer at the peak.
// Weight gradients by cfg.weight_grad_precision: bf16 operands (the bf16 stages), or FP8 ones (fp8_weight_grads.h).
void fp8_experts_backward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const SavedState& saved, const TensorView& d_out, Gradients& g, bool reuse_z = false);

}  // namespace sonicmoe::cuda

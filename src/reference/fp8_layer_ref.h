// The FP8 blockwise layer on the CPU reference backend (MoEConfig::precision = fp8_blockwise; docs/ALGORITHM.md,
// "FP8 blockwise recipe", and DESIGN.md section 9). One function per stage of the GPU pipeline the FP8 layer will
// run, so that each FP8 GPU stage has a reference to be checked against alone. Each stage takes its FP8 operands as
// codes + scales (the bytes the GPU reads), dequantises them exactly to fp32 (ref::fp8_dequantize), and runs the
// bf16 reference stage (src/reference/expert_ref.cpp) on those fp32 operands: fp32 accumulation, outputs rounded
// to their storage dtype where the GPU stores them. Outputs that the next stage reads in FP8 are quantised from the
// fp32 epilogue values (as a fused epilogue would). Quantisers: src/reference/fp8_ref.cpp. Arguments arrive
// validated (the layer checks its inputs; H and I are multiples of 128).
#pragma once

#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::ref {

// An FP8 operand: e4m3 codes and one fp32 power-of-two scale per block_rows x block_cols block.
struct Fp8Tensor {
  Tensor q;      // f8e4m3 [..., R, C]
  Tensor scale;  // f32 [..., ceil(R / block_rows), ceil(C / block_cols)]
  int block_rows = 1, block_cols = 128;
  Tensor dequantize() const;  // f32 [..., R, C], exact
};

// 1x128 quantisation of the rows of x [M, C] (bf16 or f32) via ref::fp8_quantize_rows.
Fp8Tensor fp8_quant_rows(const TensorView& x);
// Rows the caller quantised 1x128 (codes and scales copied).
Fp8Tensor fp8_rows_copy(const Fp8Rows& rows);
// 128x128 quantisation of a weight [E, N, K] via ref::fp8_quantize_blocks. The same codes and scales serve the
// transposed operand W^T (the GPU's K-major copy), so the stages below read W^T from this too.
Fp8Tensor fp8_quant_weight(const TensorView& w);

// Step 4. xq: X quantised once per token (1x128, [T, H]); the gathered rows reuse their token's quantised row.
// w1q: W1 128x128. Z = Xq[gather] W1q^T (+ b1) in fp32, A = act(Z) from the fp32 Z. Writes A quantised 1x128
// ([N, I], the operand of the down-projection) and, when z_out is given, Z quantised 1x128 ([N, z_width], the
// state saved for the backward).
void fp8_up_projection(const Context& ctx, Activation act, const Fp8Tensor& xq, const Fp8Tensor& w1q,
                       const TensorView& b1, const RoutingMetadata& meta, Fp8Tensor* z_out, Fp8Tensor& a_out);
// Step 5. Y = Aq W2q^T (+ b2), y [N, H] in its own dtype (bf16 or f32).
void fp8_down_projection(const Context& ctx, const Fp8Tensor& aq, const Fp8Tensor& w2q, const TensorView& b2,
                         const RoutingMetadata& meta, const TensorView& y);
// Step 7. doq: dO quantised once per token (1x128, [T, H]), rows gathered; w2q: W2 128x128 (read as W2^T);
// zq: the saved Z (1x128), dequantised, A recomputed from it. G = dOq[gather] W2q, dscore = <G, A> (+ <dOq, b2>),
// dZ = act'(Z) applied to s*G, As = s*A. Writes dz and as in their dtype, and dZ quantised 1x128 from the fp32
// values into dz_out (the operand of step 10a).
void fp8_dgated(const Context& ctx, Activation act, const Fp8Tensor& doq, const Fp8Tensor& w2q, const TensorView& b2,
                const Fp8Tensor& zq, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,
                Fp8Tensor& dz_out, const TensorView& as, const TensorView& dscore);
// Step 7 with unquantised operands (MoEConfig::dgated_precision = bf16): fp8_dgated on the stored d_out [T, H] and
// W2 [E, H, I] (input dtype), the saved Z still read in FP8; the same outputs.
void bf16_dgated_fp8_z(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                       const TensorView& b2, const Fp8Tensor& zq, const TensorView& pair_score,
                       const RoutingMetadata& meta, const TensorView& dz, Fp8Tensor& dz_out, const TensorView& as,
                       const TensorView& dscore);
// Step 10a. dXe = dZq W1q (W1^T's copy: the same 128x128 codes and scales), dxe [N, H] in its dtype.
void fp8_expert_input_grad(const Context& ctx, const Fp8Tensor& dzq, const Fp8Tensor& w1q,
                           const RoutingMetadata& meta, const TensorView& dxe);
// Steps 8 and 9 with FP8 operands (MoEConfig::weight_grad_precision = fp8_blockwise): both operands of each
// expert's GEMM quantised 128x1 along the token dimension (ref::fp8_quantize_cols_transposed on the expert's rows:
// the K-major transposed copy the GPU reads; blocks start at the expert's first row, a partial last block has its
// own scale), gathered rows (dO, X) gathered first. dW2 = dOq^T Asq, dW1 = dZq^T Xq; the bias gradients from the
// unquantised operands, as the bf16 stages: db2 = sum s dO, db1 = sum dZ.
// The inputs are the stored (unquantised) d_out, as, dz and x, as for the bf16 stages.
void fp8_weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as,
                        const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dw2,
                        const TensorView& db2, GradWrite dw_write = GradWrite::store);
void fp8_weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                        const TensorView& dw1, const TensorView& db1, GradWrite dw_write = GradWrite::store);

// The layer's expert part under fp8_blockwise, stage by stage, taking its weights as the cuda FP8 layer does
// (src/moe/fp8_weights.h). Forward (steps 4-6): returns O [T, H] in x's dtype; when saved is given (training),
// stores the saved Z (codes, scales) there and, when it quantised W1 / W2 itself (no w.fp8), their transposed
// copies from the same pass. Backward (steps 7-10): W1^T / W2^T from w.fp8, else the forward's copies in saved,
// else quantised in the call; fills g.dscore (allocated by the caller) and allocates and fills g.dw2, g.db2, g.dx
// (the experts' part, before the router's step 11b adds to it), g.dw1, g.db1 in the cuda backend's order
// (src/moe/grad_buffers.h); weight gradients by cfg.weight_grad_precision (bf16: the bf16 stages on the
// unquantised operands).
// xq: X already quantised 1x128 (checked by the caller), used instead of quantising x, whose data is then not read.
Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, SavedState* saved, const Fp8Rows* xq = nullptr);
void fp8_experts_backward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const SavedState& saved, const TensorView& d_out, Gradients& g);

}  // namespace sonicmoe::ref

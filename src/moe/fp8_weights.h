// The FP8 layer's expert weights (Fp8ExpertWeights, sonicmoe/quant.h): quantised in the call, the caller's
// pre-quantised ones (MoEWeights::fp8) after a check of their shapes, dtypes and device, or the transposed copies the
// training forward kept in its saved state. Shared by the cpu reference and the cuda FP8 layer, so that both take
// the same weights in the same cases.
#pragma once

#include "sonicmoe/quant.h"

namespace sonicmoe {

// The weights the FP8 layer uses in `fn`: *w.fp8 (checked against cfg, `transposed`: its transposed copies and
// scales are needed too) or, when not given, fp8_quantize_expert_weights(ctx, cfg, w, transposed).
Fp8ExpertWeights fp8_layer_weights(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                   bool transposed);

// One weight quantised in the call: W1 (w1 = true) or W2 into that weight's members of q (codes, scales and, when
// `transposed` and the backward under cfg reads it (W1^T always, W2^T where fp8_backward_reads_w2_t), the transposed
// copy and its scales from the same pass). fp8_quantize_expert_weights is both calls; the forward quantises W2 only
// after W1's forward copy is dropped.
void fp8_quantize_layer_weight(const Context& ctx, const MoEConfig& cfg, const MoEWeights& w, bool w1,
                               bool transposed, Fp8ExpertWeights& q);

// The backward's weight operands, the transposed copies (w1_t, w1_scale_t and, where fp8_backward_reads_w2_t,
// w2_t, w2_scale_t; the others are left undefined): the caller's w.fp8 when given; else the ones the forward kept in
// `saved` (checked); else (a state from elsewhere without them) quantised in the call.
Fp8ExpertWeights fp8_backward_weights(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                      const SavedState& saved);

// Whether the FP8 backward reads W2's transposed copy: only the dgated GEMM on FP8 operands does (MoEConfig::
// dgated_precision fp8_blockwise); otherwise the training forward does not make it, and the checks of the caller's
// or the saved copies skip it.
bool fp8_backward_reads_w2_t(const MoEConfig& cfg);

// Whether the backward of `saved` quantises the weights itself (neither w.fp8 nor saved copies): the memory guard.
bool fp8_backward_quantises(const MoEWeights& w, const SavedState& saved);

}  // namespace sonicmoe

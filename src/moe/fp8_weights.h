// The FP8 layer's expert weights (Fp8ExpertWeights, sonicmoe/quant.h): quantised in the call, or the caller's
// pre-quantised ones (MoEWeights::fp8) after a check of their shapes, dtypes and device. Shared by the cpu reference
// and the cuda FP8 layer.
#pragma once

#include "sonicmoe/quant.h"

namespace sonicmoe {

// The weights the FP8 layer uses in `fn`: *w.fp8 (checked against cfg, `transposed`: its transposed copies and
// scales are needed too) or, when not given, fp8_quantize_expert_weights(ctx, cfg, w, transposed).
Fp8ExpertWeights fp8_layer_weights(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                   bool transposed);

}  // namespace sonicmoe

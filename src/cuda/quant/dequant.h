// FP8 helpers of the cuda backend's FP8 layer (src/cuda/fp8/fp8_layer.cu) beside the quantisers: dequantisation of
// 1x128 rows back to bf16 (the saved Z for the dgated epilogue, step 7) and the transpose of a 128x128 scale grid
// (the scales of a weight's transposed copy). Launched on ctx.stream, no host synchronisation; arguments are checked
// by the callers (contiguous, on the context's device, of the shapes below).
#pragma once

#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

// out[r, c] = bf16(decode(q[r, c]) * scale[r, c / 128]): q f8e4m3 [M, C] (C a multiple of 16), scale f32
// [M, ceil(C / 128)], out bf16 [M, C]. decode * scale is exact in fp32 (a power-of-two scale), so out is the CPU
// dequantiser's value rounded once to bf16 (exact unless the value lies below bf16's normal range); a NaN block
// gives NaN.
void fp8_dequantize_rows_bf16(const Context& ctx, const TensorView& q, const TensorView& scale, const TensorView& out);

// s_t[e, j, i] = s[e, i, j]: s f32 [E, R, C] -> s_t f32 [E, C, R].
void fp8_transpose_scales(const Context& ctx, const TensorView& s, const TensorView& s_t);

}  // namespace sonicmoe::cuda

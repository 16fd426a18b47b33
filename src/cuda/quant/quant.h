// The cuda backend's FP8 quantisers (include/sonicmoe/quant.h; arguments arrive validated by src/moe/quant.cpp).
// They launch on ctx.stream and never synchronise the host. Kernels: quant_rows.cu (1x128, optionally gathered),
// quant_transpose.cu (128x1 into a transposed copy; 128x128 with both copies), sharing quant_common.cuh.
#pragma once

#include "sonicmoe/detail/quant_list.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

SONICMOE_QUANT_LIST(SONICMOE_DECLARE_QUANT)

// X [T, K] bf16 quantised 1x128 once per token, written in the routing's row order: q [N, K] codes and scale
// [N, K / 128], row rev[p] of every pair p of token t (pairs [token_offsets[t], token_offsets[t + 1]); rev[p] = -1: no
// row) holds token t's blocks, bitwise fp8_quantize_rows of x gathered by the routing. Rows no pair writes (a capacity's
// dropped rows past offsets[E]) are left as they are. The FP8 layer's up-projection operand (fp8_layer.cu).
void fp8_quantize_rows_scatter(const Context& ctx, const TensorView& x, const TensorView& token_offsets,
                               const TensorView& rev, const TensorView& q, const TensorView& scale);

}  // namespace sonicmoe::cuda

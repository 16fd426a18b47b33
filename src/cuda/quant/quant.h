// The cuda backend's FP8 quantisers (include/sonicmoe/quant.h; arguments arrive validated by src/moe/quant.cpp).
// They launch on ctx.stream and never synchronise the host. Kernels: quant_rows.cu (1x128, optionally gathered),
// quant_transpose.cu (128x1 into a transposed copy; 128x128 with both copies), sharing quant_common.cuh.
#pragma once

#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

void fp8_quantize_rows(const Context& ctx, const TensorView& x, const TensorView& rows, const TensorView& q,
                       const TensorView& scale);
void fp8_quantize_cols_transposed(const Context& ctx, const TensorView& x, const TensorView& q_t,
                                  const TensorView& scale_t);
void fp8_quantize_blocks(const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t,
                         const TensorView& scale);

}  // namespace sonicmoe::cuda

// The FP8 quantisers, listed once: X(return type, name, (parameters)) for every entry of include/sonicmoe/quant.h
// that each backend implements. The backends' headers (src/reference/fp8_ref.h, src/cuda/quant/quant.h) declare their
// functions from it, and src/moe/quant.cpp checks the documented declarations of quant.h against it.
#pragma once

#include "sonicmoe/moe.h"

#define SONICMOE_QUANT_LIST(X)                                                                                     \
  X(void, fp8_quantize_rows,                                                                                       \
    (const Context& ctx, const TensorView& x, const TensorView& rows, const TensorView& q, const TensorView& scale)) \
  X(void, fp8_quantize_cols_transposed,                                                                            \
    (const Context& ctx, const TensorView& x, const TensorView& q_t, const TensorView& scale_t))                   \
  X(void, fp8_quantize_blocks,                                                                                     \
    (const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t, const TensorView& scale))

// Declares one entry (the backends' headers expand the list with it).
#define SONICMOE_DECLARE_QUANT(ret, name, params) ret name params;

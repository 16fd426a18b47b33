// CPU reference of the FP8 blockwise recipe (docs/ALGORITHM.md, "FP8 blockwise recipe"): the quantisers behind the
// public entries of include/sonicmoe/quant.h (arguments arrive validated by src/moe/quant.cpp), dequantisation, and
// fake quantisation (quantise + dequantise in fp32) for the FP8 layer's reference. Bitwise what the CUDA quantisers
// (src/cuda/quant/) write.
#pragma once

#include <cstdint>
#include <vector>

#include "sonicmoe/detail/quant_list.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::ref {

// The public quantisers (include/sonicmoe/quant.h), same arguments.
SONICMOE_QUANT_LIST(SONICMOE_DECLARE_QUANT)

// The core: a [R, C] fp32 matrix quantised in blocks of block_rows x block_cols (1x128, 128x1, 128x128; partial
// blocks at the edges): q [R, C] e4m3 codes, scale [ceil(R / block_rows), ceil(C / block_cols)].
void fp8_quantize_2d(const float* x, std::int64_t R, std::int64_t C, int block_rows, int block_cols, std::uint8_t* q,
                     float* scale);
// out[r, c] = decode(q[r, c]) * scale[r / block_rows, c / block_cols] (exact in fp32 except past FLT_MAX).
void fp8_dequantize_2d(const std::uint8_t* q, const float* scale, std::int64_t R, std::int64_t C, int block_rows,
                       int block_cols, float* out);
// Quantise then dequantise in place: what an FP8 operand of this blocking contributes to a GEMM.
void fp8_fake_quant_2d(float* x, std::int64_t R, std::int64_t C, int block_rows, int block_cols);

// The same on tensors (host, contiguous): x bf16 or f32 of shape [..., R, C] (leading dimensions are independent
// matrices, e.g. experts), returned in f32. dequantize: q f8e4m3 [..., R, C], scale f32 [..., ceil(R/br), ceil(C/bc)].
Tensor fp8_fake_quant(const TensorView& x, int block_rows, int block_cols);
Tensor fp8_dequantize(const TensorView& q, const TensorView& scale, int block_rows, int block_cols);

}  // namespace sonicmoe::ref

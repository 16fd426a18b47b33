// The per-expert 128x1 quantiser of the FP8 weight gradients' operands (kernels in quant_transpose.cu; the GEMM that
// reads them: fp8_varlen_k, src/cuda/gemm/fp8_gemm.h). Each expert's rows (token-major activations, gathered or not)
// go transposed into whole blocks of 128 columns, so that every k-block of the GEMM lies inside one expert: expert e
// owns blocks [block_offsets[e], block_offsets[e+1]), block_offsets[e+1] - block_offsets[e] = ceil(rows of e / 128),
// its last block zero-padded. The codes and scales of each block are bitwise fp8_quantize_cols_transposed of the
// expert's rows (a partial block has its own scale; the padding is zero and changes no amax), as the CPU reference
// quantises them (src/reference/fp8_stages_ref.cpp). Launch on ctx's stream, no host synchronisation. Internal to the
// cuda backend: the callers (src/cuda/fp8/fp8_weight_grads.cu) pass checked, contiguous tensors.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::cuda {

// Blocks a [C, 128 * capacity] copy needs for `rows` rows over `num_experts` segments: ceil(rows / 128) + E.
std::int64_t fp8_segment_block_capacity(std::int64_t rows, std::int64_t num_experts);

// block_offsets int32 [E + 1] from offsets int32 [E + 1] (the routing's row ranges), on the device.
void fp8_segment_block_offsets(const Context& ctx, const TensorView& offsets, const TensorView& block_offsets);

// x [*, C] (bf16 or f32); gather int32 [N] or not given (row r is x[r]); offsets / block_offsets [E + 1];
// q_t f8e4m3 [C, 128 * capacity], scale_t f32 [capacity, C] (one row of C scales a block). Blocks past
// block_offsets[E] are not written.
void fp8_quantize_segment_cols(const Context& ctx, const TensorView& x, const TensorView& gather,
                               const TensorView& offsets, const TensorView& block_offsets, const TensorView& q_t,
                               const TensorView& scale_t);

}  // namespace sonicmoe::cuda

// FP8 blockwise quantisation (docs/ALGORITHM.md, "FP8 blockwise recipe"): e4m3 values (DType::f8e4m3) with one fp32
// power-of-two scale per block, x ~= decode(q) * scale. Activations use 1x128 blocks (a row, 128 consecutive
// channels), weights 128x128 blocks; a block cut by the end of a dimension is a partial block with its own scale.
// A block holding a NaN or an infinity stores NaN: every code 0x7f and a NaN scale.
//
// Every call validates its arguments (Error naming the argument) and runs on ctx's backend: the CPU reference
// (src/reference/fp8_ref.cpp) or the CUDA kernels (src/cuda/quant/, on ctx.stream, no host synchronisation), bitwise
// equal. Inputs bf16 or f32; outputs f8e4m3 codes and f32 scales, contiguous. The CUDA backend needs 16-byte aligned
// pointers and each FP8 output's rows a multiple of 16 bytes (K, and M or N for the transposed copies, multiples of
// 16: the rows TMA reads in the FP8 GEMMs). The entries are listed once more in sonicmoe/detail/quant_list.h, from
// which both backends declare theirs.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe {

constexpr std::int64_t kFp8BlockSize = 128;
// Number of blocks covering n elements (a partial last block counts).
constexpr std::int64_t fp8_num_blocks(std::int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }

// Rows quantised 1x128 by the caller (DeepEP's FP8 dispatch: moe_forward_deepep_fp8, sonicmoe/dispatched.h): codes
// f8e4m3 [M, K] and one f32 scale per row and 128 channels, [M, ceil(K/128)]; x ~= decode(q) * scale. The scales may
// be any positive finite values (this library's quantisers write powers of two, DeepEP's amax / 448).
struct Fp8Rows {
  TensorView q;
  TensorView scale;
};

// 1x128 (activations): x [T, K]; rows: int32 [M] (q's row i quantises x[rows[i]]: the rows gathered as the grouped
// GEMMs gather them) or not given (M = T, row i is x[i]); q f8e4m3 [M, K]; scale f32 [M, ceil(K/128)].
// rows must lie in [0, T): checked on the CPU backend; on the GPU an out-of-range row is stored as a NaN row.
void fp8_quantize_rows(const Context& ctx, const TensorView& x, const TensorView& rows, const TensorView& q,
                       const TensorView& scale);

// The values of rows quantised 1x128 (this library's or the caller's, e.g. DeepEP's): out[m, k] = decode(q[m, k]) *
// scale[m, k / 128], the product in fp32, then one rounding to out's dtype. q f8e4m3 [M, K], scale f32
// [M, ceil(K/128)], out [M, K]: bf16 on the cuda backend (K a multiple of 16), bf16 or f32 on the cpu one. A block
// with a NaN scale gives NaN.
void fp8_dequantize_rows(const Context& ctx, const TensorView& q, const TensorView& scale, const TensorView& out);

// 128x1 with a transposed, K-major result (the operand of a GEMM reducing over M, e.g. weight gradients):
// x [M, K] -> q_t f8e4m3 [K, M], scale_t f32 [K, ceil(M/128)]; q_t[k, m] is x[m, k] scaled by its column's block
// scale_t[k, m / 128]. Equivalently: the 1x128 quantisation of x^T.
void fp8_quantize_cols_transposed(const Context& ctx, const TensorView& x, const TensorView& q_t,
                                  const TensorView& scale_t);

// 128x128 (weights): w [E, N, K] -> q f8e4m3 [E, N, K], scale f32 [E, ceil(N/128), ceil(K/128)], and when q_t is
// given the transposed copy q_t [E, K, N] (q_t[e, k, n] == q[e, n, k]; the same scales, read as
// scale[e, n / 128, k / 128]), both from one pass over w.
void fp8_quantize_blocks(const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t,
                         const TensorView& scale);

// The expert weights of the FP8 layer, quantised 128x128 (issue 27 item 6: quantised once per optimizer step and
// reused across micro-batches). Made by fp8_quantize_expert_weights; passed to the layer through
// MoEWeights::fp8, which then skips quantising W1 / W2 itself (the caller keeps these in step with w1 / w2: a cache
// keyed on the weights' storage and version, as the binding can). Each weight W [E, N, K] has its codes, its
// transposed copy [E, K, N] (the K-major operand of the backward's GEMMs: the same codes transposed), its scales
// [E, N/128, K/128] and the same scales transposed, [E, K/128, N/128] (the scale grid of the transposed copy).
struct Fp8ExpertWeights {
  Tensor w1, w1_t, w1_scale, w1_scale_t;  // W1 [E, z_width, H]: f8e4m3 [E, z_width, H], [E, H, z_width]; f32 scales
  Tensor w2, w2_t, w2_scale, w2_scale_t;  // W2 [E, H, I]: f8e4m3 [E, H, I], [E, I, H]; f32 scales
};

// Quantises w.w1 and w.w2 (of cfg's shapes; H and I multiples of 128) on ctx's backend, with the transposed copies
// the backward under cfg reads when `transposed` (a forward-only caller can skip them): W1^T always, W2^T only for
// the dgated GEMM on FP8 operands (cfg.dgated_precision fp8_blockwise; otherwise w2_t / w2_scale_t stay undefined).
// Bitwise what the layer computes itself.
Fp8ExpertWeights fp8_quantize_expert_weights(const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                             bool transposed = true);

}  // namespace sonicmoe

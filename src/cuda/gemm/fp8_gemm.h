// Host entry points of the FP8 blockwise varlen-M GEMM on Hopper (DESIGN.md section 9; the recipe:
// docs/ALGORITHM.md, "FP8 blockwise recipe"). The same contract as the bf16 native varlen-M GEMM
// (native_gemm.h) with FP8 e4m3 operands and fp32 power-of-two block scales:
//   C[r] = sum over k-blocks kb of (A_q[g(r), kb] . B_q[e(r), :, kb]^T) * a_scale[g(r), kb] * b_scale[e(r), n/128, kb]
// accumulated in fp32 (the wgmma accumulator of one 128-deep k-block promoted into an fp32 accumulator with the
// two scales), then handed to the same epilogue policies as the bf16 kernel (bias, row scale, activation, dgated).
// A is read K-major (rows of k codes), B K-major ([E, n, k]): the transposed weight operands come from the
// transposed copies of fp8_quantize_blocks (include/sonicmoe/quant.h). Arguments are validated by the callers;
// these pick the instantiation and launch on `stream`, never synchronising the host (group sizes are read from
// `offsets` on the device).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/native_gemm.h"
#include "sonicmoe/types.h"

namespace sonicmoe::cuda::gemm {

struct Fp8VarlenM {
  const std::uint8_t* a = nullptr;  // e4m3 codes [a_rows, k]
  const float* a_scale = nullptr;   // [a_rows, k / 128] (1x128 blocks; indexed by the gathered row)
  std::int64_t a_rows = 0;
  const std::int32_t* gather = nullptr;  // [rows] or null (contiguous A)
  const std::uint8_t* b = nullptr;       // e4m3 codes [E, n, k]
  const float* b_scale = nullptr;        // [E, ceil(n / 128), k / 128] (128x128 blocks)
  const std::int32_t* offsets = nullptr;  // device [E + 1]
  std::int64_t rows = 0;                  // capacity of C / gather
  int num_experts = 0, n = 0, k = 0;      // k a multiple of 128
  cudaStream_t stream = nullptr;
};

// C = bf16((A B^T + bias[e]) * row_scale[r]) [rows, n]; bias / row_scale may be null.
void fp8_varlen_m_store(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale);

// A [rows, n] output of the epilogues in bf16, as its 1x128 FP8 codes with their scales (bitwise fp8_quantize_rows of
// the bf16 values; n a multiple of 128), both, or neither: the up-projection's Z, dgated's dZ.
struct Fp8ZOut {
  __nv_bfloat16* z = nullptr;  // [rows, n]
  std::uint8_t* q = nullptr;   // e4m3 codes [rows, n]
  float* scale = nullptr;      // [rows, n / 128]
};

// Up-projection (step 4): Z as `z` asks, A_out = act(Z) [rows, n/2 (GLU) or n] in bf16. A's rows gathered (g.gather:
// the 128 x 128 tile) or already in the routing's order (the 128 x 256 tile, A by TMA).
void fp8_varlen_m_activation(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, const Fp8ZOut& z,
                             __nv_bfloat16* a_out);

// The saved Z as dgated reads it: 1x128 codes [rows, z_width] and scales [rows, z_width / 128].
struct Fp8ZIn {
  const std::uint8_t* q = nullptr;
  const float* scale = nullptr;
};

// dgated (step 7) with G = A B^T from FP8 operands (B = the transposed copy of W2, [E, I, H]): the bf16 kernel's
// formulas (native_gemm.h, native_varlen_m_dgated) on Z dequantised in the epilogue (bitwise
// fp8_dequantize_rows_bf16; epilogue_fp8_dgated_sm90.cuh). dZ [rows, z_width] leaves in bf16 (dz.z, required) and,
// where dz.q is given, as its 1x128 codes and scales; as [rows, n] or null; ds_partial [fp8_dgated_n_tiles(n) * rows],
// reduced by dgated_score_reduce. z_width (2n for GLU, n otherwise) a multiple of 128.
void fp8_varlen_m_dgated(const Fp8VarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                         const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial);
// N tiles of the FP8 dgated kernel (one ds partial per row per N tile).
int fp8_dgated_n_tiles(int n);

// dgated (step 7) of the FP8 layer on bf16 operands (MoEConfig::dgated_precision bf16): G = A B^T by the native
// kernel of native_varlen_m_dgated (native_gemm.h: g.a = dO [T, H] with rows gathered, g.b = W2 [E, H, I] read as
// [E, k, n], g.b_kn, bf16), with fp8_varlen_m_dgated's epilogue (Z read as 1x128 codes, dZ out in bf16 and, where
// dz.q is given, as codes). ds_partial [native_dgated_n_tiles(n) * rows], reduced by dgated_score_reduce.
void bf16_varlen_m_dgated_fp8z(const NativeVarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                               const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial);

// The FP8 varlen-K GEMM (fp8_varlen_k.cu; the weight gradients with FP8 operands): per expert e,
//   D[e] = sum over k-blocks kb in [block_offsets[e], block_offsets[e+1]) of
//          (A[:, kb] . B[:, kb]^T) * a_scale[kb, row] * b_scale[kb, col]
// accumulated in fp32, D [E, m, n] stored in bf16 (d) or added into fp32 (d_f32). A [m, k_cap] and B [n, k_cap]
// are e4m3 codes, K-major: each expert's token rows transposed and padded to whole 128-column blocks
// (fp8_quantize_segment_cols, src/cuda/quant/quant_segments.h), one scale per (k-block, row) and (k-block, column).
// m, n, k_cap multiples of 128; the offsets are read on the device (clamped to k_cap / 128); no host sync.
struct Fp8VarlenK {
  const std::uint8_t* a = nullptr;  // [m, k_cap]
  const float* a_scale = nullptr;   // [k_cap / 128, m]
  const std::uint8_t* b = nullptr;  // [n, k_cap]
  const float* b_scale = nullptr;   // [k_cap / 128, n]
  const std::int32_t* block_offsets = nullptr;  // device [E + 1], in 128-column blocks
  std::int64_t k_cap = 0;
  int num_experts = 0, m = 0, n = 0;
  __nv_bfloat16* d = nullptr;  // [E, m, n], or
  float* d_f32 = nullptr;      // [E, m, n], added into
  cudaStream_t stream = nullptr;
};
void fp8_varlen_k(const Fp8VarlenK& g);

}  // namespace sonicmoe::cuda::gemm

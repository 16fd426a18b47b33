// Host entry points of the native Hopper varlen-M GEMM (kernel_sm90_varlen_m.cuh): one persistent
// warp-specialised wgmma kernel whose A rows may be gathered in the mainloop, with the MoE epilogues fused;
// and of the native varlen-K GEMM (kernel_sm90_varlen_k.cuh) of the weight gradients. NativeVarlenM / NativeVarlenK
// are the one argument struct of each family: the stages (moe_gemms.cu) fill them, the launchers read them.
// Arguments arrive validated (src/moe/stages.cpp and cuda_limits.h); these only pick the instantiation
// (native_gemm.cu, by heuristics.h) and launch on `stream`. No host synchronisation: group sizes are read from
// `offsets` on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_limits.h"
#include "cuda/gemm/heuristics.h"
#include "sonicmoe/types.h"

namespace sonicmoe::cuda::gemm {

// The scheduler keeps offsets and a tile prefix per expert in shared memory (cuda_limits.h).
inline constexpr int kNativeMaxExperts = kGemmMaxExperts;

// The operands and outputs of both families hold 16-bit codes of `elem` (bf16 or f16: the same kernels instantiated
// twice, wgmma F32BF16BF16 / F32F16F16); the pointers are typed __nv_bfloat16 for both.

// C[r] = A[g(r)] . B[e(r)]^T over rows r < offsets[E] (g = gather or identity).
struct NativeVarlenM {
  DType elem = DType::bf16;          // bf16 or f16: A, B, C, bias, Z / A / dZ / as of the epilogues
  const __nv_bfloat16* a = nullptr;  // [a_rows, k]
  std::int64_t a_rows = 0;
  const std::int32_t* gather = nullptr;  // [rows] or null (contiguous A, read by TMA)
  const __nv_bfloat16* b = nullptr;      // [E, n, k], or [E, k, n] when b_kn
  bool b_kn = false;
  // B is W1 [E, 2I, H] in two parts (MoEConfig::w1_layout concatenated or separate), read in the interleaved order:
  // only the up-projection (activation entry, glu; b1 then in two parts too) and dXe (store entry, b_kn, contiguous
  // A, no bias). The part and expert strides in elements (w1_layout_sm90.cuh); 0: the concatenated (I*H, 2*I*H).
  bool b_w1_concat = false;
  std::int64_t b_w1_part_stride = 0, b_w1_expert_stride = 0;
  const std::int32_t* offsets = nullptr;  // device [E + 1]
  std::int64_t rows = 0;                  // capacity of C / gather
  int num_experts = 0, n = 0, k = 0;
  cudaStream_t stream = nullptr;
};

// D[e] = sum over rows r of expert e of P[gp(r)]^T Q[gq(r)] (gp, gq = index arrays or the identity), or D[e] += it
// (d_f32). Experts without rows get zeros (or keep D[e]); with rows = 0, P and Q may be empty (null).
struct NativeVarlenK {
  DType elem = DType::bf16;          // bf16 or f16: P, Q, D
  const __nv_bfloat16* p = nullptr;  // [p_rows, m]
  std::int64_t p_rows = 0;
  const std::int32_t* p_gather = nullptr;  // [rows] or null
  const __nv_bfloat16* q = nullptr;        // [q_rows, n]
  std::int64_t q_rows = 0;
  const std::int32_t* q_gather = nullptr;  // [rows] or null
  __nv_bfloat16* d = nullptr;              // [E, m, n]
  // D is dW1 [E, m = 2I, n = H] written in a W1 layout of two parts (MoEConfig::w1_layout concatenated or separate),
  // with its part / expert strides (elements; 0: the concatenated (I*H, 2*I*H)); only the dW1 shape (P contiguous,
  // Q gathered)
  bool d_w1_concat = false;
  std::int64_t d_w1_part_stride = 0, d_w1_expert_stride = 0;
  // When given: D += P^T Q in fp32 into d_f32 (f32, in d's layout; the accumulators added unrounded: an fp32
  // main_grad's gradient-accumulation fusion), and d is not used. Experts without rows leave it unchanged.
  float* d_f32 = nullptr;
  const std::int32_t* offsets = nullptr;   // device [E + 1]
  std::int64_t rows = 0;
  int num_experts = 0, m = 0, n = 0;
  cudaStream_t stream = nullptr;
};
void native_varlen_k(const NativeVarlenK& g);

// Multiprocessors of the current device (cached per device).
int current_sm_count();

// Tile order inside an expert: N-tile major (true) or M-tile major, by the kernel's rule (raster_n_of, heuristics.h).
// SONICMOE_NATIVE_RASTER=m|n overrides the heuristic (a tuning knob for the benchmarks).
bool native_raster_n(const NativeVarlenM& g, RasterRule rule = RasterRule::by_mean_rows);

// N tile of the kernels: the dgated epilogue writes one per-row partial per N tile.
inline constexpr int kNativeDgatedTileN = 256;
inline int native_dgated_n_tiles(int n) { return (n + kNativeDgatedTileN - 1) / kNativeDgatedTileN; }

// C = elem((A B^T + bias[e]) * row_scale[r]) (rounded to g.elem, as every output below); bias / row_scale may be null.
void native_varlen_m_store(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                           const float* row_scale);

// b1 of a W1 in two parts (g.b_w1_concat): the gate's b1[e][j] at bias[e * expert + j], the up's at
// bias[e * expert + part + j] (elements); 0: the concatenated (I, 2I).
struct W1BiasStrides {
  std::int64_t part = 0, expert = 0;
};

// Up-projection (step 4): Z = bf16(A B^T + b1[e]) [rows, n], A_out = act(Z) [rows, n/2 (GLU) or n].
// Requires a gather index (the rows of X are always gathered).
void native_varlen_m_activation(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                                __nv_bfloat16* z, __nv_bfloat16* a_out, W1BiasStrides bias_strides = {});

// dgated (step 7), G = A B^T (n = I) rounded to bf16 and handed to the epilogue warps through shared memory
// (never written to global memory): A_act = act(Z) recomputed,
// dz = act'(Z) applied to s*G, as = s*A_act (nullable), ds_partial[nt * rows + r] = <G, A_act> over N tile nt.
// s = pair_score[pair[r]]. Requires b_kn (B = W2 [E, H, I] read as [E, k, n]).
void native_varlen_m_dgated(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                            const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial);

// dscore[pair[r]] = sum over N tiles of ds_partial[nt * rows + r] (+ <d_out[gather[r]], b2[e(r)]> when b2),
// summed in a fixed order (deterministic), for r < offsets[E].
void dgated_score_reduce(const float* ds_partial, int n_tiles, std::int64_t rows, const std::int32_t* pair,
                         const std::int32_t* offsets, int num_experts, const __nv_bfloat16* d_out,
                         const std::int32_t* gather, const __nv_bfloat16* b2, std::int64_t H, float* dscore,
                         cudaStream_t stream, DType elem = DType::bf16);  // elem: d_out / b2 bf16 or f16

}  // namespace sonicmoe::cuda::gemm

// Baseline (not in the library; target sonicmoe_baselines, linked by tests and tools only): the memory-bound MoE
// "epilogue" steps as standalone CUDA kernels (DESIGN.md sections 2-3, steps 4, 7), which the library fuses into the
// GEMM epilogues; kept so that the benchmarks can measure the unfused pipeline and tests can check the fused one.
// bf16 storage, fp32 math, 16-byte vectors where rows allow. Every kernel reads the valid row count
// offsets[E] on the device (no host sync, graph-capturable) and leaves rows >= offsets[E] untouched.
// No float atomics: outputs are bitwise deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sonicmoe/types.h"

namespace sonicmoe::baselines {

// A[r] = act(Z[r]) for r < offsets[E]. GLU: Z [rows, 2I] interleaved (gate 2j, up 2j+1); plain: Z [rows, I].
void activation_forward(Activation act, const __nv_bfloat16* z, __nv_bfloat16* a, std::int64_t capacity_rows,
                        std::int64_t I, const std::int32_t* offsets, int E, cudaStream_t stream);

// dgated elementwise part of step 7, per valid row r (e = expert of r, p = pair[r], s = pair_score[p]):
//   A = act(Z[r]);  dscore[p] = <G[r], A> (+ <d_out[gather[r]], b2[e]> when b2 != nullptr)
//   dZ[r] = act'(Z[r]) applied to s*G[r];  As[r] = s*A.
// g [rows, I], z [rows, z_width], d_out [T, H], b2 [E, H] (nullable; then d_out/gather may be null),
// dz [rows, z_width], as [rows, I] (nullable: not written), dscore f32 indexed by pair.
void dgated_elementwise(Activation act, const __nv_bfloat16* g, const __nv_bfloat16* z, const float* pair_score,
                        const std::int32_t* pair, const __nv_bfloat16* d_out, const std::int32_t* gather,
                        const __nv_bfloat16* b2, __nv_bfloat16* dz, __nv_bfloat16* as, float* dscore,
                        std::int64_t capacity_rows, std::int64_t H, std::int64_t I, const std::int32_t* offsets,
                        int E, cudaStream_t stream);

// dst[r] = src[idx[r]] for r < *offsets_total (e.g. offsets + E). src [*, C], dst [capacity_rows, C].
void gather_rows(const __nv_bfloat16* src, const std::int32_t* idx, __nv_bfloat16* dst, std::int64_t capacity_rows,
                 std::int64_t C, const std::int32_t* offsets_total, cudaStream_t stream);

}  // namespace sonicmoe::baselines

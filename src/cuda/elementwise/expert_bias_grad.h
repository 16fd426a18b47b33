// The expert bias gradients of the weight-gradient stages (DESIGN.md steps 8-9): a deterministic per-expert column
// reduction, bf16 or f16 storage, fp32 math, 16-byte vectors where rows allow. Reads the row ranges from offsets on the
// device (no host sync, graph-capturable). No float atomics: outputs are bitwise deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sonicmoe::cuda {

// db[e, c] = sum over rows r of expert e of (row_scale ? row_scale[pair[r]] : 1) * src[idx ? idx[r] : r, c].
// bf16 [E, C] out, fp32 accumulation in a fixed order, experts without rows get zeros.
// db1: src = dZ, idx = row_scale = pair = nullptr.  db2: src = dO, idx = gather, row_scale = pair_score.
// out: db written in a W1 layout of two parts (db1 under MoEConfig::w1_layout concatenated or separate; C even):
// column c = 2j + p of src lands at db[e * out.expert + p * out.part + j] (the same sums, in other places):
// concatenated (C / 2, C), separate (up - gate, C / 2). out.part = 0: db [E, C] in src's order.
struct BiasGradOut {
  std::int64_t part = 0, expert = 0;
};
void expert_bias_grad(const __nv_bfloat16* src, const std::int32_t* src_rows_index, const float* row_scale_pair,
                      const std::int32_t* pair, std::int64_t capacity_rows, std::int64_t C,
                      const std::int32_t* offsets, int E, __nv_bfloat16* db, cudaStream_t stream,
                      BiasGradOut out = {});
// The same in f16 storage.
void expert_bias_grad(const __half* src, const std::int32_t* src_rows_index, const float* row_scale_pair,
                      const std::int32_t* pair, std::int64_t capacity_rows, std::int64_t C,
                      const std::int32_t* offsets, int E, __half* db, cudaStream_t stream, BiasGradOut out = {});

}  // namespace sonicmoe::cuda

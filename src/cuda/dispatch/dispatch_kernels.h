// Small CUDA kernels behind the dispatched-token entries and the expert-parallel layer (include/sonicmoe/dispatched.h,
// include/sonicmoe/ep.h): turning DeepEP's [N, K] ids into general-routing pairs with the count on the device,
// Megatron's per-expert counts into per-row expert ids, the score-gradient scatter back to [N, K], and a row gather.
// Every launch on ctx's stream; no host synchronisation.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::cuda {

// Slots s = n*K + k (s < nk) with 0 <= idx[s] < E, in increasing s, into slots[0 .. *count); *count on the device.
void deepep_select_slots(const Context& ctx, const std::int32_t* idx, std::int64_t nk, std::int64_t E,
                         std::int32_t* slots, std::int32_t* count);

// Pair p < P: token = slots[p] / K, expert = idx[slots[p]], score = weights[slots[p]]; a pair p >= *count (a caller's
// num_pairs above the true count) gets token rows-1, expert 0, score 0 (token order kept, memory-safe).
void deepep_fill_pairs(const Context& ctx, const std::int32_t* idx, const float* weights, const std::int32_t* slots,
                       const std::int32_t* count, std::int64_t P, std::int64_t K, std::int64_t rows,
                       std::int32_t* token, std::int32_t* expert, float* score);

// dweights[slots[p]] = dscore[p] for p < P (dweights zeroed by the caller).
void scatter_slots(const Context& ctx, const float* dscore, const std::int32_t* slots, std::int64_t P,
                   float* dweights);

// token[r] = r and expert[r] = the e with offsets[e] <= r < offsets[e+1], from counts [E] (is_offsets false) or
// offsets [E+1]; rows past the last offset go to expert E-1.
void permuted_pairs(const Context& ctx, const std::int32_t* counts_or_offsets, bool is_offsets, std::int64_t E,
                    std::int64_t rows, std::int32_t* token, std::int32_t* expert);

// dst[r, :] = src[idx[r], :] for r < rows (bf16 or f32, row width `cols`).
void gather_rows_any(const Context& ctx, const void* src, DType dt, const std::int32_t* idx, std::int64_t rows,
                     std::int64_t cols, void* dst);

}  // namespace sonicmoe::cuda

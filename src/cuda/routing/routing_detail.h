// Internal to the routing translation units: the top-K kernel's grid and launch (routing.cu), shared by
// topk_softmax (routing.cu) and topk_routing (metadata.cu, which also builds the metadata from its output); the
// metadata's allocation (metadata.cu), also used by the radix-sort baseline (src/baselines/metadata_radix_sort.cu).
#pragma once

#include <cstdint>

#include "core/router_math.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::cuda::detail {

// The top-K kernel's work split: warp g of the grid takes the contiguous tokens
// [g * tokens_per_warp, (g + 1) * tokens_per_warp); a block is 8 warps, so block b owns the contiguous pairs
// [8 b tokens_per_warp K, 8 (b + 1) tokens_per_warp K). At most one resident wave and kMaxBlocks blocks.
struct TopkGrid {
  static constexpr int kWarps = 8;
  static constexpr int kMaxBlocks = 1024;
  int tokens_per_warp = 1;
  int blocks = 1;
};
TopkGrid topk_grid(const Context& ctx, std::int64_t T, std::int64_t E);

// What the top-K kernel writes besides ids and scores. counts != null: the global expert histogram (atomics,
// zeroed by the launcher). Otherwise every pointer here is set: pair_token[p] = p / K,
// token_offsets[t] = t K (t <= T), and block_counts[b][e] = pairs of block b routed to expert e.
struct TopkOutputs {
  int* counts = nullptr;
  int* pair_token = nullptr;
  int* token_offsets = nullptr;
  int* block_counts = nullptr;
};
// The router variant (RouterSpec, validated) as kernel arguments.
struct RouterArgs {
  RouterScore score = RouterScore::topk_softmax;
  bool norm = false;      // norm_topk_probs
  int n_group = 1;        // 1: no group-limited selection
  int topk_group = 1;
  float scale = 1.0f;     // routed_scaling_factor
  const float* bias = nullptr;  // e_score_correction_bias [E] or null
};
RouterArgs router_args(const RouterSpec& r);

// The default router runs the plain top-K softmax kernel; any other the router-variant instance of the same kernel.
void launch_topk(const Context& ctx, const TensorView& logits, int k, const TopkGrid& grid, int* ids, float* scores,
                 const TopkOutputs& out, const RouterSpec& router);

// The metadata's arrays (counts, offsets, pair, gather, rev, token_offsets; demand and dropped under a capacity) in
// one allocation. scratch_ints > 0 adds the builder's int32 scratch array (the per-block counts) to it, returned in
// *scratch: one allocator call per build instead of two, for at most 2 MiB that stay allocated while the metadata
// lives.
RoutingMetadata empty_metadata(const Context& ctx, std::int64_t N, std::int64_t T, std::int64_t E,
                               std::int64_t scratch_ints = 0, Tensor* scratch = nullptr, bool capacity = false);
// Empty routing (N = 0): counts, offsets and token_offsets are zeros (and demand, dropped under a capacity).
RoutingMetadata zero_metadata(const Context& ctx, std::int64_t T, std::int64_t E, bool capacity = false);

}  // namespace sonicmoe::cuda::detail

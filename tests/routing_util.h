// Routing set-up shared by the tests (CPU and GPU) and the benchmark tools: a RouterSpec from its fields in one
// call, the named router presets, and the Routing state of top-K routing over given arrays.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::testing_util {

// The bias (e_score_correction_bias) is set apart. The parameters are RouterSpec's first six fields, in order.
inline RouterSpec router_spec(ScoreFunction score, bool softmax_over_topk, bool norm, std::int64_t n_group,
                              std::int64_t topk_group, float scale) {
  return RouterSpec{score, softmax_over_topk, norm, n_group, topk_group, scale};
}

// Qwen3 / OLMoE: softmax over all E experts, weights renormalised over the K picks.
inline RouterSpec qwen3_router() { return router_spec(ScoreFunction::softmax, false, true, 1, 1, 1.0f); }

// DeepSeek-V3: sigmoid scores (the caller adds e_score_correction_bias), the best topk_group of n_group expert
// groups eligible, weights renormalised and scaled by 2.5.
inline RouterSpec deepseek_v3_router(std::int64_t n_group = 8, std::int64_t topk_group = 4) {
  return router_spec(ScoreFunction::sigmoid, true, true, n_group, topk_group, 2.5f);
}

// The Routing of top-K routing over the given arrays (what route() keeps), for callers of router_backward: the
// pair arrays are the top-K arrays reshaped; the router's bias view is dropped, as route() drops it (the backward
// does not read it).
inline Routing topk_routing_state(const Tensor& logits, std::int64_t k, const Tensor& topk_expert,
                                  const Tensor& topk_score, const Tensor& pair_token, const RoutingMetadata& meta,
                                  const RouterSpec& router = {}) {
  Routing r;
  r.mode = RoutingMode::topk;
  r.top_k = k;
  r.logits = logits;
  r.topk_expert = topk_expert;
  r.topk_score = topk_score;
  r.pair_token = pair_token;
  r.pair_expert = topk_expert.reshape({topk_expert.numel()});
  r.pair_score = topk_score.reshape({topk_score.numel()});
  r.meta = meta;
  r.router = router;
  r.router.e_score_correction_bias = TensorView();
  return r;
}

}  // namespace sonicmoe::testing_util

// A RouterSpec from its fields in one call, for the router-variant tests (CPU and GPU); the bias is set apart.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::testing_util {

inline RouterSpec router_spec(ScoreFunction score, bool softmax_over_topk, bool norm, std::int64_t n_group,
                              std::int64_t topk_group, float scale) {
  RouterSpec r;
  r.score_function = score;
  r.softmax_over_topk = softmax_over_topk;
  r.norm_topk_probs = norm;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = scale;
  return r;
}

}  // namespace sonicmoe::testing_util

// Router variants (RouterSpec, DESIGN.md section 4 "Routers"): which score rule a spec means, and its validation.
#pragma once

#include <cstdint>

#include "core/router_math.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

inline RouterScore router_score_of(const RouterSpec& r) {
  if (r.score_function == ScoreFunction::sigmoid) return RouterScore::sigmoid;
  return r.softmax_over_topk ? RouterScore::topk_softmax : RouterScore::full_softmax;
}

// A RouterSpec for E experts and K picks on ctx's backend; throws Error "sonicmoe::<fn>: router.<field> = ...".
// Rules: score_function softmax or sigmoid; n_group >= 1 divides E into groups of at least 2 experts (at most 32
// groups on the cuda backend); 1 <= topk_group <= n_group (topk_group = n_group when n_group = 1 is fine too);
// K <= topk_group * E / n_group; routed_scaling_factor finite and > 0; groups and the bias need a selection score
// (score_function sigmoid, or softmax with softmax_over_topk = false); the bias is f32 [E], contiguous, on ctx's
// device; capacity_factor finite and >= 0.
void check_router(const char* fn, const Context& ctx, const RouterSpec& r, std::int64_t E, std::int64_t K);

}  // namespace sonicmoe

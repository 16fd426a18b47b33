// The CPU reference backend: one function per pipeline stage (the list in include/sonicmoe/detail/stage_list.h),
// same meaning and arguments as the public stages in include/sonicmoe/stages.h. Arguments arrive validated
// (src/moe/stages.cpp). fp32 accumulation, outputs rounded to their storage dtype exactly where the GPU path
// rounds; OpenMP across rows/experts.
#pragma once

#include "sonicmoe/detail/stage_list.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::ref {

SONICMOE_STAGE_LIST(SONICMOE_DECLARE_STAGE)

// Not a stage: pair_token[p] = p / k for the N = T*K pairs of top-K routing.
void topk_pair_token(const Context& ctx, std::int64_t k, const TensorView& pair_token);

// Not a stage: drops from metadata built over all pairs every pair past the first `capacity` rows of its expert
// (RouterSpec::capacity_factor): rev = -1 for them, the kept rows moved to the front, demand and dropped filled.
void apply_capacity(const Context& ctx, RoutingMetadata& m, std::int64_t capacity);

}  // namespace sonicmoe::ref

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

}  // namespace sonicmoe::ref

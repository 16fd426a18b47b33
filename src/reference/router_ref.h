// Reference router variants (RouterSpec): one token's selection and weights, mirrored by the GPU top-K kernel.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::ref {

// One token's row of E logits under router `r` (validated; bias: its f32 [E] values or null): the K picks in
// descending selection key (ties: lower expert id) and their weights. scratch: at least 2E floats.
// The default router gives exactly select_topk's ids and scores.
void router_select_row(const float* row, std::int64_t E, std::int64_t k, const RouterSpec& r, const float* bias,
                       std::int32_t* ids, float* weights, float* scratch);

}  // namespace sonicmoe::ref

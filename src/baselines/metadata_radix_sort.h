// Baseline (not in the library; target sonicmoe_baselines, linked by tests and tools only): build_metadata by a CUB
// radix sort, the comparison for the library's counting sort (src/cuda/routing/metadata.cu). Same arguments and
// results as sonicmoe::build_metadata on the cuda backend (arguments unchecked beyond the size limits).
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe::baselines {

RoutingMetadata build_metadata_radix_sort(const Context& ctx, const TensorView& pair_token,
                                          const TensorView& pair_expert, std::int64_t num_tokens,
                                          std::int64_t num_experts);

}  // namespace sonicmoe::baselines

// The cuda backend: one function per pipeline stage (the list in include/sonicmoe/detail/stage_list.h), same
// meaning and arguments as the public stages in include/sonicmoe/stages.h. Arguments arrive validated
// (src/moe/stages.cpp); these only launch work on ctx.stream and never synchronise the host. A d_aux_loss tensor
// of router_backward (one float on the device) is read by the kernels, never by the host.
#pragma once

#include "sonicmoe/detail/stage_list.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::cuda {

SONICMOE_STAGE_LIST(SONICMOE_DECLARE_STAGE)

// Not a stage: the metadata of build_metadata by a CUB radix sort, not used by the layer, kept so the benchmark
// measures both.
RoutingMetadata build_metadata_radix_sort(const Context& ctx, const TensorView& pair_token,
                                          const TensorView& pair_expert, std::int64_t num_tokens,
                                          std::int64_t num_experts);

}  // namespace sonicmoe::cuda

// The cuda backend: one function per pipeline stage (the list in include/sonicmoe/detail/stage_list.h), same
// meaning and arguments as the public stages in include/sonicmoe/stages.h. Arguments arrive validated
// (src/moe/stages.cpp); these only launch work on ctx.stream and never synchronise the host. A d_aux_loss tensor
// of router_backward (one float on the device) is read by the kernels, never by the host.
#pragma once

#include "sonicmoe/detail/stage_list.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::cuda {

SONICMOE_STAGE_LIST(SONICMOE_DECLARE_STAGE)

}  // namespace sonicmoe::cuda

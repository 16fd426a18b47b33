// The cuda backend's FP8 quantisers (include/sonicmoe/quant.h; arguments arrive validated by src/moe/quant.cpp).
// They launch on ctx.stream and never synchronise the host. Kernels: quant_rows.cu (1x128, optionally gathered),
// quant_transpose.cu (128x1 into a transposed copy; 128x128 with both copies), sharing quant_common.cuh.
#pragma once

#include "sonicmoe/detail/quant_list.h"
#include "sonicmoe/quant.h"

namespace sonicmoe::cuda {

SONICMOE_QUANT_LIST(SONICMOE_DECLARE_QUANT)

}  // namespace sonicmoe::cuda

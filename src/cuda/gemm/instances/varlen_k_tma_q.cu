// Native varlen-K with gathered P (cp.async, zero-filled past each expert) and contiguous Q by TMA: the dW2
// shape (P = dO gathered, Q = s*A in pair order).
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKGatheredPTmaQCfgOf<InstanceElement>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

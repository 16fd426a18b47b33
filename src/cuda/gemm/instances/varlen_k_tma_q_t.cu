// Native varlen-K for the dW1 shape (P contiguous, Q gathered), run swapped: D^T = Q[gather]^T P with the
// gathered rows on the 128-wide M side by cp.async, P by TMA, and D written transposed.
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_transposed)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKGatheredPTmaQTransposedCfgOf<InstanceElement>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

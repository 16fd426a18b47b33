// Native varlen-K (weight gradients) with Q by cp.async: P rows by TMA (contiguous) or gathered by cp.async.
// (Gathered P with contiguous Q: varlen_k_tma_q.cu.)
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_contiguous_p)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKContiguousPCfgOf<InstanceElement>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKGatheredPCfgOf<InstanceElement>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

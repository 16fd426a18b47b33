// Native varlen-K for the dW1 shape (P = dZ contiguous, Q = X gathered) writing dW1 in the concatenated W1 layout
// (MoEConfig::w1_layout; VarlenKConcatDCfg, w1_layout_sm90.cuh): the direct kernel and the swapped one (D^T computed,
// D written), picked like the interleaved ones (heuristics.h, varlen_k_swap_operands).
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_contiguous_p_w1_concat)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKConcatDCfg<sm90::VarlenKContiguousPCfgOf<InstanceElement>>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_transposed_w1_concat)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKConcatDCfg<sm90::VarlenKGatheredPTmaQTransposedCfgOf<InstanceElement>>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

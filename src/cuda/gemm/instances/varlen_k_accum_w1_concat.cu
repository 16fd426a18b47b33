// Native varlen-K for the dW1 shape adding into an f32 dW1 in a two-part W1 layout (VarlenKAccumF32Cfg over
// VarlenKConcatDCfg): the accumulating twins of varlen_k_w1_concat.cu.
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_contiguous_p_w1_concat_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKConcatDCfg<sm90::VarlenKContiguousPCfgOf<InstanceElement>>>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_transposed_w1_concat_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<
      sm90::VarlenKAccumF32Cfg<sm90::VarlenKConcatDCfg<sm90::VarlenKGatheredPTmaQTransposedCfgOf<InstanceElement>>>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

// Native varlen-K adding its tiles into an f32 D by TMA reduce-add (NativeVarlenK::d_f32, VarlenKAccumF32Cfg with
// kTma): dW2's variant and dW1's swapped one (the layer's long-K weight gradients, heuristics.h) with the staged
// epilogue (tma_reduce_sm90.cuh).
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_accum_tma)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKGatheredPTmaQCfgOf<InstanceElement>, true>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_transposed_accum_tma)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKGatheredPTmaQTransposedCfgOf<InstanceElement>, true>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

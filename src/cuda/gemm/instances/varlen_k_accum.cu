// Native varlen-K adding its tiles into an f32 D (NativeVarlenK::d_f32, VarlenKAccumF32Cfg): the four interleaved
// variants of varlen_k.cu, varlen_k_tma_q.cu and varlen_k_tma_q_t.cu with the accumulating epilogue.
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_varlen_k_contiguous_p_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKContiguousPCfgOf<InstanceElement>>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKGatheredPCfgOf<InstanceElement>>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKGatheredPTmaQCfgOf<InstanceElement>>>(g);
}
void SONICMOE_INSTANCE(native_varlen_k_gathered_p_tma_q_transposed_accum)(const NativeVarlenK& g) {
  sm90::launch_varlen_k<sm90::VarlenKAccumF32Cfg<sm90::VarlenKGatheredPTmaQTransposedCfgOf<InstanceElement>>>(g);
}

}  // namespace sonicmoe::cuda::gemm::detail

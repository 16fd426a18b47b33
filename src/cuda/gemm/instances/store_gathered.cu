// Native varlen-M, plain store epilogue, A rows gathered in the mainloop (cp.async by the MMA warps).
#include "cuda/gemm/instances/store_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_store_gathered)(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                           const float* row_scale) {
  store_of<sm90::VarlenMMmaGatherCfgOf<InstanceElement>, sm90::VarlenMMmaGatherBknCfgOf<InstanceElement>>(g, c, bias, row_scale);
}

}  // namespace sonicmoe::cuda::gemm::detail

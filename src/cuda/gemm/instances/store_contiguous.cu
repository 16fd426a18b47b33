// Native varlen-M, plain store epilogue, A contiguous (TMA): down-projection (B K-major) and dXe (B N-major).
#include "cuda/gemm/instances/store_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_store_contiguous)(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                             const float* row_scale) {
  store_of<sm90::VarlenMContiguousCfgOf<InstanceElement>, sm90::VarlenMContiguousBknCfgOf<InstanceElement>>(g, c, bias, row_scale);
}

}  // namespace sonicmoe::cuda::gemm::detail

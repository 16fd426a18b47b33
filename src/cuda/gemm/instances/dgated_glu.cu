// Native varlen-M with the dgated epilogue (rows of dO gathered, B = W2 read N-major), the glu activations:
// the MMA warps gather the rows of dO (3 warpgroups, 64x256 wgmma).
#include "cuda/gemm/instances/dgated_switch.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_dgated_glu)(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                       const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_glu<sm90::VarlenMMmaGatherBknCfgOf<InstanceElement>>(g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

// dgated of the FP8 layer on bf16 operands (MoEConfig::dgated_precision bf16): the native kernel layouts with the FP8
// dgated epilogue (the saved Z read as codes, dZ out in bf16 and 1x128 codes), the plain activations.
#include "cuda/gemm/instances/fp8_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void bf16_dgated_fp8z_plain(const NativeVarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                            const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  bf16_dgated_fp8z_family<PlainActivations>("bf16_dgated_fp8z_plain", g, act, z, pair_score, pair, dz, as,
                                            ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

// FP8 varlen-M with the dgated epilogue (rows of dO gathered, B = W2's transposed copy [E, I, H] read K-major), the
// plain activations.
#include "cuda/gemm/instances/fp8_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void fp8_dgated_plain(const Fp8VarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                      const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  fp8_dgated_of<PlainActivations>("fp8_dgated_plain", g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

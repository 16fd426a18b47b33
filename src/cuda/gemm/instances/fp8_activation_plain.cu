// FP8 varlen-M with the activation epilogue (EpiActivationFp8Z: Z in bf16 and / or 1x128 FP8, A = act(Z)), the plain
// activations; X rows gathered.
#include "cuda/gemm/instances/fp8_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void fp8_activation_plain(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, const Fp8ZOut& z,
                          __nv_bfloat16* a_out) {
  fp8_activation_of<PlainActivations, sm90::VarlenMFp8GatherCfg>("fp8_activation_plain", g, act, bias, z, a_out);
}

}  // namespace sonicmoe::cuda::gemm::detail

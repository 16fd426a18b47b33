// FP8 varlen-M with the activation epilogue (EpiActivationFp8Z), the glu activations; X's rows already in the
// routing's order (quantised into place by fp8_quantize_rows_scatter), contiguous A by TMA, BN = 256.
#include "cuda/gemm/instances/fp8_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void fp8_activation_glu_contiguous(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias,
                                  const Fp8ZOut& z, __nv_bfloat16* a_out) {
  using Cfg = sm90::VarlenMFp8ContiguousWideCfg;
  fp8_activation_of<GluActivations, Cfg>("fp8_activation_glu_contiguous", g, act, bias, z, a_out);
}

}  // namespace sonicmoe::cuda::gemm::detail

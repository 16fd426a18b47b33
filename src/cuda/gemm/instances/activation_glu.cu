// Native varlen-M with the activation epilogue (activation_of.cuh): the glu activations.
#include "cuda/gemm/instances/activation_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_activation_glu)(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                           __nv_bfloat16* a_out) {
  activation_of<GluActivations, InstanceElement>("native_activation_glu", g, act, bias, z, a_out);
}

}  // namespace sonicmoe::cuda::gemm::detail

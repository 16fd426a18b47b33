// Native varlen-M with the activation epilogue (activation_of.cuh): the plain activations.
#include "cuda/gemm/instances/activation_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_activation_plain)(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                             __nv_bfloat16* a_out) {
  activation_of<PlainActivations, InstanceElement>("native_activation_plain", g, act, bias, z, a_out);
}

}  // namespace sonicmoe::cuda::gemm::detail

// Native varlen-M with the activation epilogue (Z and A = act(Z)), X rows gathered: the plain activations.
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm::detail {

void native_activation_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                           __nv_bfloat16* a_out) {
  using namespace sm90;
  using Cfg = VarlenMConfig<true, false>;
  switch (act) {
    case Activation::gelu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::gelu>>(g, {z, a_out, bias, g.n});
    case Activation::relu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::relu>>(g, {z, a_out, bias, g.n});
    case Activation::silu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::silu>>(g, {z, a_out, bias, g.n});
    case Activation::relu_sq:
      return launch_varlen_m<Cfg, EpiActivation<Activation::relu_sq>>(g, {z, a_out, bias, g.n});
    default:
      throw Error("native_activation_plain: not a plain activation");
  }
}

}  // namespace sonicmoe::cuda::gemm::detail

// Native varlen-M with the activation epilogue (Z and A = act(Z)), X rows gathered: the glu activations.
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm::detail {

void native_activation_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                           __nv_bfloat16* a_out) {
  using namespace sm90;
  using Cfg = VarlenMConfig<true, false>;
  switch (act) {
    case Activation::swiglu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::swiglu>>(g, {z, a_out, bias, g.n});
    case Activation::geglu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::geglu>>(g, {z, a_out, bias, g.n});
    case Activation::reglu:
      return launch_varlen_m<Cfg, EpiActivation<Activation::reglu>>(g, {z, a_out, bias, g.n});
    default:
      throw Error("native_activation_glu: not a glu activation");
  }
}

}  // namespace sonicmoe::cuda::gemm::detail

// Native varlen-M with the activation epilogue (Z and A = act(Z)), X rows gathered, Z stored by TMA (epilogue_tma_store_sm90.cuh): the glu activations.
#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

void native_activation_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                           __nv_bfloat16* a_out) {
  using namespace sm90;
  using Cfg = VarlenMMmaGatherCfg;  // the MMA warps gather X's rows
  const int rows = static_cast<int>(g.rows);
  with_activation<Activation::swiglu, Activation::geglu, Activation::reglu>(
      act, "native_activation_glu: not a glu activation", [&](auto a) {
        using Epi = EpiActivationTma<decltype(a)::value>;
        launch_varlen_m<Cfg, Epi>(g, Epi::make_params(z, a_out, bias, g.n, rows));
      });
}

}  // namespace sonicmoe::cuda::gemm::detail

// The varlen-M activation epilogue (Z and A = act(Z)) for one family of activations As (included by
// activation_*.cu, one family per file): X rows gathered by the MMA warps, Z stored by TMA
// (epilogue_tma_store_sm90.cuh).
#pragma once

#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

template <Activation... As>
void activation_of(const char* not_one, const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                   __nv_bfloat16* z, __nv_bfloat16* a_out) {
  using namespace sm90;
  using Cfg = VarlenMMmaGatherCfg;  // the MMA warps gather X's rows
  const int rows = static_cast<int>(g.rows);
  with_activation<As...>(act, not_one, [&](auto a) {
    using Epi = EpiActivationTma<decltype(a)::value>;
    launch_varlen_m<Cfg, Epi>(g, Epi::make_params(z, a_out, bias, g.n, rows));
  });
}

}  // namespace sonicmoe::cuda::gemm::detail

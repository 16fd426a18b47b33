// The varlen-M activation epilogue (Z and A = act(Z)) for one family of activations (included by
// activation_*.cu, one family per file): X rows gathered by the MMA warps, Z stored by TMA
// (epilogue_tma_store_sm90.cuh).
#pragma once

#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

// Cfg: the kernel layout (VarlenMMmaGatherCfg, or W1ConcatCfg of it for W1 in two parts, whose b1 is read in two
// parts too: bias_part > 0, EpiActivation::Params).
template <class Cfg, class Family>
void activation_cfg_of(const char* fn, const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                       __nv_bfloat16* z, __nv_bfloat16* a_out, std::int64_t bias_part, std::int64_t bias_expert) {
  using namespace sm90;
  const int rows = static_cast<int>(g.rows);
  with_activation<Family>(fn, act, [&](auto a) {
    using Epi = EpiActivationTma<decltype(a)::value, typename Cfg::Element>;
    launch_varlen_m<Cfg, Epi>(g, Epi::make_params(z, a_out, bias, g.n, rows, bias_part, bias_expert));
  });
}

template <class Family, class E>
void activation_of(const char* fn, const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                   __nv_bfloat16* z, __nv_bfloat16* a_out) {
  // the MMA warps gather X's rows
  activation_cfg_of<sm90::VarlenMMmaGatherCfgOf<E>, Family>(fn, g, act, bias, z, a_out, /*bias_part=*/0, 0);
}

}  // namespace sonicmoe::cuda::gemm::detail

// The dgated GEMM's activation switch, for one kernel layout Cfg (included by the dgated_*.cu instantiation files,
// one layout and one activation family per file).
#pragma once

#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

template <class Cfg, class Family>
void dgated_of(const char* fn, const NativeVarlenM& g, Activation act, const __nv_bfloat16* z,
               const float* pair_score, const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as,
               float* ds_partial) {
  with_activation<Family>(fn, act, [&](auto a) {
    sm90::launch_varlen_m<Cfg, sm90::EpiDgated<decltype(a)::value, typename Cfg::Element>>(
        g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
  });
}

template <class Cfg>
void dgated_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, GluActivations>("native_dgated_glu", g, act, z, pair_score, pair, dz, as, ds_partial);
}

template <class Cfg>
void dgated_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                  const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, PlainActivations>("native_dgated_plain", g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

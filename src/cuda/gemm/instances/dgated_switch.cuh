// The dgated GEMM's activation switch, for one kernel layout Cfg (included by the dgated_*.cu instantiation files,
// one layout and one activation family per file).
#pragma once

#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

template <class Cfg, Activation... As>
void dgated_of(const char* not_one, const NativeVarlenM& g, Activation act, const __nv_bfloat16* z,
               const float* pair_score, const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as,
               float* ds_partial) {
  with_activation<As...>(act, not_one, [&](auto a) {
    sm90::launch_varlen_m<Cfg, sm90::EpiDgated<decltype(a)::value>>(
        g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
  });
}

template <class Cfg>
void dgated_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, Activation::swiglu, Activation::geglu, Activation::reglu, Activation::geglu_tanh>(
      "native_dgated_glu: not a glu activation", g, act, z, pair_score, pair, dz, as, ds_partial);
}

template <class Cfg>
void dgated_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                  const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, Activation::gelu, Activation::relu, Activation::silu, Activation::relu_sq, Activation::gelu_tanh>(
      "native_dgated_plain: not a plain activation", g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

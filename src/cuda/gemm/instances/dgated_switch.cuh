// The dgated GEMM's activation switch, for one kernel layout Cfg (included by the dgated_*.cu instantiation files,
// one layout and one activation family per file).
#pragma once

#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm::detail {

template <class Cfg, Activation A>
void launch_dgated(const NativeVarlenM& g, const __nv_bfloat16* z, const float* pair_score, const std::int32_t* pair,
                   __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  sm90::launch_varlen_m<Cfg, sm90::EpiDgated<A>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
}

// Launches the kernel of `act` if it is one of As, else throws `not_one`.
template <class Cfg, Activation... As>
void dgated_of(const char* not_one, const NativeVarlenM& g, Activation act, const __nv_bfloat16* z,
               const float* pair_score, const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as,
               float* ds_partial) {
  const bool launched =
      ((act == As ? (launch_dgated<Cfg, As>(g, z, pair_score, pair, dz, as, ds_partial), true) : false) || ...);
  if (!launched) throw Error(not_one);
}

template <class Cfg>
void dgated_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, Activation::swiglu, Activation::geglu, Activation::reglu>(
      "native_dgated_glu: not a glu activation", g, act, z, pair_score, pair, dz, as, ds_partial);
}

template <class Cfg>
void dgated_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                  const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  dgated_of<Cfg, Activation::gelu, Activation::relu, Activation::silu, Activation::relu_sq>(
      "native_dgated_plain: not a plain activation", g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

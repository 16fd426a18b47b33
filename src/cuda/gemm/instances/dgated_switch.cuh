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

template <class Cfg>
void dgated_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  switch (act) {
    case Activation::swiglu: return launch_dgated<Cfg, Activation::swiglu>(g, z, pair_score, pair, dz, as, ds_partial);
    case Activation::geglu: return launch_dgated<Cfg, Activation::geglu>(g, z, pair_score, pair, dz, as, ds_partial);
    case Activation::reglu: return launch_dgated<Cfg, Activation::reglu>(g, z, pair_score, pair, dz, as, ds_partial);
    default: throw Error("native_dgated_glu: not a glu activation");
  }
}

template <class Cfg>
void dgated_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                  const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  switch (act) {
    case Activation::gelu: return launch_dgated<Cfg, Activation::gelu>(g, z, pair_score, pair, dz, as, ds_partial);
    case Activation::relu: return launch_dgated<Cfg, Activation::relu>(g, z, pair_score, pair, dz, as, ds_partial);
    case Activation::silu: return launch_dgated<Cfg, Activation::silu>(g, z, pair_score, pair, dz, as, ds_partial);
    case Activation::relu_sq:
      return launch_dgated<Cfg, Activation::relu_sq>(g, z, pair_score, pair, dz, as, ds_partial);
    default: throw Error("native_dgated_plain: not a plain activation");
  }
}

}  // namespace sonicmoe::cuda::gemm::detail

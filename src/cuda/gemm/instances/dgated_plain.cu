// Native varlen-M with the dgated epilogue (rows of dO gathered, B = W2 read N-major): the plain activations.
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm::detail {

void native_dgated_plain(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                       const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  using namespace sm90;
  using Cfg = VarlenMConfig<true, true>;
  switch (act) {
    case Activation::gelu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::gelu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    case Activation::relu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::relu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    case Activation::silu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::silu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    case Activation::relu_sq:
      return launch_varlen_m<Cfg, EpiDgated<Activation::relu_sq>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    default:
      throw Error("native_dgated_plain: not a plain activation");
  }
}

}  // namespace sonicmoe::cuda::gemm::detail

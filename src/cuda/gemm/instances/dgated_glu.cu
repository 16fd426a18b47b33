// Native varlen-M with the dgated epilogue (rows of dO gathered, B = W2 read N-major): the glu activations.
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm::detail {

void native_dgated_glu(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                       const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  using namespace sm90;
  using Cfg = VarlenMConfig<true, true>;
  switch (act) {
    case Activation::swiglu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::swiglu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    case Activation::geglu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::geglu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    case Activation::reglu:
      return launch_varlen_m<Cfg, EpiDgated<Activation::reglu>>(g, {z, pair_score, pair, dz, as, ds_partial, g.rows, g.n});
    default:
      throw Error("native_dgated_glu: not a glu activation");
  }
}

}  // namespace sonicmoe::cuda::gemm::detail

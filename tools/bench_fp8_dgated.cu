// sonicmoe-bench-gemm fp8: the bf16 dgated kernels with the FP8 dgated epilogue (bench_fp8_dgated.h).
#include "bench_fp8_dgated.h"

#include <cutlass/bfloat16.h>

#include "cuda/gemm/epilogue_fp8_dgated_sm90.cuh"
#include "cuda/gemm/heuristics.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::bench {

void bf16_dgated_fp8z(const cuda::gemm::NativeVarlenM& g, const cuda::gemm::Fp8ZIn& z, const float* pair_score,
                      const std::int32_t* pair, const cuda::gemm::Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  using namespace cuda::gemm;
  using namespace cuda::gemm::sm90;
  SONICMOE_CHECK(g.gather && g.b_kn && g.elem == DType::bf16, "bf16_dgated_fp8z: gathered bf16 rows, B as [E, k, n]");
  using Epi = EpiDgatedFp8<Activation::swiglu>;
  const typename Epi::Params p{z.q,  z.scale, pair_score, pair, dz.z, dz.q, dz.scale, as, ds_partial,
                               g.rows, g.n};
  if (dgated_mma_gather(g.k)) launch_varlen_m<VarlenMMmaGatherBknCfgOf<cutlass::bfloat16_t>, Epi>(g, p);
  else launch_varlen_m<VarlenMWideGatherBknCfgOf<cutlass::bfloat16_t>, Epi>(g, p);
}

}  // namespace sonicmoe::bench

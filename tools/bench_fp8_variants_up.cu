// sonicmoe-bench-gemm fp8: the up+act launches of the FP8 consumer-loop variants (bench_fp8_variants.h).
#include "bench_fp8_variants.h"

#include "cuda/gemm/instances/fp8_of.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::bench {

const char* const kFp8VariantNames[kFp8Variants] = {"v0-default", "v1-split64", "v2-bn256", "v3-bn256split"};

namespace {
template <int V>
void up(const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* z, __nv_bfloat16* a_out) {
  using namespace cuda::gemm;
  using namespace cuda::gemm::sm90;
  using Epi = EpiActivationTma<Activation::swiglu>;
  launch_varlen_m<VarlenMFp8Config<true, V>, Epi>(cuda::gemm::detail::fp8_as_native(g),
                                                   Epi::make_params(z, a_out, nullptr, g.n, static_cast<int>(g.rows)),
                                                   Fp8BlockScales{g.a_scale, g.b_scale});
}
}  // namespace

void fp8_variant_activation(int variant, const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* z, __nv_bfloat16* a_out) {
  switch (variant) {
    case 0: return up<0>(g, z, a_out);
    case 1: return up<1>(g, z, a_out);
    case 2: return up<2>(g, z, a_out);
    case 3: return up<3>(g, z, a_out);
  }
  SONICMOE_CHECK(false, "fp8_variant_activation: no variant ", variant);
}

}  // namespace sonicmoe::bench

// sonicmoe-bench-gemm fp8: the down (store) launches of the FP8 consumer-loop variants (bench_fp8_variants.h).
#include "bench_fp8_variants.h"

#include "cuda/gemm/instances/fp8_of.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::bench {

namespace {
template <int V>
void down(const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* c) {
  cuda::gemm::detail::fp8_store_of<cuda::gemm::sm90::VarlenMFp8Config<false, V>>(g, c, nullptr, nullptr);
}
}  // namespace

void fp8_variant_store(int variant, const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* c) {
  switch (variant) {
    case 0: return down<0>(g, c);
    case 1: return down<1>(g, c);
    case 2: return down<2>(g, c);
    case 3: return down<3>(g, c);
  }
  SONICMOE_CHECK(false, "fp8_variant_store: no variant ", variant);
}

}  // namespace sonicmoe::bench

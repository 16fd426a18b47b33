// Native varlen-M, plain store epilogue, A contiguous (TMA), B = W1 stored concatenated read N-major through the 4-mode
// descriptor in the interleaved order (w1_layout_sm90.cuh): dXe = dZ W1[e] (step 10a) under MoEConfig::w1_layout
// concatenated.
#include "cuda/gemm/instances/store_of.cuh"
#include "cuda/gemm/w1_layout_sm90.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_store_contiguous_bkn_w1_concat)(const NativeVarlenM& g, __nv_bfloat16* c) {
  using namespace sm90;
  using Epi = EpiStoreTmaOf<InstanceElement>;
  const auto ep = Epi::make_params(c, /*bias=*/nullptr, /*row_scale=*/nullptr, g.n, static_cast<int>(g.rows));
  launch_varlen_m<W1ConcatCfg<VarlenMContiguousBknCfgOf<InstanceElement>>, Epi>(g, ep);
}

}  // namespace sonicmoe::cuda::gemm::detail

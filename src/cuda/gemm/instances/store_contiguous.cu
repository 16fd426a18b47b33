// Native varlen-M, plain store epilogue, A contiguous (TMA): down-projection (B K-major) and dXe (B N-major).
// Full tiles are stored by TMA (epilogue_tma_store_sm90.cuh).
#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

void native_store_contiguous(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                             const float* row_scale) {
  using namespace sm90;
  const auto ep = EpiStoreTma::make_params(c, bias, row_scale, g.n, static_cast<int>(g.rows));
  if (g.b_kn) launch_varlen_m<VarlenMContiguousBknCfg, EpiStoreTma>(g, ep);
  else launch_varlen_m<VarlenMContiguousCfg, EpiStoreTma>(g, ep);
}

}  // namespace sonicmoe::cuda::gemm::detail

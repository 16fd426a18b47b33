// Native varlen-M, plain store epilogue, A contiguous (TMA): down-projection (B K-major) and dXe (B N-major).
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

void native_store_contiguous(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                             const float* row_scale) {
  using namespace sm90;
  const EpiStore::Params ep{c, bias, row_scale, g.n};
  if (g.b_kn) launch_varlen_m<VarlenMConfig<false, true>, EpiStore>(g, ep);
  else launch_varlen_m<VarlenMConfig<false, false>, EpiStore>(g, ep);
}

}  // namespace sonicmoe::cuda::gemm::detail

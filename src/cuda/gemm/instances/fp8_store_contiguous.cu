// FP8 varlen-M, plain store epilogue, contiguous A by TMA (the down-projection's layout), BN = 256
// (VarlenMFp8ContiguousWideCfg: why in mainloop_sm90_varlen_m_fp8.cuh).
#include "cuda/gemm/instances/fp8_of.cuh"

namespace sonicmoe::cuda::gemm::detail {

void fp8_store_contiguous(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale) {
  fp8_store_of<sm90::VarlenMFp8ContiguousWideCfg>(g, c, bias, row_scale);
}

}  // namespace sonicmoe::cuda::gemm::detail

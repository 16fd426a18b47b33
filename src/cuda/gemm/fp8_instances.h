// Instantiation groups of the FP8 varlen-M kernel (mainloop_sm90_varlen_m_fp8.cuh), one translation unit each
// (src/cuda/gemm/instances/fp8_*.cu), dispatched by fp8_gemm.cu.
#pragma once

#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/native_gemm.h"

namespace sonicmoe::cuda::gemm::detail {

void fp8_store_contiguous(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale);
void fp8_store_gathered(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale);
void fp8_activation_glu(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                        __nv_bfloat16* a_out);
void fp8_activation_plain(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, __nv_bfloat16* z,
                          __nv_bfloat16* a_out);
void fp8_dgated_glu(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                    const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial);
void fp8_dgated_plain(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                      const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial);

}  // namespace sonicmoe::cuda::gemm::detail

// Instantiation groups of the FP8 varlen-M kernel (mainloop_sm90_varlen_m_fp8.cuh), one translation unit each
// (src/cuda/gemm/instances/fp8_*.cu), dispatched by fp8_gemm.cu.
#pragma once

#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

// The bf16 groups' signatures (native_instances.h) on the FP8 arguments; Z and dZ in FP8 (Fp8ZIn, Fp8ZOut).
using Fp8ActivationInstance = void(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, const Fp8ZOut& z,
                                   __nv_bfloat16* a_out);
StoreInstance<Fp8VarlenM> fp8_store_contiguous, fp8_store_gathered;
Fp8ActivationInstance fp8_activation_glu, fp8_activation_plain;  // X's rows gathered (BN 128)
Fp8ActivationInstance fp8_activation_glu_contiguous, fp8_activation_plain_contiguous;  // rows in place (BN 256)
using Fp8DgatedInstance = void(const Fp8VarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                               const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial);
Fp8DgatedInstance fp8_dgated_glu, fp8_dgated_plain;
// dgated on bf16 operands with the FP8 Z / dZ epilogue (bf16_dgated_fp8z_*.cu).
using Bf16DgatedFp8zInstance = void(const NativeVarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                                    const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial);
Bf16DgatedFp8zInstance bf16_dgated_fp8z_glu, bf16_dgated_fp8z_plain;

}  // namespace sonicmoe::cuda::gemm::detail

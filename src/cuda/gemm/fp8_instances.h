// Instantiation groups of the FP8 varlen-M kernel (mainloop_sm90_varlen_m_fp8.cuh), one translation unit each
// (src/cuda/gemm/instances/fp8_*.cu), dispatched by fp8_gemm.cu.
#pragma once

#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

// The bf16 groups' signatures (native_instances.h) on the FP8 arguments; the up-projection's Z as Fp8ZOut.
using Fp8ActivationInstance = void(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, const Fp8ZOut& z,
                                   __nv_bfloat16* a_out);
StoreInstance<Fp8VarlenM> fp8_store_contiguous, fp8_store_gathered;
Fp8ActivationInstance fp8_activation_glu, fp8_activation_plain;
DgatedInstance<Fp8VarlenM> fp8_dgated_glu, fp8_dgated_plain;

}  // namespace sonicmoe::cuda::gemm::detail

// Consumer-loop variants of the FP8 varlen-M GEMM (VarlenMFp8Config's kVariant, mainloop_sm90_varlen_m_fp8.cuh),
// instantiated for sonicmoe-bench-gemm only (bench_fp8_variants_*.cu); the library's instances are variant 0.
#pragma once

#include <cuda_bf16.h>

#include "cuda/gemm/fp8_gemm.h"

namespace sonicmoe::bench {

constexpr int kFp8Variants = 4;
extern const char* const kFp8VariantNames[kFp8Variants];
// up+act of the bench: Z and A = swiglu(Z), gathered A (g.gather set).
void fp8_variant_activation(int variant, const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* z, __nv_bfloat16* a_out);
// down of the bench: C = A B^T, contiguous A, no bias / row scale.
void fp8_variant_store(int variant, const cuda::gemm::Fp8VarlenM& g, __nv_bfloat16* c);

}  // namespace sonicmoe::bench

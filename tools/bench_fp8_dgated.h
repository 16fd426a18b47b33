// The FP8 layer's step 7 on the bf16 dgated kernels (dO and W2 in bf16, their 128 x 256 tile) with the FP8 dgated
// epilogue (Z read as 1x128 codes, dZ written in bf16 and as codes): instantiated for sonicmoe-bench-gemm only
// (bench_fp8_dgated.cu), against the FP8 dgated GEMM the layer runs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/native_gemm.h"

namespace sonicmoe::bench {

// swiglu; g as for native_varlen_m_dgated (gathered dO rows, B = W2 [E, H, I] as [E, k, n]); ds_partial
// [native_dgated_n_tiles(n) * rows]. The kernel layout by K as the library's dgated (dgated_mma_gather).
void bf16_dgated_fp8z(const cuda::gemm::NativeVarlenM& g, const cuda::gemm::Fp8ZIn& z, const float* pair_score,
                      const std::int32_t* pair, const cuda::gemm::Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial);

}  // namespace sonicmoe::bench

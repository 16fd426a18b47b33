# CUDA sources of the library (each a small translation unit: few template instantiations per file).
set(SONICMOE_CUDA_SOURCES
)
# The grouped GEMM engines (src/cuda/gemm): the native stages (moe_gemms.cu) and dispatch (native_gemm.cu), the FP8
# blockwise varlen-M entry (fp8_gemm.h) and varlen-K kernel (fp8_varlen_k.cu), and one small instantiation file per kernel variant (instances/): each
# varlen-M epilogue family once native (<family>.cu) and once FP8 (fp8_<family>.cu), then the native-only variants.
set(SONICMOE_GEMM_INSTANCE_DIR ${CMAKE_CURRENT_LIST_DIR}/gemm/instances)
list(APPEND SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/gemm/tma_encode.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/moe_gemms.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/native_gemm.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/fp8_gemm.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/fp8_varlen_k.cu
)
foreach(family store_contiguous store_gathered activation_glu activation_plain dgated_glu dgated_plain)
  list(APPEND SONICMOE_CUDA_SOURCES ${SONICMOE_GEMM_INSTANCE_DIR}/${family}.cu
       ${SONICMOE_GEMM_INSTANCE_DIR}/fp8_${family}.cu)
endforeach()
# The native-only variants, one file each: dgated on the four-warpgroup layout (*_wide); the FP8 layer's dgated on bf16
# operands with the FP8 epilogue (bf16_dgated_fp8z_*); the FP8 up-projection on rows already in place (*_contiguous);
# W1 stored concatenated (MoEConfig::w1_layout): the up-projection, dXe and dW1 kernels of that layout; the weight
# gradients added into an f32 D (varlen_k_accum*: an fp32 main_grad).
foreach(variant dgated_glu_wide dgated_plain_wide bf16_dgated_fp8z_glu bf16_dgated_fp8z_plain
        fp8_activation_glu_contiguous fp8_activation_plain_contiguous varlen_k varlen_k_tma_q
        varlen_k_tma_q_t w1_concat_up w1_concat_dxe
        varlen_k_w1_concat varlen_k_accum varlen_k_accum_tma varlen_k_accum_w1_concat)
  list(APPEND SONICMOE_CUDA_SOURCES ${SONICMOE_GEMM_INSTANCE_DIR}/${variant}.cu)
endforeach()
# The same native kernels for f16 operands: each native instantiation file compiled again through its wrapper in
# instances/f16/ (instance_element.h), so the f16 kernels are separate translation units beside the bf16 ones.
foreach(variant store_contiguous store_gathered activation_glu activation_plain dgated_glu dgated_plain dgated_glu_wide
        dgated_plain_wide varlen_k varlen_k_tma_q varlen_k_tma_q_t w1_concat_up w1_concat_dxe varlen_k_w1_concat
        varlen_k_accum varlen_k_accum_tma varlen_k_accum_w1_concat)
  list(APPEND SONICMOE_CUDA_SOURCES ${SONICMOE_GEMM_INSTANCE_DIR}/f16/${variant}.cu)
endforeach()
# The expert bias gradients of the weight-gradient stages. (The backend's size limits, cuda_limits.cpp, are plain C++
# in the library's main list: src/moe/stages.cpp checks them.)
list(APPEND SONICMOE_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/elementwise/expert_bias_grad.cu)
# Routing and memory-bound kernels (src/cuda/routing, src/cuda/aggregate).
list(APPEND SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/routing/routing.cu
  ${CMAKE_CURRENT_LIST_DIR}/routing/metadata.cu
  ${CMAKE_CURRENT_LIST_DIR}/routing/token_rounding.cu
  ${CMAKE_CURRENT_LIST_DIR}/aggregate/aggregate.cu
)
# FP8 blockwise quantisers (src/cuda/quant).
list(APPEND SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/quant/quant_rows.cu
  ${CMAKE_CURRENT_LIST_DIR}/quant/quant_transpose.cu
  ${CMAKE_CURRENT_LIST_DIR}/quant/quant_dequant.cu
)
# The FP8 blockwise layer's expert part (src/cuda/fp8) on the FP8 GEMMs (gemm/fp8_gemm.h).
list(APPEND SONICMOE_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/fp8/fp8_layer.cu
     ${CMAKE_CURRENT_LIST_DIR}/fp8/fp8_weight_grads.cu)
# Dispatched-token entries and expert parallelism: index kernels (src/cuda/dispatch).
list(APPEND SONICMOE_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/dispatch/dispatch_kernels.cu)

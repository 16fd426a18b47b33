# CUDA sources of the library (each a small translation unit: few template instantiations per file).
set(SONICMOE_CUDA_SOURCES
)
# The native grouped GEMM engine (src/cuda/gemm): the stages (moe_gemms.cu), the dispatch (native_gemm.cu), one
# small instantiation file per kernel variant (instances/).
list(APPEND SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/gemm/tma_encode.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/moe_gemms.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/native_gemm.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/store_contiguous.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/store_gathered.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/activation_glu.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/activation_plain.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/dgated_glu.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/dgated_plain.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/dgated_glu_wide.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/dgated_plain_wide.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/varlen_k.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/varlen_k_tma_q.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/varlen_k_tma_q_t.cu
)
# FP8 blockwise varlen-M GEMM (fp8_gemm.h): entry + one file per kernel family.
list(APPEND SONICMOE_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/gemm/fp8_gemm.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_store_contiguous.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_store_gathered.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_activation_glu.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_activation_plain.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_dgated_glu.cu
  ${CMAKE_CURRENT_LIST_DIR}/gemm/instances/fp8_dgated_plain.cu
)
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
list(APPEND SONICMOE_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/fp8/fp8_layer.cu)
# Dispatched-token entries and expert parallelism: index kernels (src/cuda/dispatch).
list(APPEND SONICMOE_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/dispatch/dispatch_kernels.cu)

# CUDA test suites; each links the library (CPU reference included) and compares against it.
sonicmoe_add_test(test_cuda_layer cuda/test_layer.cpp cuda/test_main_grad_cuda.cpp)
sonicmoe_add_test(test_cuda_gemm cuda/test_gemm.cpp)
target_link_libraries(test_cuda_gemm PRIVATE sonicmoe_baselines)  # the CUTLASS grouped GEMM on the same cases
sonicmoe_add_test(test_cuda_gemm_stages cuda/test_gemm_stages.cpp)
# The FP8 blockwise varlen-M GEMM (store, activation, dgated) vs fp64 loops on the dequantised operands.
sonicmoe_add_test(test_cuda_fp8_gemm cuda/test_fp8_gemm.cpp)
sonicmoe_add_test(test_cuda_elementwise cuda/test_elementwise.cpp)
target_link_libraries(test_cuda_elementwise PRIVATE sonicmoe_baselines)  # the unfused kernels
sonicmoe_add_test(test_cuda_routing cuda/test_routing.cpp)
target_link_libraries(test_cuda_routing PRIVATE sonicmoe_baselines)  # the radix-sort metadata
# Host-only checks of the native GEMMs' shared-memory addressing against CuTe (runs without a GPU).
sonicmoe_add_test(test_gemm_layouts cuda/test_gemm_layouts.cu)
target_include_directories(test_gemm_layouts SYSTEM PRIVATE ${SONICMOE_CUTLASS_INCLUDE})
target_compile_options(test_gemm_layouts PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)
# W1 stored concatenated, read through a TMA descriptor in the interleaved order (host checks without a GPU; one GPU
# tile load both ways).
sonicmoe_add_test(test_w1_layout cuda/test_w1_layout.cu)
target_include_directories(test_w1_layout SYSTEM PRIVATE ${SONICMOE_CUTLASS_INCLUDE})
target_compile_options(test_w1_layout PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)
# The activation functions evaluated on the GPU (fast sigmoid) against double precision.
sonicmoe_add_test(test_cuda_activation cuda/test_activation_device.cu)
target_compile_options(test_cuda_activation PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)
# FP8 quantisers vs the CPU reference, bitwise (GPU); the e4m3 codec vs cuda_fp8.h's host conversions and the
# transposing quantisers' shared-memory tile (no GPU).
sonicmoe_add_test(test_cuda_quant cuda/test_quant.cpp cuda/test_fp8_host_cvt.cpp cuda/test_quant_layout.cpp)
target_link_libraries(test_cuda_quant PRIVATE GTest::gmock)
# The FP8 blockwise layer on the GPU vs the CPU reference FP8 layer and the bf16 GPU layer (precision gate); the FP8
# dequantiser and scale-transpose kernels bitwise vs the CPU.
sonicmoe_add_test(test_cuda_fp8_layer cuda/test_fp8_layer_cuda.cpp cuda/test_fp8_wgrad_cuda.cpp)
target_link_libraries(test_cuda_fp8_layer PRIVATE GTest::gmock)
# Dispatched-token entries (DeepEP, Megatron contracts) vs the CPU reference; the EP layer over NCCL, one rank per
# GPU (up to 2), vs the single-GPU layer.
sonicmoe_add_test(test_cuda_ep cuda/test_ep_cuda.cpp)
if(SONICMOE_WITH_NCCL)
  target_compile_definitions(test_cuda_ep PRIVATE SONICMOE_WITH_NCCL=1)
  target_include_directories(test_cuda_ep SYSTEM PRIVATE ${SONICMOE_NCCL_INCLUDE})
endif()

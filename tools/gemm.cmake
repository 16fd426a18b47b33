# sonicmoe-bench-gemm: the grouped GEMM engine against cuBLAS on the MoE shapes (CUDA builds only).
# bench_fp8_variants_*.cu: the FP8 consumer-loop variants (VarlenMFp8Config's kVariant) its fp8 mode compares.
add_executable(sonicmoe-bench-gemm ${CMAKE_CURRENT_LIST_DIR}/bench_gemm.cu ${CMAKE_CURRENT_LIST_DIR}/bench_fp8_variants_up.cu
               ${CMAKE_CURRENT_LIST_DIR}/bench_fp8_variants_down.cu)
target_link_libraries(sonicmoe-bench-gemm PRIVATE sonicmoe sonicmoe_baselines CUDA::cudart CUDA::cublas CUDA::cublasLt)
target_include_directories(sonicmoe-bench-gemm PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(sonicmoe-bench-gemm PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)
target_include_directories(sonicmoe-bench-gemm SYSTEM PRIVATE ${SONICMOE_CUTLASS_INCLUDE})

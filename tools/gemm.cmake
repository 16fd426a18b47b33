# sonicmoe-bench-gemm: the grouped GEMM engine against cuBLAS on the MoE shapes (CUDA builds only).
add_executable(sonicmoe-bench-gemm ${CMAKE_CURRENT_LIST_DIR}/bench_gemm.cu)
target_link_libraries(sonicmoe-bench-gemm PRIVATE sonicmoe sonicmoe_baselines CUDA::cudart CUDA::cublas CUDA::cublasLt)
target_include_directories(sonicmoe-bench-gemm PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(sonicmoe-bench-gemm PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)

# sonicmoe-bench-quant: the FP8 quantisers' GB/s against a device-to-device copy (CUDA builds only).
add_executable(sonicmoe-bench-quant ${CMAKE_CURRENT_LIST_DIR}/bench_quant.cu)
target_link_libraries(sonicmoe-bench-quant PRIVATE sonicmoe CUDA::cudart)
target_include_directories(sonicmoe-bench-quant PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(sonicmoe-bench-quant PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)

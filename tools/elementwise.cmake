# sonicmoe-bench-elementwise: the standalone memory-bound MoE kernels vs a device-to-device copy (CUDA builds only).
add_executable(sonicmoe-bench-elementwise ${CMAKE_CURRENT_LIST_DIR}/bench_elementwise.cu)
target_link_libraries(sonicmoe-bench-elementwise PRIVATE sonicmoe sonicmoe_baselines CUDA::cudart)
target_include_directories(sonicmoe-bench-elementwise PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(sonicmoe-bench-elementwise PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)

# sonicmoe-bench-routing: routing and memory-bound CUDA stages (CUDA builds only).
add_executable(sonicmoe-bench-routing ${CMAKE_CURRENT_LIST_DIR}/bench_routing.cu)
target_link_libraries(sonicmoe-bench-routing PRIVATE sonicmoe sonicmoe_baselines CUDA::cudart CUDA::cublas)
target_include_directories(sonicmoe-bench-routing PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
target_compile_options(sonicmoe-bench-routing PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${SONICMOE_CUDA_FLAGS}>)

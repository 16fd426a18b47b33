# CUDA test suites; each links the library (CPU reference included) and compares against it.
sonicmoe_add_test(test_cuda_layer cuda/test_layer.cpp)
sonicmoe_add_test(test_cuda_gemm cuda/test_gemm.cpp)
sonicmoe_add_test(test_cuda_gemm_stages cuda/test_gemm_stages.cpp)
sonicmoe_add_test(test_cuda_elementwise cuda/test_elementwise.cpp)
sonicmoe_add_test(test_cuda_routing cuda/test_routing.cpp)

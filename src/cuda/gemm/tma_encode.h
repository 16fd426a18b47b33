// Every TMA descriptor of the library is encoded by sonicmoe_tma_encode_tiled (tma_encode.cu), never by CuTe's own
// call into the driver: CuTe reports a failed cuTensorMapEncodeTiled on std::cerr and asserts, which inside a
// PyTorch extension took the whole process down. The sonicmoe target compiles its CUDA sources (and those of every
// target that links it) with
//     CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL  cuTensorMapEncodeTiled=sonicmoe_tma_encode_tiled
// (src/CMakeLists.txt), so CuTe's make_tma_copy calls the function below. It checks the driver's documented
// preconditions itself, calls the driver through its entry point, and on any failure records a message (address,
// dims, strides, box) and hands CuTe a zeroed descriptor with success; the launch site then calls
// tma::check_encoded("what"), which throws sonicmoe::Error naming the tensor before anything is launched.
#pragma once

#include <cuda.h>

namespace sonicmoe::cuda::tma {

// Throws sonicmoe::Error("<what>: ...") if a descriptor encoded on this thread since the last call failed; clears it.
void check_encoded(const char* what);

// The preconditions of cuTensorMapEncodeTiled checked on the host; "" when they hold, else why not (exposed for the
// layout tests, which run without a GPU).
const char* tiled_precondition_error(CUtensorMapDataType type, cuuint32_t rank, const void* address,
                                     const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                     const cuuint32_t* element_strides, CUtensorMapInterleave interleave);

}  // namespace sonicmoe::cuda::tma

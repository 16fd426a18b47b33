// The element type of an instantiation file: bf16, or f16 where the file is compiled a second time through its
// wrapper in f16/ (SONICMOE_INSTANCE_F16 defined), whose entry points carry the suffix _f16 (native_instances.h
// declares both sets; native_gemm.cu picks by NativeVarlenM::elem / NativeVarlenK::elem).
#pragma once

#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#ifdef SONICMOE_INSTANCE_F16
#define SONICMOE_INSTANCE(name) name##_f16
#else
#define SONICMOE_INSTANCE(name) name
#endif

namespace sonicmoe::cuda::gemm::detail {
#ifdef SONICMOE_INSTANCE_F16
using InstanceElement = cutlass::half_t;
#else
using InstanceElement = cutlass::bfloat16_t;
#endif
}  // namespace sonicmoe::cuda::gemm::detail

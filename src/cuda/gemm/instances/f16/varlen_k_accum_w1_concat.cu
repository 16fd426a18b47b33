// varlen_k_accum_w1_concat.cu instantiated for f16 operands (instance_element.h): the same kernels, entry points
// suffixed _f16.
#define SONICMOE_INSTANCE_F16 1
#include "cuda/gemm/instances/varlen_k_accum_w1_concat.cu"

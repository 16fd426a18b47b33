// Native varlen-K (weight gradients): P rows by TMA (contiguous) or gathered by cp.async; Q always by cp.async.
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/native_instances.h"

namespace sonicmoe::cuda::gemm::detail {

void native_varlen_k_contiguous_p(const NativeVarlenK& g) { sm90::launch_varlen_k<sm90::VarlenKConfig<false>>(g); }
void native_varlen_k_gathered_p(const NativeVarlenK& g) { sm90::launch_varlen_k<sm90::VarlenKConfig<true>>(g); }

}  // namespace sonicmoe::cuda::gemm::detail

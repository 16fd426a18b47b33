// varlen-K grouped GEMM instantiation (weight gradients): D[e] = P_e^T Q_e, the reduction running over
// expert e's rows. A = P^T is M-major, B = Q is N-major; TMA zero-fills the ragged K tail.
#include "baselines/cutlass/grouped_gemm_sm90.cuh"
#include "baselines/cutlass/grouped_setup.cuh"

namespace sonicmoe::baselines::detail {

using CoopK = CooperativeGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

std::size_t varlen_k_cutlass_workspace(int groups, int sm_count) { return CoopK::workspace_bytes(groups, sm_count); }

void varlen_k_run(const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  run_grouped<CoopK>(varlen_k_setup_kernel<CoopK>, args, ws, sm_count, stream);
}

}  // namespace sonicmoe::baselines::detail

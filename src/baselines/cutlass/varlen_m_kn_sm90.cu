// varlen-M grouped GEMM with B stored [E, k, n] (N-major): dXe = dZ W1[e] (step 10a) reads the up-projection
// weights without a transposed copy. Cooperative 128x256 tile.
#include "baselines/cutlass/grouped_gemm_sm90.cuh"
#include "baselines/cutlass/grouped_setup.cuh"

namespace sonicmoe::baselines::detail {

using CoopKN = CooperativeGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor>;

std::size_t varlen_m_kn_cutlass_workspace(int groups, int sm_count) { return CoopKN::workspace_bytes(groups, sm_count); }

void varlen_m_kn_run(const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  run_grouped<CoopKN>(varlen_m_setup_kernel<CoopKN, true>, args, ws, sm_count, stream);
}

}  // namespace sonicmoe::baselines::detail

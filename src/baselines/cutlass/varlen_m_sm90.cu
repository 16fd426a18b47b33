// varlen-M grouped GEMM instantiations: C rows grouped by expert, B = per-expert [n, k] weights; cooperative and
// ping-pong (grouped_gemm_sm90.cuh).
#include "baselines/cutlass/grouped_gemm_sm90.cuh"
#include "baselines/cutlass/grouped_setup.cuh"

namespace sonicmoe::baselines::detail {
namespace {
using Coop = CooperativeGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
using Pingpong = PingpongGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
}  // namespace

std::size_t varlen_m_cutlass_workspace(Schedule s, int groups, int sm_count) {
  return s == Schedule::cutlass_pingpong ? Pingpong::workspace_bytes(groups, sm_count)
                                         : Coop::workspace_bytes(groups, sm_count);
}

void varlen_m_run(Schedule s, const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  if (s == Schedule::cutlass_pingpong) {
    run_grouped<Pingpong>(varlen_m_setup_kernel<Pingpong, false>, args, ws, sm_count, stream);
  } else {
    run_grouped<Coop>(varlen_m_setup_kernel<Coop, false>, args, ws, sm_count, stream);
  }
}

}  // namespace sonicmoe::baselines::detail

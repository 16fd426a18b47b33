// varlen-M grouped GEMM instantiations: C rows grouped by expert, B = per-expert [n, k] weights.
// Two kernels: cooperative (128x256 tile, two consumer warpgroups share a tile) and ping-pong
// (128x128 tile per consumer warpgroup, one warpgroup's epilogue under the other's MMA).
#include "baselines/cutlass/grouped_gemm_sm90.cuh"
#include "baselines/cutlass/grouped_setup.cuh"

namespace sonicmoe::baselines::detail {
namespace {
using namespace cute;
using Coop = GroupedGemmSm90<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_128, _256, _64>, ClusterM>;
using Pingpong = GroupedGemmSm90<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                                 cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, Shape<_128, _128, _64>, ClusterM>;

template <class G>
void run_one(const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  typename G::Arrays arr = G::carve(ws, args.groups);
  varlen_m_setup_kernel<G><<<(args.groups + 127) / 128, 128, 0, stream>>>(arr, args);
  SONICMOE_CUDA_CHECK_LAUNCH();
  G::run(arr, args.groups, ws, sm_count, stream);
}
}  // namespace

std::size_t varlen_m_cutlass_workspace(Schedule s, int groups, int sm_count) {
  return s == Schedule::cutlass_pingpong ? Pingpong::workspace_bytes(groups, sm_count)
                                 : Coop::workspace_bytes(groups, sm_count);
}

void varlen_m_run(Schedule s, const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  if (s == Schedule::cutlass_pingpong) run_one<Pingpong>(args, ws, sm_count, stream);
  else run_one<Coop>(args, ws, sm_count, stream);
}

}  // namespace sonicmoe::baselines::detail

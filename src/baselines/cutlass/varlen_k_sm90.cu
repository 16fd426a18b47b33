// varlen-K grouped GEMM instantiation (weight gradients): D[e] = P_e^T Q_e, the reduction running over
// expert e's rows. A = P^T is M-major, B = Q is N-major; TMA zero-fills the ragged K tail.
#include "baselines/cutlass/grouped_gemm_sm90.cuh"
#include "baselines/cutlass/grouped_setup.cuh"

namespace sonicmoe::baselines::detail {
namespace {
using namespace cute;
using Coop = GroupedGemmSm90<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_128, _256, _64>, ClusterM>;
}  // namespace

std::size_t varlen_k_cutlass_workspace(int groups, int sm_count) { return Coop::workspace_bytes(groups, sm_count); }

void varlen_k_run(const GroupedArgs& args, void* ws, int sm_count, cudaStream_t stream) {
  Coop::Arrays arr = Coop::carve(ws, args.groups);
  varlen_k_setup_kernel<Coop><<<(args.groups + 127) / 128, 128, 0, stream>>>(arr, args);
  SONICMOE_CUDA_CHECK_LAUNCH();
  Coop::run(arr, args.groups, ws, sm_count, stream);
}

}  // namespace sonicmoe::baselines::detail

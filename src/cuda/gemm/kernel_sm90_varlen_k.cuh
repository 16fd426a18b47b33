// The native varlen-K GEMM on Hopper (DESIGN.md section 5, steps 8-9): per expert e,
//   D[e] (m x n) = sum over rows r in [offsets[e], offsets[e+1]) of P[gp(r), :]^T Q[gq(r), :]
// with gp / gq an index array or the identity. As a GEMM: A(i, k) = P[gp(k), i], B(j, k) = Q[gq(k), j], both
// M/N-major ("transposed" wgmma operands), the reduction running over the expert's rows.
// Work units are (expert, M tile, N tile): their number is known on the host, each unit's K length only on
// the device. Three warpgroups: 0 = four producer warps (the cp.async issue rate needs them), 1-2 = cooperative
// MMA (128 x 256 tile, one 64x256 wgmma per k-step) that write their tile into a swizzled staging tile, which one
// of them stores by TMA while the next K loop runs (VarlenKConfig). Producer: Q rows by cp.async (gathered or identity),
// P rows by cp.async when gathered, else by TMA (with gathered P and contiguous Q, kTmaQ: Q by TMA, P by cp.async).
// The k-tile that runs past a unit's last row comes by zero-filling cp.async on both sides: rows of other experts,
// and rows past offsets[E] that nobody wrote (a capacity's dropped rows), never enter the sum, whatever they hold.
// Experts without rows get zeros. The roles: tile_scheduler_varlen_k.cuh (work units), mainloop_sm90_varlen_k.cuh
// (configuration, producer; the consumers' K loop is mma_k_loop of mainloop_sm90_varlen_m.cuh),
// epilogue_sm90_varlen_k.cuh (the tile store). This file composes them and holds the host launcher. Included only
// by instantiation .cu files.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "core/cuda_check.h"
#include "cuda/gemm/epilogue_sm90_varlen_k.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_k.cuh"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gemm/tile_scheduler_varlen_k.cuh"
#include "cuda/gemm/tma_encode.h"

namespace sonicmoe::cuda::gemm::sm90 {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    varlen_k_kernel(const __grid_constant__ VarlenKKernelParams<Cfg> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  auto& s = *reinterpret_cast<VarlenKSmem<Cfg>*>(base);
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::Stages; ++i) {
      Barrier::init(&s.full[i], 1 + Cfg::kProducerThreads);
      Barrier::init(&s.empty[i], Cfg::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
    if constexpr (!Cfg::kGatherP) prefetch_tma_descriptor(p.tma_p.get_tma_descriptor());
    if constexpr (Cfg::kTmaQ) prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
  }
  __syncthreads();
  const int units = p.num_experts * p.m_tiles * p.n_tiles;
  const int wg = warp_uniform(threadIdx.x / 128);
  if (wg == 0) {  // one if/else on the role: ptxas applies setmaxnreg only so
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kLightRegs>();
    varlen_k_produce<Cfg>(p, s, units);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    typename Cfg::TiledMma mma;
    Tensor tCrA = mma_fragment_a<Cfg>(mma, s, wg);
    Tensor tCrB = mma_fragment_b<Cfg>(mma, s, wg);
    Tensor acc = partition_fragment_C(mma, make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{}));  // ((2,2,32), 1, 1)
    Tensor crd = mma.get_slice(threadIdx.x - 128)
                     .partition_C(make_identity_tensor(make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{})));
    const bool lane0 = (threadIdx.x & 31) == 0;
    const bool issuer = threadIdx.x == Cfg::kProducerThreads;  // the thread that issues the TMA stores
    PipeState<Cfg::Stages> rd;
    for (int t = blockIdx.x; t < units; t += gridDim.x) {
      const VarlenKUnit u = varlen_k_unit(p, t);
      const int k_tiles = (u.row_end - u.row_begin + Cfg::BK - 1) / Cfg::BK;
      if (k_tiles > 0) mma_k_loop<Cfg>(mma, acc, tCrA, tCrB, s, rd, k_tiles, lane0);
      const bool zero = k_tiles == 0;  // an expert without rows: D[e] = 0 (the accumulators are not read)
      varlen_k_store_tile<Cfg>(p, s, u, zero, issuer, acc, crd);
    }
    if (issuer) tma_store_wait<0>();  // shared memory stays until the last store has read it
  }
#endif
}

template <class Cfg>
void launch_varlen_k(const NativeVarlenK& g) {
  using El = typename Cfg::Element;
  VarlenKKernelParams<Cfg> p;
  p.tma_p = Cfg::make_tma_p(reinterpret_cast<const El*>(g.p), g.m, static_cast<int>(g.p_rows));
  tma::check_encoded("the varlen-K GEMM's P operand [p_rows, m]");
  if constexpr (Cfg::kTmaQ) p.tma_q = Cfg::make_tma_q(reinterpret_cast<const El*>(g.q), g.n, static_cast<int>(g.q_rows));
  tma::check_encoded("the varlen-K GEMM's Q operand [q_rows, n]");
  p.p = reinterpret_cast<const El*>(g.p);
  p.p_gather = g.p_gather;
  p.p_rows = static_cast<int>(g.p_rows);
  p.q = reinterpret_cast<const El*>(g.q);
  p.q_gather = g.q_gather;
  p.q_rows = static_cast<int>(g.q_rows);
  p.offsets = g.offsets;
  p.rows = static_cast<int>(g.rows);
  p.num_experts = g.num_experts;
  p.m = g.m;
  p.n = g.n;
  p.m_tiles = (g.m + Cfg::BM - 1) / Cfg::BM;
  p.n_tiles = (g.n + Cfg::BN - 1) / Cfg::BN;
  p.d = g.d;
  p.d_f32 = nullptr;
  p.d_part_stride = p.d_expert_stride = 0;
  if constexpr (Cfg::kAccumF32) {  // D += the tiles, in fp32 in place (no TMA store)
    p.d_f32 = g.d_f32;
    if constexpr (Cfg::kConcatD) {  // D = dW1 [E, 2I, H] in two parts; 0: the concatenated strides
      const std::int64_t zw = Cfg::kTransposeD ? g.n : g.m, h = Cfg::kTransposeD ? g.m : g.n;
      p.d_part_stride = g.d_w1_part_stride ? g.d_w1_part_stride : zw / 2 * h;
      p.d_expert_stride = g.d_w1_expert_stride ? g.d_w1_expert_stride : zw * h;
    } else if constexpr (Cfg::kAccumTma) {  // D [E, m, n] (or [E, n, m] transposed) by TMA reduce-add
      p.red = TmaReduceF32::make(g.d_f32, Cfg::kTransposeD ? g.n : g.m, Cfg::kTransposeD ? g.m : g.n, g.num_experts);
      tma::check_encoded("the varlen-K GEMM's f32 output D [E, m, n] (TMA reduce-add)");
    }
  } else if constexpr (Cfg::kConcatD) {  // D = dW1 concatenated: its 2I rows are n when transposed (the swapped g), else m
    p.out_c = decltype(p.out_c)::make(g.d, Cfg::kTransposeD ? g.n : g.m, Cfg::kTransposeD ? g.m : g.n, g.num_experts,
                                      {g.d_w1_part_stride, g.d_w1_expert_stride});
  } else if constexpr (Cfg::kTransposeD) {
    p.out_t = TmaOutBoxes<Cfg::BN>::make(g.d, g.num_experts * g.n, g.m);
  } else {
    p.out = TmaOut::make(g.d, g.num_experts * g.m, g.n);
  }
  if constexpr (!Cfg::kAccumF32) tma::check_encoded("the varlen-K GEMM's output D [E, m, n] (TMA store)");
  const long long units = static_cast<long long>(p.num_experts) * p.m_tiles * p.n_tiles;
  constexpr std::size_t smem = sizeof(VarlenKSmem<Cfg>) + 1024;
  static_assert(smem <= 232448, "shared memory beyond 227 KB");
  auto kernel = varlen_k_kernel<Cfg>;
  SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int sms = current_sm_count();
  const int grid = static_cast<int>(units < sms ? units : sms);
  kernel<<<grid, Cfg::kThreads, smem, g.stream>>>(p);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::cuda::gemm::sm90

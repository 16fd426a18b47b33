// Epilogue of the native varlen-K GEMM (kernel_sm90_varlen_k.cuh): the consumers' store of one work unit's tile of
// D. A full tile goes through the swizzled staging tile (s.d) and is stored by TMA by one thread (`issuer`) while the
// next K loop runs; a tile whose D rows run past the expert's (m % 128, or n % 256 when transposed) is stored from
// registers (store_direct; store_transposed with its per-warp scratch in the staging tile). `zero`: an expert
// without rows, D[e] = 0 (the accumulators are not read).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/gemm/epilogue_sm90.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_k.cuh"
#include "cuda/gemm/tma_store_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

inline constexpr int kConsumerBarrier = 1;  // named barrier of the two consumer warpgroups (0 is __syncthreads)

template <class Cfg, class Acc, class Crd>
__device__ __forceinline__ void varlen_k_store_tile(const VarlenKKernelParams<Cfg>& p, VarlenKSmem<Cfg>& s,
                                                    const VarlenKUnit& u, bool zero, bool issuer, Acc& acc, Crd& crd) {
  using namespace cute;
  const int m0 = u.m_tile * Cfg::BM;
  const int m_rows = p.m - m0 < Cfg::BM ? p.m - m0 : Cfg::BM;
  const int n0 = u.n_tile * Cfg::BN;
  using E = typename Cfg::Element;
  const auto value = [zero](float v0, float v1, int, int) { return zero ? 0u : Elem16<E>::pack(v0, v1); };
  // The previous tile's store has read the staging tile; then all 256 consumer threads may overwrite it.
  if (issuer) tma_store_wait<0>();
  cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
  if constexpr (Cfg::kConcatD) {  // dW1 concatenated: every tile by TMA, the descriptor clips the expert's rows
    if constexpr (Cfg::kTransposeD) stage_transposed_swizzled<Cfg>(acc, crd, s.d, value);
    else stage_swizzled<Cfg>(acc, crd, s.d, value);
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
    if (issuer) {
      if constexpr (Cfg::kTransposeD) tma_store_boxes_w1_concat<Cfg::BM>(p.out_c, u.expert, n0, m0, s.d);
      else tma_store_boxes_w1_concat<Cfg::BN>(p.out_c, u.expert, m0, n0, s.d);
    }
    (void)m_rows;
  } else if constexpr (Cfg::kTransposeD) {
    if (p.n - n0 >= Cfg::BN) {  // all 256 D rows (tile columns) belong to this expert
      stage_transposed_swizzled<Cfg>(acc, crd, s.d, value);
      cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
      if (issuer) tma_store_boxes<Cfg::BM>(p.out_t, u.expert * p.n + n0, m0, s.d);
    } else {
      store_transposed<E>(p.d + static_cast<std::int64_t>(u.expert) * p.m * p.n, p.m, m0, m_rows, n0, p.n,
                       acc(_, 0, 0), crd(_, 0, 0), zero,
                       s.d + (threadIdx.x - Cfg::kProducerThreads) / 32 * kTrScratchElems);
    }
  } else {
    if (m_rows == Cfg::BM) {  // all 128 D rows belong to this expert
      stage_swizzled<Cfg>(acc, crd, s.d, value);
      cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
      if (issuer) tma_store_tile<Cfg>(p.out, u.expert * p.m + m0, n0, s.d);
    } else {
      store_direct<E>(p.d, p.n, static_cast<std::int64_t>(u.expert) * p.m + m0, m_rows, n0, p.n, acc(_, 0, 0),
                   crd(_, 0, 0), zero);
    }
  }
}

}  // namespace sonicmoe::cuda::gemm::sm90

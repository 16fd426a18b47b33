// Epilogue of the native varlen-K GEMM (kernel_sm90_varlen_k.cuh): the consumers' store of one work unit's tile of
// D. A full tile goes through the swizzled staging tile (s.d) and is stored by TMA by one thread (`issuer`) while the
// next K loop runs; a tile whose D rows run past the expert's (m % 128, or n % 256 when transposed) is stored from
// registers (store_direct; store_transposed with its per-warp scratch in the staging tile). `zero`: an expert
// without rows, D[e] = 0 (the accumulators are not read). Cfg::kAccumF32: the tile is added into an f32 D instead
// (varlen_k_reduce_tile by TMA reduce-add with kAccumTma, else varlen_k_accumulate_tile from registers); an expert
// without rows adds nothing.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/gemm/epilogue_sm90.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_k.cuh"
#include "cuda/gemm/tma_store_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

inline constexpr int kConsumerBarrier = 1;  // named barrier of the two consumer warpgroups (0 is __syncthreads)

// Cfg::kAccumF32 without kAccumTma: D[e] += the tile in fp32, in place (the gradient-accumulation fusion of an fp32
// main_grad): each consumer thread reads, adds and writes its own accumulators' elements, with no staging tile and no
// TMA (any layout: the two-part W1 layouts too). Its 128 values are two D rows (m, m + 8) of 8-byte column pairs, or,
// when the kernel computes D^T, two D columns of 64 D rows; a warp's accesses cover 32 contiguous bytes per D row
// either way. The loads of a group of kGroup values go out before its stores, so the group pays one memory latency (a
// group as large as the consumers' 224 registers allow). Elements past the expert's m x n are not touched. The sum of
// each element is old + acc: deterministic (one tile owns each element).
template <class Cfg, class Acc, class Crd>
__device__ __forceinline__ void varlen_k_accumulate_tile(const VarlenKKernelParams<Cfg>& p, const VarlenKUnit& u,
                                                         const Acc& acc, const Crd& crd) {
  using namespace cute;
  constexpr int kVals = decltype(size(acc))::value;
  // values a group: 16 float2, or (transposed: an address each, held from the load to the store) 16 floats
  constexpr int kGroup = 32, kGroupT = 16;
  static_assert(kVals % kGroup == 0 && kVals % kGroupT == 0, "whole groups");
  const int m0 = u.m_tile * Cfg::BM, n0 = u.n_tile * Cfg::BN;
  const std::int64_t d_rows = Cfg::kTransposeD ? p.n : p.m, d_cols = Cfg::kTransposeD ? p.m : p.n;
  const auto row_ptr = [&](int r) -> float* {  // D row r of this expert
    if constexpr (Cfg::kConcatD)
      return p.d_f32 + u.expert * p.d_expert_stride + (r & 1) * p.d_part_stride +
             static_cast<std::int64_t>(r >> 1) * d_cols;
    else
      return p.d_f32 + (u.expert * d_rows + r) * d_cols;
  };
  // value i = 4g + 2h + c of the fragment: tile row m_t + 8h, tile column 8g + 2q + c
  int m[2];
  bool m_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = m0 + get<0>(crd(2 * h));
    m_ok[h] = m[h] < p.m;
  }
  if constexpr (!Cfg::kTransposeD) {  // D row m, columns n, n + 1: one float2
    float* rows[2] = {row_ptr(m_ok[0] ? m[0] : 0), row_ptr(m_ok[1] ? m[1] : 0)};
#pragma unroll
    for (int g0 = 0; g0 < kVals; g0 += kGroup) {
      float2 old[kGroup / 2];
#pragma unroll
      for (int j = 0; j < kGroup / 2; ++j) {
        const int i = g0 + 2 * j, h = (i >> 1) & 1, n = n0 + get<1>(crd(i));
        if (m_ok[h] && n < p.n) old[j] = *reinterpret_cast<const float2*>(rows[h] + n);
      }
#pragma unroll
      for (int j = 0; j < kGroup / 2; ++j) {
        const int i = g0 + 2 * j, h = (i >> 1) & 1, n = n0 + get<1>(crd(i));
        if (m_ok[h] && n < p.n)
          *reinterpret_cast<float2*>(rows[h] + n) = make_float2(old[j].x + acc(i), old[j].y + acc(i + 1));
      }
    }
  } else {  // D row n (the tile's column), column m. Value i = 4g + 2h + c is D row nq + 8g + c (nq = n0 + 2q, even),
            // at base[h][c] + g * gstride: 8 D rows apart, or 4 in a two-part layout (rows 2j and 2j + 1 in the parts)
    const int nq = n0 + get<1>(crd(0));
    const std::int64_t gstride = (Cfg::kConcatD ? 4 : 8) * d_cols;
    float* base[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c) base[h][c] = row_ptr(nq + c) + (m_ok[h] ? m[h] : 0);
#pragma unroll
    for (int g0 = 0; g0 < kVals; g0 += kGroupT) {
      float old[kGroupT];
#pragma unroll
      for (int j = 0; j < kGroupT; ++j) {
        const int i = g0 + j, h = (i >> 1) & 1, c = i & 1, n = n0 + get<1>(crd(i));
        if (m_ok[h] && n < p.n) old[j] = base[h][c][(i >> 2) * gstride];
      }
#pragma unroll
      for (int j = 0; j < kGroupT; ++j) {
        const int i = g0 + j, h = (i >> 1) & 1, c = i & 1, n = n0 + get<1>(crd(i));
        if (m_ok[h] && n < p.n) base[h][c][(i >> 2) * gstride] = old[j] + acc(i);
      }
    }
  }
}

// Cfg::kAccumTma: D[e] += the tile by TMA reduce-add (tma_reduce_sm90.cuh). The tile goes in two
// halves of 128 tile columns through the 64 KB staging tile: value i = 4g + 2h + c of a consumer's fragment is tile
// row m_t + 8h, column 8g + 2q + c, so values [0, 64) are half 0. Non-transposed, a half is D rows m0 .. m0 + 127 x
// columns n0 + 128 half ..; transposed (D^T computed), D rows n0 + 128 half .. x columns m0 ... The second half's
// reduce-adds run on under the next tile's K loop (the next store waits for their reads of shared memory).
template <class Cfg, class Acc, class Crd>
__device__ __forceinline__ void varlen_k_reduce_tile(const VarlenKKernelParams<Cfg>& p, VarlenKSmem<Cfg>& s,
                                                     const VarlenKUnit& u, bool issuer, const Acc& acc,
                                                     const Crd& crd) {
  using namespace cute;
  constexpr int kVals = decltype(size(acc))::value, kHalf = kVals / 2;
  static_assert(Cfg::BM == F32Stage::kRows && Cfg::BN == 2 * F32Stage::kCols, "two halves of 128 x 128");
  static_assert(sizeof(s.d) >= F32Stage::kBoxes * F32Stage::kBoxBytes, "a staged half fits the staging tile");
  const int m0 = u.m_tile * Cfg::BM, n0 = u.n_tile * Cfg::BN;
  const std::uint32_t base = cast_smem_ptr_to_uint(s.d);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // the previous reduce-adds (the last tile's second half, or this tile's first) have read the staging tile
    if (issuer) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
#pragma unroll
    for (int j = 0; j < kHalf; j += 2) {
      const int i = half * kHalf + j;
      const int m = get<0>(crd(i)), n = get<1>(crd(i)) - half * F32Stage::kCols;  // tile row, column in the half
      if constexpr (Cfg::kTransposeD) {  // staged row = tile column
        st_shared_f32(base + F32Stage::offset_bytes(n, m), acc(i));
        st_shared_f32(base + F32Stage::offset_bytes(n + 1, m), acc(i + 1));
      } else {
        st_shared_f32x2(base + F32Stage::offset_bytes(m, n), acc(i), acc(i + 1));
      }
    }
    cutlass::arch::fence_view_async_shared();  // these generic-proxy writes, before the TMA unit reads them
    cutlass::arch::NamedBarrier::sync(Cfg::kConsumerThreads, kConsumerBarrier);
    if (issuer) {
      if constexpr (Cfg::kTransposeD) tma_reduce_half_f32(p.red, u.expert, n0 + half * F32Stage::kCols, m0, s.d);
      else tma_reduce_half_f32(p.red, u.expert, m0, n0 + half * F32Stage::kCols, s.d);
    }
  }
}

template <class Cfg, class Acc, class Crd>
__device__ __forceinline__ void varlen_k_store_tile(const VarlenKKernelParams<Cfg>& p, VarlenKSmem<Cfg>& s,
                                                    const VarlenKUnit& u, bool zero, bool issuer, Acc& acc, Crd& crd) {
  using namespace cute;
  const int m0 = u.m_tile * Cfg::BM;
  const int m_rows = p.m - m0 < Cfg::BM ? p.m - m0 : Cfg::BM;
  const int n0 = u.n_tile * Cfg::BN;
  if constexpr (Cfg::kAccumF32) {  // an expert without rows adds nothing
    if (!zero) {
      if constexpr (Cfg::kAccumTma) varlen_k_reduce_tile<Cfg>(p, s, u, issuer, acc, crd);
      else varlen_k_accumulate_tile<Cfg>(p, u, acc, crd);
    }
    (void)m_rows, (void)n0;
    return;
  }
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

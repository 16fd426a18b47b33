// TMA stores of a varlen-M GEMM's staged output tile (the mechanism behind the epilogue policies of
// epilogue_tma_store_sm90.cuh). The consumers write the tile into the staging buffer as
// BN / 64 TMA boxes of BM x 64 bf16, each in the 128-byte swizzle, and fence the async proxy; one thread then
// stores the boxes (columns past n are clipped by the tensor map) and waits until shared memory has been read
// before the buffer is handed back. Only full tiles (BM valid rows) may go by TMA: the rows past a partial tile
// belong to the next expert.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemm/pipeline_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// Element offset of tile element (m, n) in the staging buffer: box n / 64 (BM x 64, BM * 128 bytes), row m at
// 128 bytes, its 16-byte chunk (n % 64) / 8 at chunk ((n % 64) / 8) ^ (m % 8). Box b is CuTe's K-major SW128
// atom tiled over (BM, 64), the shared-memory side of a TMA box (checked by test_gemm_layouts). The consumers'
// 4-byte writes of a warp (8 rows x 4 lanes, one column group) land in 8 distinct chunks: no bank conflicts.
template <int BM>
struct SwizzledStage {
  static constexpr int kBoxCols = 64;
  __host__ __device__ static constexpr int offset(int m, int n) {
    return (n / kBoxCols) * (BM * kBoxCols) + m * kBoxCols + ((((n % kBoxCols) >> 3) ^ (m & 7)) << 3) + (n & 7);
  }
  // offset(m0 + dm, n0 + dn) = thread_part(m0, n0) + value_part(dm, dn, m0 % 8) when n0 < 8 and dm, dn are multiples
  // of 8: a consumer thread's accumulator pairs (checked for every thread by test_gemm_layouts). After unrolling,
  // dm and dn are constants, so a staging store costs one XOR and an immediate offset.
  __host__ __device__ static constexpr int thread_part(int m0, int n0) { return m0 * kBoxCols + n0; }
  __host__ __device__ static constexpr int value_part(int dm, int dn, int sw) {
    return (dn / kBoxCols) * (BM * kBoxCols) + dm * kBoxCols + ((((dn % kBoxCols) >> 3) ^ sw) << 3);
  }
  using BoxLayout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{},
                                                 cute::make_shape(cute::Int<BM>{}, cute::Int<kBoxCols>{})));
};

inline constexpr int kTmaStoreBM = 128;  // VarlenMConfig::BM
using TmaStage = SwizzledStage<kTmaStoreBM>;

// TMA store into C [rows, n] row-major, in boxes of BoxRows x 64.
template <int BoxRows>
inline auto make_tma_store_c(const cutlass::bfloat16_t* c, int rows, int n) {
  auto g = cute::make_tensor(cute::make_gmem_ptr(c), cute::make_shape(rows, n),
                             cute::make_stride(static_cast<std::int64_t>(n), cute::_1{}));
  return cute::make_tma_copy(cute::SM90_TMA_STORE{}, g, typename SwizzledStage<BoxRows>::BoxLayout{});
}

// Where a TMA-stored output goes: the tensor map and the shape it was made for.
template <int BoxRows>
struct TmaOutBoxes {
  static constexpr int kBoxRows = BoxRows;
  decltype(make_tma_store_c<BoxRows>(nullptr, 1, 8)) tma;
  int rows = 0, n = 0;
  static TmaOutBoxes make(__nv_bfloat16* c, int rows, int n) {
    return {make_tma_store_c<BoxRows>(reinterpret_cast<const cutlass::bfloat16_t*>(c), rows, n), rows, n};
  }
};
using TmaOut = TmaOutBoxes<kTmaStoreBM>;

// Consumers: staging (swizzled boxes) = f(acc pair, row m, tile column n), then the proxy fence. Shared-space
// stores at a per-thread base plus constants (TmaStage::value_part); computing offset(m, n) per value through
// generic pointers took ~20 instructions a store, as many consumer samples as the K loop at K = 256 (ncu).
template <class Cfg, class Acc, class Crd, class F>
__device__ __forceinline__ void stage_swizzled(const Acc& acc, const Crd& crd, __nv_bfloat16* st, F&& f) {
  static_assert(Cfg::BM == kTmaStoreBM && Cfg::BN % TmaStage::kBoxCols == 0, "whole TMA boxes");
  constexpr int kVals = decltype(cute::size(acc))::value;
  const int m0 = cute::get<0>(crd(0)), n0 = cute::get<1>(crd(0));
  const std::uint32_t base = cute::cast_smem_ptr_to_uint(st) + 2u * TmaStage::thread_part(m0, n0);
  const int sw = m0 & 7;
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    const int dm = cute::get<0>(crd(i)) - m0, dn = cute::get<1>(crd(i)) - n0;  // constants once unrolled
    st_shared_u32(base + 2u * TmaStage::value_part(dm, dn, sw), f(acc(i), acc(i + 1), m0 + dm, n0 + dn));
  }
  cutlass::arch::fence_view_async_shared();  // these generic-proxy writes, before the TMA unit reads them
}

// 8 staged bf16 of row m, tile columns 8 * lane ...
__device__ __forceinline__ uint4 swizzled8(const __nv_bfloat16* st, int m, int lane) {
  return ld_shared_v4(cute::cast_smem_ptr_to_uint(st) + 2u * TmaStage::offset(m, 8 * lane));
}

// One thread: Cols / 64 staged boxes (rows row0 .., columns col0 ..) to global memory, committed as one bulk
// group (wait with cute::tma_store_wait). Columns past out.n are clipped by the tensor map.
template <int Cols, class Out>
__device__ __forceinline__ void tma_store_boxes(const Out& out, int row0, int col0, const __nv_bfloat16* st) {
  using namespace cute;
  constexpr int BR = Out::kBoxRows, BC = SwizzledStage<BR>::kBoxCols;
  static_assert(Cols % BC == 0, "whole boxes");
  Tensor mC = out.tma.get_tma_tensor(make_shape(out.rows, out.n));
  auto cta = out.tma.get_slice(0);
#pragma unroll
  for (int b = 0; b < Cols / BC; ++b) {
    const int c0 = col0 + b * BC;
    if (c0 >= out.n) break;
    Tensor gC = local_tile(domain_offset(make_coord(row0, c0), mC), make_shape(Int<BR>{}, Int<BC>{}),
                           make_coord(0, 0));
    Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<const cutlass::bfloat16_t*>(st) + b * BR * BC),
                            typename SwizzledStage<BR>::BoxLayout{});
    copy(out.tma, cta.partition_S(sC), cta.partition_D(gC));
  }
  tma_store_arrive();
}
template <class Cfg>
__device__ __forceinline__ void tma_store_tile(const TmaOut& out, int row0, int col0, const __nv_bfloat16* st) {
  tma_store_boxes<Cfg::BN>(out, row0, col0, st);
}

// Consumers: the transpose of the BM x BN tile, as SwizzledStage<BN> boxes (box rows = tile columns n, box
// columns = tile rows m), for a kernel that computes D^T and stores D; f as in stage_swizzled (the packed pair's
// halves land in two rows).
// A thread's values sit at offset(n0 + c + dn, m0 + dm) = offset(n0 + c, m0 + dm) + 64 dn (dn a multiple of 8, as
// test_gemm_layouts checks), so four per-thread bases (dm in {0, 8}, c in {0, 1}) and constants address them all.
template <class Cfg, class Acc, class Crd, class F>
__device__ __forceinline__ void stage_transposed_swizzled(const Acc& acc, const Crd& crd, __nv_bfloat16* st, F&& f) {
  using S = SwizzledStage<Cfg::BN>;
  static_assert(Cfg::BM % S::kBoxCols == 0, "whole TMA boxes");
  constexpr int kVals = decltype(cute::size(acc))::value;
  const int m0 = cute::get<0>(crd(0)), n0 = cute::get<1>(crd(0));
  const std::uint32_t base = cute::cast_smem_ptr_to_uint(st);
  std::uint32_t b[2][2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < 2; ++c) b[h][c] = base + 2u * S::offset(n0 + c, m0 + 8 * h);
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    const int dm = cute::get<0>(crd(i)) - m0, dn = cute::get<1>(crd(i)) - n0;  // constants once unrolled
    const int h = dm / 8;
    const std::uint32_t u = f(acc(i), acc(i + 1), m0 + dm, n0 + dn);
    const std::uint32_t off = 2u * S::kBoxCols * dn;
    st_shared_u16(b[h][0] + off, static_cast<std::uint16_t>(u & 0xffffu));  // column n0 + dn
    st_shared_u16(b[h][1] + off, static_cast<std::uint16_t>(u >> 16));     // column n0 + dn + 1
  }
  cutlass::arch::fence_view_async_shared();
}

}  // namespace sonicmoe::cuda::gemm::sm90

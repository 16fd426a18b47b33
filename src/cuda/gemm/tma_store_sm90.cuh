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

// TMA store into C [rows, n] row-major, box by box.
inline auto make_tma_store_c(const cutlass::bfloat16_t* c, int rows, int n) {
  auto g = cute::make_tensor(cute::make_gmem_ptr(c), cute::make_shape(rows, n),
                             cute::make_stride(static_cast<std::int64_t>(n), cute::_1{}));
  return cute::make_tma_copy(cute::SM90_TMA_STORE{}, g, typename TmaStage::BoxLayout{});
}
using TmaStoreC = decltype(make_tma_store_c(nullptr, 1, 8));

// Where a TMA-stored output goes: the tensor map and the shape it was made for.
struct TmaOut {
  TmaStoreC tma;
  int rows = 0, n = 0;
  static TmaOut make(__nv_bfloat16* c, int rows, int n) {
    return {make_tma_store_c(reinterpret_cast<const cutlass::bfloat16_t*>(c), rows, n), rows, n};
  }
};

__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

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
  return *reinterpret_cast<const uint4*>(st + TmaStage::offset(m, 8 * lane));
}

// One thread: the staged tile (rows row0 .., columns col0 ..) to global memory, committed as one bulk group
// (wait with cute::tma_store_wait).
template <class Cfg>
__device__ __forceinline__ void tma_store_tile(const TmaOut& out, int row0, int col0, const __nv_bfloat16* st) {
  using namespace cute;
  constexpr int BM = kTmaStoreBM, BC = TmaStage::kBoxCols;
  Tensor mC = out.tma.get_tma_tensor(make_shape(out.rows, out.n));
  auto cta = out.tma.get_slice(0);
#pragma unroll
  for (int b = 0; b < Cfg::BN / BC; ++b) {
    const int c0 = col0 + b * BC;
    if (c0 >= out.n) break;
    Tensor gC = local_tile(domain_offset(make_coord(row0, c0), mC), make_shape(Int<BM>{}, Int<BC>{}),
                           make_coord(0, 0));
    Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<const cutlass::bfloat16_t*>(st) + b * BM * BC),
                            typename TmaStage::BoxLayout{});
    copy(out.tma, cta.partition_S(sC), cta.partition_D(gC));
  }
  tma_store_arrive();
}

}  // namespace sonicmoe::cuda::gemm::sm90

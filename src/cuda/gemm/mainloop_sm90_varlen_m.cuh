// Mainloop of the native varlen-M GEMM on Hopper (DESIGN.md section 5): C[r] = A[g(r)] . B[e(r)]^T.
//   producer: B by TMA from the [E, N, K] (or [E, K, N]) weights; A either by TMA from contiguous rows (one
//     elected thread) or gathered row by row through an index array with 16-byte cp.async, completion
//     signalled to the same `full` mbarrier (cp.async.mbarrier.arrive.noinc). The gather is issued by the MMA
//     warps themselves (kMmaGather: MmaGatherLoader, each warp its own 16 rows, while the L2 prefetch of the
//     rows stays with the producer warp) or by four producer warps (the four-warpgroup layout, kWide).
//   two consumer warpgroups (cooperative): both on one 128 x 256 tile, 64 rows each, wgmma with one batch in
//     flight, stages released per warp. They hand the tile to the epilogue warps through shared memory
//     (kernel_sm90_varlen_m.cuh) and go straight back to the next tile's K loop.
// The A tile of a stage is 128 rows x 64 bf16 = 128 bytes a row, 128-byte swizzle: row r lives at byte r*128,
// its 16-byte chunk c at chunk c ^ (r % 8) (the TMA SWIZZLE_128B pattern and CuTe's K-major SW128 atom;
// Cfg::a_chunk_offset).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/pipeline_sm90.cuh"
#include "cuda/gemm/tile_scheduler_varlen_m.cuh"

#ifndef SONICMOE_L2_PREFETCH_TILES
#define SONICMOE_L2_PREFETCH_TILES 4
#endif

namespace sonicmoe::cuda::gemm::sm90 {

// The bf16 configs' block scales: none (VarlenMMainloopParams::scales).
struct NoBlockScales {};

// Tile shape, stage count, smem layouts, MMA and TMA types of one kernel variant.
//   kGatherA: A rows through an index array. kBMN: B stored [E, K, N] (N contiguous).
//   kMmaGather (with kGatherA): the MMA warpgroups gather their own A rows between their wgmma batches
//   (MmaGatherLoader), so the CTA keeps the contiguous layout (3 warpgroups, 64x256 wgmma).
//   Element_: the 16-bit operand type, cutlass::bfloat16_t or cutlass::half_t (wgmma F32BF16BF16 / F32F16F16); the
//   tiles, TMA boxes and swizzles are the same bytes for both.
template <bool kGatherA_, bool kBMN_, bool kMmaGather_ = false, class Element_ = cutlass::bfloat16_t>
struct VarlenMConfig {
  static constexpr bool kGatherA = kGatherA_, kBMN = kBMN_, kMmaGather = kMmaGather_;
  static_assert(kGatherA || !kMmaGather, "kMmaGather needs gathered A");
  static constexpr bool kProducerGather = kGatherA && !kMmaGather;  // the producer warps gather A
  static constexpr int BM = 128, BN = 256, BK = 64;
  // 3 x 48 KB, leaving room for the 66 KB epilogue staging tile. Measured on the H100: BK = 32 with 6 stages (the
  // same bytes, a longer ring) was slower, and 4 stages with a 32 KB staging tile were no faster on the gathering
  // kernels (docs/notes/pipeline_depth.md).
  static constexpr int Stages = 3;
  static constexpr int kStageLd = BN + 8;  // staging row pitch (elements): +16 bytes, no bank conflicts
  // Two layouts of the CTA:
  //   3 warpgroups (contiguous A by TMA, or gathered A with kMmaGather). Warpgroup 0 = one producer warp + three
  //     epilogue warps; the 168-register entry cap lets each MMA warpgroup issue one 64x256 wgmma per k-step
  //     (shared-memory bandwidth is the limit of this tile, and two 64x128 ones would read A twice).
  //   4 warpgroups (kWide: gathered A, producer warps gather). All four warps of warpgroup 0 gather (two were
  //     too slow, docs/notes/lean_gathering_layout.md), warpgroup 3 is a four-warp epilogue; the 128-register
  //     entry cap then allows only 64x128 wgmma. Kept for the dgated kernel at short K, whose heavy epilogue
  //     needs the four epilogue warps (heuristics.h, dgated_mma_gather). The MMA-warp gathering beat it by
  //     1-11% on the gathered store and activation kernels (docs/notes/mma_warp_gathering.md).
  static constexpr bool kWide = kProducerGather;
  static constexpr int kThreads = kWide ? 512 : 384;
  static constexpr int kProducerWarps = kWide ? 4 : 1;
  static constexpr int kEpilogueWarps = (4 - kProducerWarps) + (kWide ? 4 : 0);
  static constexpr int kProducerThreads = 32 * kProducerWarps, kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // Threads whose cp.async complete a stage's `full` barrier (one noinc arrival each), beside the TMA thread.
  static constexpr int kGatherThreads = kMmaGather ? kConsumerThreads : (kGatherA ? kProducerThreads : 0);
  // setmaxnreg split of the 64K registers: the two MMA warpgroups kConsumerRegs; contiguous A, warpgroup 0
  // (producer + epilogue warps) kLightRegs; wide, the gathering and the epilogue warpgroup share kWideLightRegs,
  // evenly unless the epilogue policy asks for more (kernel_sm90_varlen_m.cuh, EpilogueRegs).
  static constexpr int kLightRegs = 72;
  static constexpr int kConsumerRegs = kWide ? 176 : 216;
  static constexpr int kWideLightRegs = 512 - 2 * kConsumerRegs;  // wide: 160
  static_assert(kWide || kLightRegs + 2 * kConsumerRegs <= 504,
                "register split (a 384-thread split summing to 512 hung on the H100)");
  static constexpr int kStageBytesA = BM * BK * 2, kStageBytesB = BN * BK * 2;
  static constexpr int kChunkElems = 8;  // elements of A in a 16-byte cp.async chunk
  // Gathered A: the producers ask L2 for the tile's rows at k-tile kt + kL2Ahead while they load k-tile kt (0: no
  // prefetch). The ring alone keeps ~2 k-tiles in flight; ncu showed the consumers of the gathering kernels mostly
  // waiting on `full`. Measured on the H100 (docs/notes/l2_prefetch_gathered_rows.md): +2-6% on the readme-default
  // gathered kernels, distances 2, 4 and 6 alike within the spread. TMA prefetches of B (and of contiguous A) as
  // well made every kernel about 2x slower, so B is not prefetched.
  static constexpr int kL2Ahead = SONICMOE_L2_PREFETCH_TILES;
  // Byte offset of row r's 16-byte chunk c in a stage of A (128-byte rows, 128-byte swizzle).
  static constexpr int kRowBytes = BK * 2, kRowChunks = kRowBytes / 16;
  static constexpr bool kBlockScaled = false;  // FP8 configs (mainloop_sm90_varlen_m_fp8.cuh): per-k-block promotion
  using BlockScales = NoBlockScales;
  __host__ __device__ static constexpr std::uint32_t a_chunk_offset(int r, int c) {
    return static_cast<std::uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
  }

  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>,
                "16-bit operands: bf16 or f16");
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BM>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using SmemAtomB = std::conditional_t<kBMN, cute::GMMA::Layout_MN_SW128_Atom<Element>,
                                       cute::GMMA::Layout_K_SW128_Atom<Element>>;
  using SmemLayoutB = decltype(cute::tile_to_shape(
      SmemAtomB{}, cute::make_shape(cute::Int<BN>{}, cute::Int<BK>{}, cute::Int<Stages>{}),
      std::conditional_t<kBMN, cute::Step<cute::_2, cute::_1, cute::_3>, cute::Step<cute::_1, cute::_2, cute::_3>>{}));

  static constexpr cute::GMMA::Major kMajorB = kBMN ? cute::GMMA::Major::MN : cute::GMMA::Major::K;
  static constexpr bool kF16 = std::is_same_v<Element, cutlass::half_t>;
  using MmaAtom = std::conditional_t<
      kWide,
      std::conditional_t<kF16, cute::SM90_64x128x16_F32F16F16_SS<cute::GMMA::Major::K, kMajorB>,
                         cute::SM90_64x128x16_F32BF16BF16_SS<cute::GMMA::Major::K, kMajorB>>,
      std::conditional_t<kF16, cute::SM90_64x256x16_F32F16F16_SS<cute::GMMA::Major::K, kMajorB>,
                         cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, kMajorB>>>;
  // Two warpgroups stacked along M: 128 x BN per tile.
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  // A: [a_rows, k] row-major. B: [E, n, k] (kBMN: [E, k, n]) as an (n, k, E) tensor.
  static auto make_tma_a(const Element* a, int a_rows, int k) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(a), cute::make_shape(a_rows, k),
                               cute::make_stride(static_cast<std::int64_t>(k), cute::_1{}));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutA{}(cute::_, cute::_, 0));
  }
  static auto b_stride(int n, int k) {
    if constexpr (kBMN)
      return cute::make_stride(cute::_1{}, static_cast<std::int64_t>(n), static_cast<std::int64_t>(n) * k);
    else
      return cute::make_stride(static_cast<std::int64_t>(k), cute::_1{}, static_cast<std::int64_t>(n) * k);
  }
  static auto make_tma_b(const Element* b, int n, int k, int num_experts) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(b), cute::make_shape(n, k, num_experts), b_stride(n, k));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutB{}(cute::_, cute::_, 0));
  }
  // kW1Parts: make_tma_b also takes W1's part / expert strides (W1ConcatCfg, w1_layout_sm90.cuh).
  static constexpr bool kW1Parts = false;
  // The coordinates of B's TMA tensor (a Cfg whose make_tma_b reads another layout gives its own: w1_layout_sm90.cuh).
  CUTE_HOST_DEVICE static auto b_coord_shape(int n, int k, int num_experts) {
    return cute::make_shape(n, k, num_experts);
  }
  using TmaA = decltype(make_tma_a(nullptr, 1, 8));
  using TmaB = decltype(make_tma_b(nullptr, 8, 8, 1));
};

// The varlen-M variants by name (instances/, tests, tools name these, never a row of bools). A: contiguous by TMA,
// gathered by the producer warps (the four-warpgroup kWide layout) or by the MMA warps (kMmaGather). B: [E, n, k],
// or [E, k, n] with the Bkn suffix (kBMN).
// The ...Of<E> forms take the element type (cutlass::bfloat16_t or cutlass::half_t); the plain names are bf16.
template <class E>
using VarlenMContiguousCfgOf = VarlenMConfig</*kGatherA=*/false, /*kBMN=*/false, false, E>;
template <class E>
using VarlenMContiguousBknCfgOf = VarlenMConfig</*kGatherA=*/false, /*kBMN=*/true, false, E>;
template <class E>
using VarlenMWideGatherCfgOf = VarlenMConfig</*kGatherA=*/true, /*kBMN=*/false, false, E>;
template <class E>
using VarlenMWideGatherBknCfgOf = VarlenMConfig</*kGatherA=*/true, /*kBMN=*/true, false, E>;
template <class E>
using VarlenMMmaGatherCfgOf = VarlenMConfig</*kGatherA=*/true, /*kBMN=*/false, /*kMmaGather=*/true, E>;
template <class E>
using VarlenMMmaGatherBknCfgOf = VarlenMConfig</*kGatherA=*/true, /*kBMN=*/true, /*kMmaGather=*/true, E>;
using VarlenMContiguousCfg = VarlenMContiguousCfgOf<cutlass::bfloat16_t>;
using VarlenMContiguousBknCfg = VarlenMContiguousBknCfgOf<cutlass::bfloat16_t>;
using VarlenMWideGatherCfg = VarlenMWideGatherCfgOf<cutlass::bfloat16_t>;
using VarlenMWideGatherBknCfg = VarlenMWideGatherBknCfgOf<cutlass::bfloat16_t>;
using VarlenMMmaGatherCfg = VarlenMMmaGatherCfgOf<cutlass::bfloat16_t>;
using VarlenMMmaGatherBknCfg = VarlenMMmaGatherBknCfgOf<cutlass::bfloat16_t>;

// Shared memory of one CTA (the scheduler's offsets / prefix arrays follow it, sized at launch by E).
template <class Cfg>
struct VarlenMSmem {
  alignas(1024) typename Cfg::Element a[Cfg::Stages * Cfg::BM * Cfg::BK];
  alignas(1024) typename Cfg::Element b[Cfg::Stages * Cfg::BN * Cfg::BK];
  // epilogue staging tile (bf16, padded rows; or TMA boxes, which need the 1024-byte alignment of the swizzle)
  alignas(1024) cutlass::bfloat16_t d[Cfg::BM * Cfg::kStageLd];
  alignas(8) std::uint64_t full[Cfg::Stages];
  alignas(8) std::uint64_t empty[Cfg::Stages];
  alignas(8) std::uint64_t epi_full;   // consumers -> epilogue warpgroup: the staging tile holds a tile
  alignas(8) std::uint64_t epi_empty;  // epilogue warpgroup -> consumers: the staging tile is free again
};

// What the mainloop reads, beside the epilogue's own parameters.
template <class Cfg>
struct VarlenMMainloopParams {
  typename Cfg::TmaA tma_a;
  typename Cfg::TmaB tma_b;
  const typename Cfg::Element* a;  // gathered path: A_full [a_rows, k]
  const std::int32_t* gather;      // gathered path: [rows]
  int a_rows;
  int k, n, num_experts;
  typename Cfg::BlockScales scales;  // FP8: the block scales the consumers promote with; bf16: empty
};

// ---- producer -------------------------------------------------------------------------------------------
// TMA for B (and A when contiguous) from one elected thread; with kGatherA the 128 producer threads also
// cp.async their share of A: thread p moves 16-byte chunk p % 8 of rows p / 8 + 16 i, i = 0..7.
template <class Cfg>
__device__ void varlen_m_produce(const VarlenMMainloopParams<Cfg>& p, VarlenMSmem<Cfg>& s,
                                 const VarlenMScheduler<Cfg::BM>& sched) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  const int pt = threadIdx.x;  // 0 .. kProducerThreads - 1
  const bool tma_thread = pt == 0;

  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename Cfg::SmemLayoutB{});
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.a_rows, p.k));
  Tensor mB = p.tma_b.get_tma_tensor(Cfg::b_coord_shape(p.n, p.k, p.num_experts));
  auto cta_a = p.tma_a.get_slice(0);
  auto cta_b = p.tma_b.get_slice(0);
  Tensor tAsA = cta_a.partition_D(sA);
  Tensor tBsB = cta_b.partition_D(sB);
  const int k_tiles = (p.k + BK - 1) / BK;
  constexpr std::uint32_t kTxBytes = Cfg::kStageBytesB + (Cfg::kGatherA ? 0 : Cfg::kStageBytesA);

  // gather addressing: thread pt moves chunk pt % kRowChunks of rows rbase + kRowStep * i; kRowStep rows span a
  // multiple of the swizzle period, so those rows' chunks sit at one offset from their row.
  constexpr int kRowBytes = Cfg::kRowBytes, kChunks = Cfg::kRowChunks;
  constexpr int kRowStep = Cfg::kProducerThreads / kChunks;  // 16
  constexpr int kRowsPerThread = BM / kRowStep;               // 8
  static_assert(!Cfg::kProducerGather || kRowStep * kRowBytes % 1024 == 0,
                "gather rows of one thread share their swizzle");
  const int chunk = pt % kChunks, rbase = pt / kChunks;
  const std::uint32_t a_smem = cast_smem_ptr_to_uint(s.a);
  const std::uint32_t thr_off = Cfg::a_chunk_offset(rbase, chunk);

  PipeState<Cfg::Stages> st;
  st.phase = 1;  // the first pass over the ring finds every stage empty
  for (int t = blockIdx.x; t < sched.total(); t += gridDim.x) {
    const VarlenTile tile = sched.at(t);
    Tensor gB = local_tile(mB(_, _, tile.expert), make_shape(Int<BN>{}, Int<BK>{}), make_coord(tile.n_tile, _));
    Tensor tBgB = cta_b.partition_S(gB);
    Tensor gA = local_tile(domain_offset(make_coord(tile.row0, 0), mA), make_shape(Int<BM>{}, Int<BK>{}),
                           make_coord(0, _));
    Tensor tAgA = cta_a.partition_S(gA);

    // Per slot, this thread's chunk of its gathered row at k = 0, or nullptr: zero-filled (past the tile, or an
    // out-of-range index, which reads zeros and never out of bounds). Computed once a tile: a k-tile only adds
    // kt * BK to each.
    using El = typename Cfg::Element;
    const El* src_row[kRowsPerThread];
    // The rows this thread prefetches into L2 (each of the tile's rows once), or nullptr: with the producer warps
    // gathering, row rbase + kRowStep * chunk of each thread; with kMmaGather, the producer warp's lane l takes rows
    // l + 32 j, so that the MMA warps' own cp.async (MmaGatherLoader) mostly hit L2 and never wait on the memory
    // queues.
    constexpr int kPfRows = Cfg::kMmaGather ? BM / 32 : 1;
    const El* pf_rows[kPfRows] = {};
    if constexpr (Cfg::kProducerGather) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int r = rbase + kRowStep * i;
        const int g = r < tile.rows ? __ldg(p.gather + tile.row0 + r) : -1;
        src_row[i] = g >= 0 && g < p.a_rows ? p.a + static_cast<std::int64_t>(g) * p.k + chunk * Cfg::kChunkElems
                                            : nullptr;
        if (i == chunk && src_row[i] != nullptr) pf_rows[0] = src_row[i] - chunk * Cfg::kChunkElems;
      }
    } else if constexpr (Cfg::kMmaGather && Cfg::kL2Ahead > 0) {
#pragma unroll
      for (int j = 0; j < kPfRows; ++j) {
        const int r = pt + 32 * j;
        const int g = r < tile.rows ? __ldg(p.gather + tile.row0 + r) : -1;
        pf_rows[j] = g >= 0 && g < p.a_rows ? p.a + static_cast<std::int64_t>(g) * p.k : nullptr;
      }
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      if constexpr (Cfg::kGatherA && Cfg::kL2Ahead > 0) {  // before the wait: a full ring does not hold it back
        const int kp = kt + Cfg::kL2Ahead;
#pragma unroll
        for (int j = 0; j < kPfRows; ++j)
          if (kp < k_tiles && pf_rows[j] != nullptr)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(pf_rows[j] + kp * BK));
      }
      Barrier::wait(&s.empty[st.index], st.phase);
      if (tma_thread) {
        TxBarrier::arrive_and_expect_tx(&s.full[st.index], kTxBytes);
        copy(p.tma_b.with(s.full[st.index]), tBgB(_, _, _, kt), tBsB(_, _, _, st.index));
        if constexpr (!Cfg::kGatherA)
          copy(p.tma_a.with(s.full[st.index]), tAgA(_, _, _, kt), tAsA(_, _, _, st.index));
      }
      if constexpr (Cfg::kProducerGather) {
        const int k0 = kt * BK;
        const bool k_in = k0 + chunk * Cfg::kChunkElems < p.k;
        const std::uint32_t dst0 = a_smem + st.index * Cfg::kStageBytesA + thr_off;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const bool ok = k_in && src_row[i] != nullptr;
          cp_async_16_zfill(dst0 + i * kRowStep * kRowBytes, ok ? src_row[i] + k0 : p.a, ok ? 16 : 0);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[st.index]);
      }
      st.advance();
    }
  }
  if constexpr (Cfg::kProducerGather) cp_async_wait_all();
}

// ---- gathering by the MMA warpgroups (kMmaGather) -------------------------------------------------------
// Each MMA warpgroup loads its own 64 rows of A (the rows its wgmma read), each warp its own 16 of them, so a warp
// refills a stage's rows as soon as its own wgmma on that stage are complete, without waiting for anyone. The
// loader walks the CTA's (tile, k-tile) sequence Stages k-tiles ahead of the MMAs, on the same ring as the TMA
// producer of B: the first Stages k-tiles up front, then one k-tile each time mma_k_loop releases a stage.
// Lane l of warp w (of the warpgroup) moves 16-byte chunk l % 8 of rows 16 w + l / 8 + 4 i, i = 0..3 (slot_*).
template <class Cfg>
struct MmaGatherLoader {
  static constexpr int kRows = 4;  // rows a thread moves per k-tile
  const VarlenMScheduler<Cfg::BM>& sched;
  const typename Cfg::Element* a;  // A_full [a_rows, k]
  const std::int32_t* gather;
  std::uint64_t* full;
  int a_rows, k;
  std::uint32_t dst_even, dst_odd;  // shared address of this thread's chunk in rows i = 0 (even i) and i = 1 (odd i)
  int row_base;                     // tile row of i = 0
  int chunk, k_tiles, total, t, kt;
  const typename Cfg::Element* src[kRows];  // this k-tile's chunk of each row (valid rows only)
  unsigned valid;                         // bit i: row i exists (in the tile, a row of A)
  int g_next[kRows];  // rows of A of the next tile of the sequence, loaded a tile ahead (-1: past its rows)
  PipeState<Cfg::Stages> ws;

  // Consumer thread ct (0..255) moves chunk slot_chunk(ct) of tile rows slot_row(ct, i), i < kRows, to byte
  // slot_offset(ct, i) of a stage: the address arithmetic of issue() (checked against CuTe's layout and for
  // covering the tile exactly once, each warp inside its own 16 rows, by test_gemm_layouts).
  __host__ __device__ static constexpr int slot_chunk(int ct) { return ct % 32 % Cfg::kRowChunks; }
  __host__ __device__ static constexpr int slot_row(int ct, int i) {
    return ct / 32 * 16 + ct % 32 / Cfg::kRowChunks + 4 * i;  // warp w (of both warpgroups): rows 16 w .. 16 w + 15
  }
  __host__ __device__ static constexpr std::uint32_t slot_offset(int ct, int i) {
    return Cfg::a_chunk_offset(slot_row(ct, i & 1), slot_chunk(ct)) + (i >> 1) * 8 * Cfg::kRowBytes;
  }

  __device__ MmaGatherLoader(const VarlenMMainloopParams<Cfg>& p, const VarlenMScheduler<Cfg::BM>& sched_,
                             VarlenMSmem<Cfg>& s, int consumer_thread)
      : sched(sched_), a(p.a), gather(p.gather), full(s.full), a_rows(p.a_rows), k(p.k) {
    chunk = slot_chunk(consumer_thread);
    row_base = slot_row(consumer_thread, 0);
    const std::uint32_t base = cute::cast_smem_ptr_to_uint(s.a);
    dst_even = base + slot_offset(consumer_thread, 0);
    dst_odd = base + slot_offset(consumer_thread, 1);
    k_tiles = (k + Cfg::BK - 1) / Cfg::BK;
    total = sched.total();
    t = blockIdx.x;
    kt = 0;
    load_rows(t, g_next);
    set_rows();  // waits for the first tile's indices (once)
    load_rows(t + gridDim.x, g_next);
  }

  // The A rows of tile `tt`'s rows of this thread (-1 past the tile or the sequence); only loads are issued.
  __device__ __forceinline__ void load_rows(int tt, int (&g)[kRows]) const {
    const VarlenTile tile = sched.at(tt < total ? tt : 0);
    const int rows = tt < total ? tile.rows : 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = row_base + 4 * i;
      g[i] = r < rows ? __ldg(gather + tile.row0 + r) : -1;
    }
  }
  __device__ __forceinline__ void set_rows() {
    valid = 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool ok = g_next[i] >= 0 && g_next[i] < a_rows;  // an out-of-range index reads zeros
      valid |= static_cast<unsigned>(ok) << i;
      src[i] = a + (ok ? static_cast<std::int64_t>(g_next[i]) * k + chunk * Cfg::kChunkElems : 0);
    }
  }

  // Loads the next k-tile of the sequence into its stage (the caller guarantees the stage's A rows of this warp
  // are free) and arrives on its `full` barrier when the copies land; nothing once the sequence is done.
  __device__ __forceinline__ void issue() {
    if (t >= total) return;
    const bool k_in = kt * Cfg::BK + chunk * Cfg::kChunkElems < k;  // false only in a K tail
    const std::uint32_t stage = ws.index * Cfg::kStageBytesA;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const bool ok = k_in && (valid >> i & 1u);
      const std::uint32_t dst = ((i & 1) ? dst_odd : dst_even) + stage + (i >> 1) * 8 * Cfg::kRowBytes;  // slot_offset
      cp_async_16_zfill(dst, ok ? src[i] : a, ok ? 16 : 0);
      src[i] += Cfg::BK;
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&full[ws.index]);
    ws.advance();
    if (++kt == k_tiles) {
      kt = 0;
      t += gridDim.x;
      set_rows();                       // loaded a tile ago
      load_rows(t + gridDim.x, g_next);  // used a tile from now
    }
  }
};

// mma_k_loop's refill hook when nobody refills from the consumers.
struct NoRefill {
  __device__ __forceinline__ void operator()() const {}
};

// ---- consumers ------------------------------------------------------------------------------------------
// Consumer warpgroup wg's (1 or 2; warpgroup 0 produces) wgmma fragments, shared-memory descriptors into every stage
// of the A ring and of the B ring, for mma_k_loop. Shared by the varlen-M and varlen-K kernels (any Smem with a / b).
template <class Cfg, class Smem>
__device__ __forceinline__ auto mma_fragment_a(typename Cfg::TiledMma& mma, Smem& s, int wg) {
  auto wg_mma = mma.get_slice((wg - 1) * 128);
  return wg_mma.make_fragment_A(
      wg_mma.partition_A(cute::make_tensor(cute::make_smem_ptr(s.a), typename Cfg::SmemLayoutA{})));
}
template <class Cfg, class Smem>
__device__ __forceinline__ auto mma_fragment_b(typename Cfg::TiledMma& mma, Smem& s, int wg) {
  auto wg_mma = mma.get_slice((wg - 1) * 128);
  return wg_mma.make_fragment_B(
      wg_mma.partition_B(cute::make_tensor(cute::make_smem_ptr(s.b), typename Cfg::SmemLayoutB{})));
}

// One tile's K loop (k_tiles >= 1) for this warpgroup; returns with the accumulators complete and every stage
// released. Shared by the varlen-M and varlen-K kernels (any Smem with full / empty barrier rings).
// `refill()` runs after each release of a stage (MmaGatherLoader::issue).
template <class Cfg, class Smem, class Accum, class FragA, class FragB, class Refill = NoRefill>
__device__ __forceinline__ void mma_k_loop(typename Cfg::TiledMma& mma, Accum& acc, const FragA& tCrA,
                                           const FragB& tCrB, Smem& s, PipeState<Cfg::Stages>& rd, int k_tiles,
                                           bool release_lane, Refill&& refill = Refill{}) {
  using namespace cute;
  PipeState<Cfg::Stages> rel = rd;
  warpgroup_fence_operand(acc);
  {
    Barrier::wait(&s.full[rd.index], rd.phase);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(mma, tCrA(_, _, kb, rd.index), tCrB(_, _, kb, rd.index), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    rd.advance();
  }
  warpgroup_fence_operand(acc);
  for (int kt = 1; kt < k_tiles; ++kt) {
    Barrier::wait(&s.full[rd.index], rd.phase);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    cute::gemm(mma, tCrA(_, _, _, rd.index), tCrB(_, _, _, rd.index), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous stage's wgmma are done: give it back
    warpgroup_fence_operand(acc);
    if (release_lane) Barrier::arrive(&s.empty[rel.index]);
    refill();
    rel.advance();
    rd.advance();
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (release_lane) Barrier::arrive(&s.empty[rel.index]);
  refill();
}

}  // namespace sonicmoe::cuda::gemm::sm90

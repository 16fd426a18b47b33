// FP8 blockwise-scaled configuration of the native varlen-M GEMM (DESIGN.md section 9; the recipe:
// docs/ALGORITHM.md, "FP8 blockwise recipe"): e4m3 A and B, both K-major, fp32 power-of-two scales per 1x128 block
// of A (by gathered row) and per 128x128 block of B. The kernel (kernel_sm90_varlen_m.cuh), scheduler, producer,
// MMA-warp gather (MmaGatherLoader) and epilogue policies are the bf16 kernel's; what differs is this config and the
// consumers' K loop (mma_k_loop_promoted): Hopper has no block-scaled MMA, so each 128-deep k-block's wgmma write a
// zeroed fp32 fragment that the consumer threads then promote, acc += tmp * a_scale[row, kb] * b_scale[e, n / 128, kb].
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/float8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/mainloop_sm90_varlen_m.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// Scales of the two FP8 operands (fp8_gemm.h): a [a_rows, k / 128], b [E, ceil(n / 128), k / 128].
struct Fp8BlockScales {
  const float* a = nullptr;
  const float* b = nullptr;
};

// The members VarlenMConfig has, with FP8 values (the kernel and the MMA-warp gather read them by name).
//   Tile 128 x 128 x 128 (bytes: BK = 128 e4m3 = 128-byte rows, the bf16 A stage's geometry, so the 128-byte swizzle,
//   a_chunk_offset and MmaGatherLoader's slots are unchanged). BN = 128 because promotion needs two fp32 fragments
//   live at once (the running sum and the k-block's wgmma result): 64 x 128 a warpgroup is 64 + 64 registers a
//   thread; 64 x 256 would be 128 + 128, beyond the 216-register cap of a consumer (and BN = 128 is also the B scale
//   block, so one B scale per k-block per tile).
//   Stages: 32 KB a stage; 5 stages + the 34 KB staging tile + the scheduler arrays fit in 227 KB (6 do not).
//   kGatherA: A rows gathered by the MMA warps (kMmaGather), else contiguous A by TMA; three warpgroups either way.
//   kVariant: consumer-loop variants for the benchmark only (sonicmoe-bench-gemm fp8 prints one line each; the
//   library's instances are variant 0). The tile is BN wide; its wgmma are issued per chunk of kAtomN columns
//   (the MMA atom's N); a chunk's fp32 result is promoted into acc with the chunk's B scale.
//     0  today's: BN = 128, one 64x128 chunk a warpgroup, one tmp; wgmma, wait<0>, release, promote.
//     1  split promotion: BN = 128 as two 64x64 chunks in two 32-register tmp buffers (same 128 registers), the
//        next chunk (the second half, or the next k-block's first half) always issued before the current one is
//        promoted under warpgroup_wait<1>, so this warpgroup's own wgmma run under its promotion. Possible cost
//        (estimate, not measured): a 64x64x32 SS wgmma reads 4 KB of A and B per 32 clocks, the 128 B/clk of
//        shared memory (64x128x32: 6 KB per 64 clocks).
//     2  BN = 256 (DeepGEMM's larger BLOCK_N, the bf16 kernel's 128x256 tile and 3 x 48 KB stages): a k-block's
//        two 64x128 chunks go through one 64-register tmp in turn (acc 128 + tmp 64 registers). Halves per FLOP
//        what the consumers do besides the FFMA (barrier waits, scale loads, the A gather's cp.async, the
//        release), which for BN = 128 compete with the promotion for the issue slots the other warpgroup's MMA
//        gives them; also reads the tile's A once for 256 columns.
//     3  BN = 256 with variant 1's pipelining: four 64x64 chunks rolling through two 32-register tmp buffers.
template <bool kGatherA_, int kVariant_ = 0>
struct VarlenMFp8Config {
  static constexpr int kVariant = kVariant_;
  static_assert(kVariant >= 0 && kVariant <= 3, "variants 0-3");
  static constexpr bool kGatherA = kGatherA_, kBMN = false, kMmaGather = kGatherA_;
  static constexpr bool kProducerGather = false;
  static constexpr int BM = 128, BN = kVariant >= 2 ? 256 : 128, BK = 128;
  static constexpr int kAtomN = kVariant == 1 || kVariant == 3 ? 64 : 128;  // wgmma N: a promotion chunk
  static constexpr int kChunks = BN / kAtomN;                               // chunks a k-block
  static constexpr bool kRolling = kVariant == 1 || kVariant == 3;         // two tmp buffers, wait<1>
  static constexpr int kRollUnroll = BN == 256 ? 2 : 4;  // kRolling: k-blocks a drained group (mma_k_loop_promoted)
  // BN = 256: 48 KB a stage + the 66 KB staging tile: 3 stages, as the bf16 kernel's 128 x 256 x 64.
  static constexpr int Stages = BN == 256 ? 3 : 5;
  static constexpr int kStageLd = BN + 8;  // staging row pitch (elements), as VarlenMConfig
  static constexpr bool kWide = false;
  static constexpr int kThreads = 384;
  static constexpr int kProducerWarps = 1;
  static constexpr int kEpilogueWarps = 3;
  static constexpr int kProducerThreads = 32, kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kGatherThreads = kMmaGather ? kConsumerThreads : 0;
  // 128 accumulator registers of a consumer thread + scales and addresses: ptxas reports no spills under 216.
  // BN = 256 (variants 2, 3): 128 accumulator + 64 tmp registers, DeepGEMM's 232 / 40 split. ptxas, 232: the
  // contiguous kernels spill only in warpgroup 0 (a few pointers); the gathering ones (MmaGatherLoader's state on
  // top) also in the consumer loop (v2: ~17 accumulator words a k-block, v3 more): a measured cost of BN = 256.
  static constexpr int kLightRegs = BN == 256 ? 40 : 72;
  static constexpr int kConsumerRegs = BN == 256 ? 232 : 216;
  static constexpr int kWideLightRegs = 512 - 2 * kConsumerRegs;  // unused (not kWide)
  static_assert(kLightRegs + 2 * kConsumerRegs <= 504, "register split (512 hung on the H100)");
  static constexpr int kStageBytesA = BM * BK, kStageBytesB = BN * BK;  // one byte an element
  static constexpr int kChunkElems = 16;
  static constexpr int kL2Ahead = SONICMOE_L2_PREFETCH_TILES;
  static constexpr int kRowBytes = BK, kRowChunks = kRowBytes / 16;
  __host__ __device__ static constexpr std::uint32_t a_chunk_offset(int r, int c) {
    return static_cast<std::uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
  }
  static constexpr bool kBlockScaled = true;
  using BlockScales = Fp8BlockScales;
  static constexpr int kScaleBlock = 128;  // of the recipe: k-blocks of both operands, n-blocks of B
  static_assert(BK == kScaleBlock && BN % kScaleBlock == 0 && kScaleBlock % kAtomN == 0,
                "one A scale per row a k-block, one B scale per chunk a k-block");

  using Element = cutlass::float_e4m3_t;
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BM>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BN>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using MmaAtom = std::conditional_t<kAtomN == 64, cute::SM90_64x64x32_F32E4M3E4M3_SS_TN<>,
                                     cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>>;
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  static auto make_tma_a(const Element* a, int a_rows, int k) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(a), cute::make_shape(a_rows, k),
                               cute::make_stride(static_cast<std::int64_t>(k), cute::_1{}));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutA{}(cute::_, cute::_, 0));
  }
  static auto make_tma_b(const Element* b, int n, int k, int num_experts) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(b), cute::make_shape(n, k, num_experts),
                               cute::make_stride(static_cast<std::int64_t>(k), cute::_1{}, static_cast<std::int64_t>(n) * k));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutB{}(cute::_, cute::_, 0));
  }
  using TmaA = decltype(make_tma_a(nullptr, 1, 16));
  using TmaB = decltype(make_tma_b(nullptr, 16, 16, 1));
  // B's coordinates as the producer reads them (VarlenMConfig::b_coord_shape): the plain (n, k, E).
  CUTE_HOST_DEVICE static auto b_coord_shape(int n, int k, int num_experts) {
    return cute::make_shape(n, k, num_experts);
  }
};

using VarlenMFp8ContiguousCfg = VarlenMFp8Config</*kGatherA=*/false>;
using VarlenMFp8GatherCfg = VarlenMFp8Config</*kGatherA=*/true>;
// The production contiguous-A instance (fp8_store_contiguous: the down-projection, dXe): BN = 256 (variant 2).
// Measured on an H200 at readme-default's down-projection (M 262144, N 4096, K 1024), sonicmoe-bench-gemm fp8:
// 1044 TFLOP/s against 804 for BN = 128, the same outputs bitwise. Gathered A keeps BN = 128: the gather loader's
// registers beside the BN = 256 fragments spill inside the K loop (498 against 744 TFLOP/s).
using VarlenMFp8ContiguousWideCfg = VarlenMFp8Config</*kGatherA=*/false, /*kVariant=*/2>;

// One tile's K loop with per-k-block promotion (k_tiles >= 1, k a multiple of 128: no K tail); returns with acc
// complete and every stage released, as mma_k_loop. Per k-block (Cfg::kRolling false: variants 0 and 2), per chunk
// of kAtomN columns: the warpgroup's wgmma into tmp (ScaleOut::Zero on the first), wait for them (promotion reads
// tmp), after the last chunk give the stage back at once (the producer refills it while this thread promotes),
// then acc += tmp * (a_scale[row] * b_scale[chunk]). The other consumer warpgroup's wgmma run under this one's
// promotion (DeepGEMM's pattern). kRolling (variants 1 and 3): two tmp buffers of one 64x64 chunk each; the next
// chunk is always in flight while the current one is promoted (mma_k_loop_rolling below).
// Scales come straight from global memory (L2: a tile reads 2 x 128 x k/128 floats of A and k/128 of B a 128
// columns): this thread's two rows' scales and the tile's B scales of k-block kt + 1 are loaded while the wgmma of
// kt run, so the loads' latency hides under the MMA; staging them through shared memory would cost a barrier and a
// producer role.
// The rows of a promoted value: m0 or m0 + 8, from the wgmma accumulator layout (CLayout_64xN: value i of a chunk
// is row + 8 * ((i >> 1) & 1)); ScaleRow checks it against crd at compile time where crd's offsets are static.
template <class Cfg>
struct Fp8Scales {
  static constexpr int kBScales = Cfg::BN / Cfg::kScaleBlock;
  // Offsets (floats) of this thread's two rows' and the tile's B scale rows, -1 for none: 32-bit offsets from the
  // kernel parameters' base pointers (read from the constant bank) rather than 64-bit pointers, two registers fewer each.
  int oa[2], ob[kBScales];
  float a[2], b[kBScales];
  float na[2], nb[kBScales];
  template <class Crd>
  __device__ __forceinline__ Fp8Scales(const VarlenMMainloopParams<Cfg>& p, const VarlenTile& tile, const Crd& crd,
                                       int k_tiles) {
    using namespace cute;
    const int m0 = get<0>(crd(0));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + 8 * h;
      int g = -1;
      if (m < tile.rows) g = Cfg::kGatherA ? __ldg(p.gather + tile.row0 + m) : tile.row0 + m;
      // a row past the tile or an out-of-range index: its A codes were zero-filled, scale 0 keeps it 0
      oa[h] = g >= 0 && g < p.a_rows ? g * k_tiles : -1;
    }
    const int n_blocks = (p.n + Cfg::kScaleBlock - 1) / Cfg::kScaleBlock;
#pragma unroll
    for (int j = 0; j < kBScales; ++j) {
      const int nb_idx = tile.n_tile * kBScales + j;  // past n (BN = 256, n % 256 != 0): columns never stored
      ob[j] = nb_idx < n_blocks ? (tile.expert * n_blocks + nb_idx) * k_tiles : -1;
    }
    load(p, 0, a, b);
  }
  __device__ __forceinline__ void load(const VarlenMMainloopParams<Cfg>& p, int kb, float (&ta)[2],
                                       float (&tb)[kBScales]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) ta[h] = oa[h] >= 0 ? __ldg(p.scales.a + oa[h] + kb) : 0.0f;
#pragma unroll
    for (int j = 0; j < kBScales; ++j) tb[j] = ob[j] >= 0 ? __ldg(p.scales.b + ob[j] + kb) : 0.0f;
  }
  // the next k-block's, in flight under the wgmma
  __device__ __forceinline__ void prefetch(const VarlenMMainloopParams<Cfg>& p, int kb, int k_tiles) {
    if (kb < k_tiles) load(p, kb, na, nb);
  }
  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int h = 0; h < 2; ++h) a[h] = na[h];
#pragma unroll
    for (int j = 0; j < kBScales; ++j) b[j] = nb[j];
  }
};

// acc_c += tmp * s[row]: one chunk's promotion (acc_c, tmp: that chunk's kAtomN / 2 values of this thread).
template <class AccC, class Tmp>
__device__ __forceinline__ void promote_chunk(AccC&& acc_c, const Tmp& tmp, float s0, float s1) {
  using namespace cute;
  constexpr int kVals = decltype(size(tmp))::value;
#pragma unroll
  for (int i = 0; i < kVals; ++i) acc_c(i) = fmaf(tmp(i), ((i >> 1) & 1) ? s1 : s0, acc_c(i));
}

// One chunk's wgmma on stage `stage`: tmp = A . B over the stage's k-blocks (B's columns of chunk c), one batch.
template <class Mma, class FragA, class FragB, class Tmp>
__device__ __forceinline__ void chunk_wgmma(Mma& mma, const FragA& tCrA, const FragB& tCrB, Tmp& tmp, int c,
                                            int stage) {
  using namespace cute;
  warpgroup_fence_operand(tmp);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    cute::gemm(mma, tCrA(_, 0, kb, stage), tCrB(_, c, kb, stage), tmp);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Chunk c's promotion: acc(_, 0, c) += tmp * (this thread's A row scales x the B scale of c's column block), acc_c
// fenced on both sides (warpgroup_fence_operand) so that the compiler keeps the FFMA in place among the wgmma.
template <class Cfg, class Accum, class Tmp>
__device__ __forceinline__ void promote_scaled(Accum& acc, const Tmp& tmp, const Fp8Scales<Cfg>& sc, int c) {
  using namespace cute;
  const float bs = sc.b[c / (Cfg::kScaleBlock / Cfg::kAtomN)];
  auto acc_c = acc(_, 0, c);
  warpgroup_fence_operand(acc_c);
  promote_chunk(acc_c, tmp, sc.a[0] * bs, sc.a[1] * bs);
  warpgroup_fence_operand(acc_c);
}

template <class Crd>
__device__ __forceinline__ void check_row_layout(const Crd& crd) {
  using namespace cute;
  // The accumulator's value order (rows m0 / m0 + 8 alternate in pairs), as promote_chunk assumes it.
  constexpr int kVals = decltype(size(crd))::value;
#pragma unroll
  for (int i = 0; i < kVals; ++i) assert(get<0>(crd(i)) - get<0>(crd(0)) == 8 * ((i >> 1) & 1));
}

template <class Cfg, class Smem, class Accum, class FragA, class FragB, class Crd, class Refill>
__device__ __forceinline__ void mma_k_loop_promoted(typename Cfg::TiledMma& mma, Accum& acc, const FragA& tCrA,
                                                    const FragB& tCrB, Smem& s, PipeState<Cfg::Stages>& rd,
                                                    int k_tiles, bool release_lane, Refill&& refill,
                                                    const VarlenMMainloopParams<Cfg>& p, const VarlenTile& tile,
                                                    const Crd& crd) {
  using namespace cute;
  constexpr int kChunks = Cfg::kChunks;
  static_assert(decltype(size<2>(acc))::value == kChunks && decltype(size<1>(acc))::value == 1, "acc (MMA, 1, chunks)");
#ifndef NDEBUG
  check_row_layout(crd);
#endif
  Fp8Scales<Cfg> sc(p, tile, crd, k_tiles);
#pragma unroll
  for (int i = 0; i < decltype(size(acc))::value; ++i) acc(i) = 0.0f;

  if constexpr (!Cfg::kRolling) {
    Tensor tmp = make_fragment_like(acc(_, 0, 0));
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
      Barrier::wait(&s.full[rd.index], rd.phase);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        chunk_wgmma(mma, tCrA, tCrB, tmp, c, rd.index);
        if (c == 0) sc.prefetch(p, kt + 1, k_tiles);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tmp);
        if (c == kChunks - 1) {
          if (release_lane) Barrier::arrive(&s.empty[rd.index]);
          refill();
          rd.advance();
        }
        promote_scaled(acc, tmp, sc, c);
      }
      sc.advance();
    }
  } else {
    // Rolling (variants 1, 3): chunk j of the tile's stream (k-block j / kChunks, chunk j % kChunks) goes to
    // buffer j & 1 (kChunks even: buffer c & 1). Invariant at the top of chunk c: its wgmma are in flight (or done).
    static_assert(kChunks % 2 == 0, "two buffers alternate within a k-block");
    Tensor tmp0 = make_fragment_like(acc(_, 0, 0));
    Tensor tmp1 = make_fragment_like(acc(_, 0, 0));
    auto issue = [&](auto& t, int c, int stage) { chunk_wgmma(mma, tCrA, tCrB, t, c, stage); };
    // One k-block; more: the next k-block's first chunk is issued before this one's last is promoted (else
    // wait<0>). ptxas serializes every wgmma of the kernel (C7514) when a wgmma group is still in flight across a
    // loop back-edge while other accumulator registers are read (reproduced with a minimal kernel: any such
    // carried group does it; FlashAttention-3's in-iteration overlap does not), so the rolling runs in unrolled
    // groups of kRollUnroll k-blocks that drain at the group's end (its last chunk promoted under the other
    // warpgroup's wgmma only), and the k_tiles % kRollUnroll rest one drained k-block at a time.
    auto kblock = [&](int kt, bool more) {  // `more` a constant once unrolled
      sc.prefetch(p, kt + 1, k_tiles);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        auto& cur = (c & 1) ? tmp1 : tmp0;
        auto& nxt = (c & 1) ? tmp0 : tmp1;
        if (c + 1 < kChunks) {  // the k-block's next chunk
          issue(nxt, c + 1, rd.index);
          warpgroup_wait<1>();
        } else {  // the last chunk: the next k-block's first (its stage's full barrier first), then release this one
          if (more) {
            const int ni = rd.index + 1 == Cfg::Stages ? 0 : rd.index + 1;
            const std::uint32_t np = rd.index + 1 == Cfg::Stages ? rd.phase ^ 1u : rd.phase;
            Barrier::wait(&s.full[ni], np);
            issue(nxt, 0, ni);
            warpgroup_wait<1>();
          } else {
            warpgroup_wait<0>();
          }
          if (release_lane) Barrier::arrive(&s.empty[rd.index]);
          refill();
          rd.advance();
        }
        warpgroup_fence_operand(cur);
        promote_scaled(acc, cur, sc, c);
      }
      sc.advance();
    };
    constexpr int kU = Cfg::kRollUnroll;
    int kt = 0;
#pragma unroll 1
    for (; kt + kU <= k_tiles; kt += kU) {
      Barrier::wait(&s.full[rd.index], rd.phase);
      issue(tmp0, 0, rd.index);
#pragma unroll
      for (int u = 0; u < kU; ++u) kblock(kt + u, u + 1 < kU);
    }
#pragma unroll 1
    for (; kt < k_tiles; ++kt) {
      Barrier::wait(&s.full[rd.index], rd.phase);
      issue(tmp0, 0, rd.index);
      kblock(kt, false);
    }
  }
}

}  // namespace sonicmoe::cuda::gemm::sm90

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
template <bool kGatherA_>
struct VarlenMFp8Config {
  static constexpr bool kGatherA = kGatherA_, kBMN = false, kMmaGather = kGatherA_;
  static constexpr bool kProducerGather = false;
  static constexpr int BM = 128, BN = 128, BK = 128;
  static constexpr int Stages = 5;
  static constexpr int kStageLd = BN + 8;  // staging row pitch (elements), as VarlenMConfig
  static constexpr bool kWide = false;
  static constexpr int kThreads = 384;
  static constexpr int kProducerWarps = 1;
  static constexpr int kEpilogueWarps = 3;
  static constexpr int kProducerThreads = 32, kConsumerThreads = 256;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kGatherThreads = kMmaGather ? kConsumerThreads : 0;
  // 128 accumulator registers of a consumer thread + scales and addresses: ptxas reports no spills under 216.
  static constexpr int kLightRegs = 72;
  static constexpr int kConsumerRegs = 216;
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
  static_assert(BK == kScaleBlock && BN == kScaleBlock, "one A scale per row and one B scale per tile a k-block");

  using Element = cutlass::float_e4m3_t;
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BM>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BN>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using MmaAtom = cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>;
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

// One tile's K loop with per-k-block promotion (k_tiles >= 1, k a multiple of 128: no K tail); returns with acc
// complete and every stage released, as mma_k_loop. Per k-block: the warpgroup's wgmma into tmp (ScaleOut::Zero on
// the first), wait for them (promotion reads tmp), give the stage back at once (the producer refills it while this
// thread promotes), then acc += tmp * (a_scale[row] * b_scale). The other consumer warpgroup's wgmma run under
// this one's promotion (DeepGEMM's pattern); a second tmp fragment to overlap within a warpgroup does not fit.
// Scales come straight from global memory (L2: a tile reads 2 x 128 x k/128 floats of A and k/128 of B): this
// thread's two rows' scales and the tile's B scale of k-block kt + 1 are loaded while the wgmma of kt run, so the
// loads' latency hides under the MMA; staging them through shared memory would cost a barrier and a producer role.
template <class Cfg, class Smem, class Accum, class FragA, class FragB, class Crd, class Refill>
__device__ __forceinline__ void mma_k_loop_promoted(typename Cfg::TiledMma& mma, Accum& acc, const FragA& tCrA,
                                                    const FragB& tCrB, Smem& s, PipeState<Cfg::Stages>& rd,
                                                    int k_tiles, bool release_lane, Refill&& refill,
                                                    const VarlenMMainloopParams<Cfg>& p, const VarlenTile& tile,
                                                    const Crd& crd) {
  using namespace cute;
  constexpr int kVals = decltype(size(acc))::value;
  // This thread's rows of the tile: m0 and m0 + 8 (the wgmma accumulator layout; checked per value below).
  const int m0 = get<0>(crd(0));
  const float* sa[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + 8 * h;
    int g = -1;
    if (m < tile.rows) g = Cfg::kGatherA ? __ldg(p.gather + tile.row0 + m) : tile.row0 + m;
    // a row past the tile or an out-of-range index: its A codes were zero-filled, scale 0 keeps it 0
    sa[h] = g >= 0 && g < p.a_rows ? p.scales.a + static_cast<std::int64_t>(g) * k_tiles : nullptr;
  }
  const int n_blocks = (p.n + Cfg::kScaleBlock - 1) / Cfg::kScaleBlock;
  const float* sb = p.scales.b + (static_cast<std::int64_t>(tile.expert) * n_blocks + tile.n_tile) * k_tiles;
  auto load_scales = [&](int kb, float& a0, float& a1, float& b) {
    a0 = sa[0] ? __ldg(sa[0] + kb) : 0.0f;
    a1 = sa[1] ? __ldg(sa[1] + kb) : 0.0f;
    b = __ldg(sb + kb);
  };
  float a0, a1, b;
  load_scales(0, a0, a1, b);

  Tensor tmp = make_fragment_like(acc);
#pragma unroll
  for (int i = 0; i < kVals; ++i) acc(i) = 0.0f;
#pragma unroll 1
  for (int kt = 0; kt < k_tiles; ++kt) {
    Barrier::wait(&s.full[rd.index], rd.phase);
    warpgroup_fence_operand(tmp);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(mma, tCrA(_, _, kb, rd.index), tCrB(_, _, kb, rd.index), tmp);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    float na0 = 0.0f, na1 = 0.0f, nb = 0.0f;  // the next k-block's, in flight under the wgmma
    if (kt + 1 < k_tiles) load_scales(kt + 1, na0, na1, nb);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tmp);
    if (release_lane) Barrier::arrive(&s.empty[rd.index]);
    refill();
    rd.advance();
    const float s0 = a0 * b, s1 = a1 * b;
    warpgroup_fence_operand(acc);
#pragma unroll
    for (int i = 0; i < kVals; ++i) {
      const int dm = get<0>(crd(i)) - m0;  // 0 or 8, a constant once unrolled
      acc(i) = fmaf(tmp(i), dm == 0 ? s0 : s1, acc(i));
    }
    warpgroup_fence_operand(acc);
    a0 = na0;
    a1 = na1;
    b = nb;
  }
}

}  // namespace sonicmoe::cuda::gemm::sm90

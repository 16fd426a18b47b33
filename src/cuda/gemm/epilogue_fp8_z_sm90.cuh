// Up-projection epilogue of the FP8 layer (DESIGN.md section 9): A = act(Z) in bf16 as EpiActivationTma, with Z
// leaving in whichever of two forms the caller asks for:
//   z            bf16 [rows, n], by TMA as EpiActivationTma (the GEMM tests and benchmark compare it)
//   z_q, z_scale its 1x128 FP8 codes [rows, n] and fp32 scales [rows, n / 128]: the FP8 layer's saved Z, written
//                here instead of a bf16 Z that a second pass would read back and quantise
// or neither (inference: A only). A tile row holds one (BN 128: the gathered kernel) or two (BN 256: the contiguous
// one) 1x128 blocks, each quantised from its bf16 values by the quantisers' own device code (quant_common.cuh,
// core/fp8_e4m3.h) over the 16 lanes that hold it: the codes and scales are bitwise fp8_quantize_rows of the bf16 Z.
// The consumer warps may take a share of the rows (consumer_rows, as EpiDgatedFp8).
#pragma once

#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/quant/quant_common.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

template <Activation A>
struct EpiActivationFp8Z {
  using Tma = EpiActivationTma<A>;  // its Params (the TMA map only with a bf16 z) and its `stage`
  using Base = typename Tma::Base;
  struct Params : Tma::Params {
    std::uint8_t* z_q = nullptr;  // [rows, n] or null
    float* z_scale = nullptr;     // [rows, n / 128]
    // Rows of each 16-row group a consumer warp emits itself after staging (ConsumerRowSplit, even, 0 .. 16):
    // fp8_z_consumer_rows (heuristics.h).
    int consumer_rows = 0;
  };
  static constexpr bool kConsumerEmit = true;  // the kernel runs emit_rows on the consumers' share
  static Params make_params(__nv_bfloat16* z, std::uint8_t* z_q, float* z_scale, __nv_bfloat16* a,
                            const __nv_bfloat16* bias, int n, int rows) {
    Params p{};
    p.act = {z, a, bias, n, 0, 0};
    if (z != nullptr) p.out = TmaOut::make(z, rows, n);
    p.z_q = z_q;
    p.z_scale = z_scale;
    return p;
  }
  template <class Cfg, class Acc, class Crd>
  __device__ static void stage(const Params& p, const EpiTile& et, const Acc& acc, const Crd& crd,
                               __nv_bfloat16* st) {
    Tma::template stage<Cfg>(p, et, acc, crd, st);
  }
  // The epilogue warps' part of a tile (the bf16 Z's TMA store, when asked for, whole): every row (consumer_rows 0),
  // else the rows ConsumerRowSplit leaves them.
  template <class Cfg, class Ready>
  __device__ static void emit(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int lane,
                              Ready&& ready) {
    ready();
    const bool full = et.t.rows == Cfg::BM;
    const bool issuer = p.act.z != nullptr && full && warp == 0 && lane == 0;
    if (issuer) tma_store_tile<Cfg>(p.out, et.t.row0, et.col0, st);
    const ConsumerRowSplit sp{p.consumer_rows};
    emit_rows<Cfg>(p, et, st, warp, Cfg::kEpilogueWarps, lane, sp.epilogue_count(et.t.rows),
                   [=](int v) { return sp.epilogue_row(v); }, [] {});
    if (issuer) cute::tma_store_wait<0>();
    __syncwarp();
  }
  // Rows map(v) for v = warp * kRows + row lane, stepping by nwarps * kRows, v < count, once `ready` returns: Z
  // quantised (z_q), A, and the bf16 Z of a partial tile (a full one leaves by TMA).
  template <class Cfg, class Map, class Ready>
  __device__ static void emit_rows(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int nwarps,
                                   int lane, int count, Map&& map, Ready&& ready) {
    using RL = RowLanes<Cfg>;  // kLanes lanes a row, 8 columns each
    constexpr int kBlockLanes = fp8::kBlock / 8;  // the lanes of one 1x128 block of Z
    static_assert(Cfg::BN % fp8::kBlock == 0 && RL::kLanes % kBlockLanes == 0, "a tile row is whole 1x128 blocks");
    static_assert(Cfg::BM == ConsumerRowSplit::kGroupRows * ConsumerRowSplit::kGroups, "two warpgroups of m64 wgmma");
    ready();
    const bool full = et.t.rows == Cfg::BM;
    const int cl = RL::col_lane(lane);
    const int gcol = et.col0 + 8 * cl;
    const bool col = gcol < p.act.n;  // the same for a block's 16 lanes with z_q (n a multiple of 128)
    const int n_blocks = p.act.n / fp8::kBlock;
    // Every lane runs every iteration: a row's amax is a shuffle over its kLanes lanes.
    for (int v0 = warp * RL::kRows; v0 < count; v0 += nwarps * RL::kRows) {
      const int v = v0 + RL::row_lane(lane);
      const int m = v < count ? map(v) : et.t.rows;
      const bool row = m < et.t.rows;
      const uint4 zv = swizzled8(st, row ? m : map(v0), cl);
      const std::int64_t r = et.t.row0 + m;
      if (p.z_q != nullptr) {
        float f[8];
        quant::bf16x8_to_f32(zv, f);
        const fp8::BlockScale s = fp8::block_scale(quant::group_max(quant::amax_bits(f), kBlockLanes));
        if (row && col) {
          quant::store_codes<8>(p.z_q + r * p.act.n + gcol, f, s);
          if (cl % kBlockLanes == 0) p.z_scale[r * n_blocks + gcol / fp8::kBlock] = s.scale;
        }
      }
      if (row && col) {
        if (p.act.z != nullptr && !full) *reinterpret_cast<uint4*>(p.act.z + r * p.act.n + gcol) = zv;
        Base::store_a(p.act, r, gcol, zv);
      }
    }
  }
};

}  // namespace sonicmoe::cuda::gemm::sm90

// dgated epilogue of the FP8 layer (DESIGN.md section 9, step 7): EpiDgated's formulas (epilogue_sm90.cuh) on the
// FP8 kernel's 128-wide tile, with the saved Z read in FP8 and dZ leaving in two forms, so that neither a
// dequantising pass before the GEMM nor a quantising pass after it is needed:
//   Z           read as its 1x128 codes [rows, zw] and scales [rows, zw / 128] (the up-projection's EpiActivationFp8Z
//               wrote them) and dequantised in registers: bf16(e4m3(code) * scale), bitwise fp8_dequantize_rows_bf16
//   dz          bf16 [rows, zw] (the weight gradient dW1 and db1 read it)
//   dz_q, dz_scale  optional: its 1x128 codes and scales, quantised from the bf16 dZ by the quantisers' own device code
//               (quant_common.cuh): bitwise fp8_quantize_rows of dz (the dXe GEMM's A operand)
//   as, ds_partial  as EpiDgated: s * act(Z) [rows, n]; per (row, N tile) <G, act(Z)>, the same butterfly order
// zw = 2n (GLU) or n, a multiple of 128. A warp takes two rows at once on the FP8 kernel's 128-wide tile, one on a
// 256-wide one (RowLanes: 16 or 32 lanes a row, 8 G columns and the 16 (GLU) or 8 Z columns of those a lane), so the
// 1x128 blocks of Z and dZ are lane groups of 8 (GLU) or 16 either way.
// Rows are shared with the consumer warps (consumer_rows, kConsumerEmit): each consumer warp emits the first rows of
// the 16 it staged right after staging them, the three epilogue warps the others, so that this epilogue's work does
// not set the kernel's pace (heuristics.h, fp8_dgated_consumer_rows). Which warp takes a row changes no arithmetic.
// Measurements and where the kernel's time goes: docs/notes/fp8_dgated_epilogue.md.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cuda/gemm/epilogue_sm90.cuh"
#include "cuda/quant/quant_common.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// v[4i + j] = e4m3(byte j of w[i]) * s, for W words of codes: bitwise the dequantiser's bf16(e4m3 * scale) without
// its rounding instruction. Z's scales are the quantisers' powers of two (NaN for a non-finite block), and an e4m3
// value (4 significant bits) times a power of two is exact in fp32 and in bf16 (8 significant bits, fp32's exponent
// range) unless it falls below 2^-130, under bf16's normal range (blocks whose amax is below ~2^-122: never in
// practice); the e4m3 -> f16 conversion is exact.
template <int W>
__device__ __forceinline__ void dequant_words(const std::uint32_t (&w)[W], float s, float* v) {
#pragma unroll
  for (int i = 0; i < W; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * h)), __NV_E4M3);
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&r));
      v[4 * i + 2 * h] = x.x * s;
      v[4 * i + 2 * h + 1] = x.y * s;
    }
  }
}

template <Activation A>
struct EpiDgatedFp8 {
  static constexpr bool kGlu = ew::kGlu<A>;
  static constexpr bool kDgated = true;  // the tile-order rule (varlen_m_raster_rule)
  static constexpr int kZc = kGlu ? 16 : 8;  // Z (and dZ) values of a lane's 8 G columns
  using Codes = std::conditional_t<kGlu, uint4, uint2>;
  struct Params {
    const std::uint8_t* z_q = nullptr;   // [rows, zw]
    const float* z_scale = nullptr;      // [rows, zw / 128]
    const float* pair_score = nullptr;   // [pairs]
    const std::int32_t* pair = nullptr;  // [rows]
    __nv_bfloat16* dz = nullptr;         // [rows, zw]
    std::uint8_t* dz_q = nullptr;        // [rows, zw] or null
    float* dz_scale = nullptr;           // [rows, zw / 128]
    __nv_bfloat16* as = nullptr;         // [rows, n] or null
    float* ds_partial = nullptr;         // [n_tiles, partial_stride]
    std::int64_t partial_stride = 0;
    int n = 0;  // I
    // Rows of each 16-row group a consumer warp emits itself after staging (ConsumerRowSplit; even, 0 .. 16; 0: the
    // epilogue warps take every row): fp8_dgated_consumer_rows (heuristics.h).
    int consumer_rows = 0;
  };
  static constexpr bool kConsumerEmit = true;  // the kernel runs emit_rows on the consumers' share
  template <class Cfg, class Acc, class Crd>
  __device__ static void stage(const Params&, const EpiTile&, const Acc& acc, const Crd& crd, __nv_bfloat16* st) {
    stage_pairs<Cfg>(acc, crd, st, PackPair<>{});
  }
  // As EpiDgated: a warp's row pairs software-pipelined kDepth deep (the Z codes, Z scale and router score of row
  // pair j + kDepth - 1 issued before pair j is computed), the first ones before the staging tile is ready.
  static constexpr int kDepth = 4;
  static constexpr int kEpilogueRegs = 104;  // EpiDgated's budget (ptxas: no spills)
  struct Slot {
    Codes q;
    float zs, s;
  };
  // The epilogue warps' part of a tile: every row (consumer_rows 0), else the rows ConsumerRowSplit leaves them.
  template <class Cfg, class Ready>
  __device__ static void emit(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int lane,
                              Ready&& ready) {
    const ConsumerRowSplit sp{p.consumer_rows};
    emit_rows<Cfg>(p, et, st, warp, Cfg::kEpilogueWarps, lane, sp.epilogue_count(et.t.rows),
                   [=](int v) { return sp.epilogue_row(v); }, static_cast<Ready&&>(ready));
  }
  // Rows map(v) for v = warp * kRows + rl, stepping by nwarps * kRows, v < count; a row past the tile's rows is
  // skipped (its lanes still join the row's shuffles).
  template <class Cfg, class Map, class Ready>
  __device__ static void emit_rows(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int nwarps,
                                   int lane, int count, Map&& map, Ready&& ready) {
    static_assert(Cfg::BN % fp8::kBlock == 0, "128- or 256-wide tiles: a 1x128 block of Z is whole in a tile");
    static_assert(Cfg::BM == ConsumerRowSplit::kGroupRows * ConsumerRowSplit::kGroups, "two warpgroups of m64 wgmma");
    using RL = RowLanes<Cfg>;
    const int step = nwarps * RL::kRows;  // rows the warps take at once
    constexpr int kBlockLanes = fp8::kBlock / kZc;          // lanes of one 1x128 block of Z / dZ
    const int rows = et.t.rows;
    const int cl = RL::col_lane(lane), rl = RL::row_lane(lane);
    const int gcol = et.col0 + 8 * cl;  // G columns gcol .. gcol + 7; Z columns zcol .. zcol + kZc - 1
    const bool col_ok = gcol < p.n;     // GLU with n % 128 == 64: the last tile's upper 8 lanes idle
    const int zw = kGlu ? 2 * p.n : p.n, nb = zw / fp8::kBlock, zcol = (kGlu ? 2 : 1) * gcol;
    const int blk = zcol / fp8::kBlock;
    const std::int64_t row0 = et.t.row0;
    auto row_of = [&](int v) { return v < count ? map(v) : rows; };
    auto load = [&](Slot& sl, int v) {
      const int m = row_of(v);
      const bool ok = m < rows;
      const std::int64_t r = row0 + m;
      sl.s = ok ? __ldg(p.pair_score + __ldg(p.pair + r)) : 0.0f;
      if (ok && col_ok) {
        sl.q = __ldg(reinterpret_cast<const Codes*>(p.z_q + r * zw + zcol));
        sl.zs = __ldg(p.z_scale + r * nb + blk);
      } else {
        sl.q = Codes{};
        sl.zs = 0.0f;
      }
    };
    auto compute = [&](const Slot& sl, int v) {
      const int m = row_of(v);
      const bool ok = m < rows && col_ok;
      const std::int64_t r = row0 + m;
      const float s = sl.s;
      float dot = 0.0f;
      float dzv[kZc];  // the bf16 dZ as fp32 (zeros where this lane has none), for the 1x128 quantiser
      if (ok) {
        float z[kZc];
        if constexpr (kGlu) {
          const std::uint32_t w[4] = {sl.q.x, sl.q.y, sl.q.z, sl.q.w};
          dequant_words<4>(w, sl.zs, z);
        } else {
          const std::uint32_t w[2] = {sl.q.x, sl.q.y};
          dequant_words<2>(w, sl.zs, z);
        }
        const uint4 gv = staged8<Cfg>(st, m, cl);
        const std::uint32_t* gu = reinterpret_cast<const std::uint32_t*>(&gv);
        std::uint32_t dzu[kZc / 2], asu[4];
        dgated_lane8<A, cutlass::bfloat16_t>(z, gu, s, dzu, asu, dot);
        uint4* dzp = reinterpret_cast<uint4*>(p.dz + r * zw + zcol);
#pragma unroll
        for (int u = 0; u < kZc / 8; ++u) dzp[u] = make_uint4(dzu[4 * u], dzu[4 * u + 1], dzu[4 * u + 2], dzu[4 * u + 3]);
        if (p.as) *reinterpret_cast<uint4*>(p.as + r * p.n + gcol) = make_uint4(asu[0], asu[1], asu[2], asu[3]);
#pragma unroll
        for (int u = 0; u < kZc / 2; ++u) {
          const float2 d = unpack_bf162(dzu[u]);
          dzv[2 * u] = d.x;
          dzv[2 * u + 1] = d.y;
        }
      } else {
#pragma unroll
        for (int u = 0; u < kZc; ++u) dzv[u] = 0.0f;
      }
      // Row sum over the row's lanes: EpiDgated's butterfly (without its step across the other row at 16 lanes a row).
#pragma unroll
      for (int o = RL::kLanes / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (m < rows && cl == 0) p.ds_partial[static_cast<std::int64_t>(et.t.n_tile) * p.partial_stride + r] = dot;
      if (p.dz_q != nullptr) {  // uniform: every lane takes part in the block's amax
        const fp8::BlockScale bs = fp8::block_scale(quant::group_max(quant::amax_bits(dzv), kBlockLanes));
        if (ok) {
          quant::store_codes<kZc>(p.dz_q + r * zw + zcol, dzv, bs);
          if (cl % kBlockLanes == 0) p.dz_scale[r * nb + blk] = bs.scale;
        }
      }
    };
    Slot ring[kDepth];
#pragma unroll
    for (int i = 0; i + 1 < kDepth; ++i) load(ring[i], warp * RL::kRows + rl + i * step);
    ready();
#pragma unroll 1
    for (int m0 = warp * RL::kRows; m0 < count; m0 += kDepth * step) {
#pragma unroll
      for (int ph = 0; ph < kDepth; ++ph) {
        const int mp = m0 + ph * step;  // this warp's row pair: mp + rl
        if (mp >= count) break;          // uniform across the warp
        load(ring[(ph + kDepth - 1) % kDepth], mp + (kDepth - 1) * step + rl);
        compute(ring[ph], mp + rl);
      }
    }
  }
};

}  // namespace sonicmoe::cuda::gemm::sm90

// Epilogue policies of the native varlen-M GEMM, each in two parts (kernel_sm90_varlen_m.cuh), and the math the
// TMA-store policies (epilogue_tma_store_sm90.cuh) share with them:
//   stage  consumer warpgroups, fp32 accumulators -> 16-bit (bf16 or f16: E) staging tile in shared memory (row pitch
//          Cfg::kStageLd): what needs the fp32 value (bias, row scale) happens here;
//   emit   epilogue warps, staging tile -> global memory: one warp per row, 8 columns (16 bytes) per lane,
//          so every global access is a coalesced 16-byte vector; runs under the next tile's K loop. It gets a
//          `ready` callable (the wait for the staging tile) and calls it before reading the tile, so loads that do
//          not depend on the accumulators (dgated: Z, the router scores) can be issued while the K loop still runs.
//   EpiStore        params and value of C = bf16((acc + bias[e]) * row_scale[r])  (steps 5, 10a; EpiStoreTma)
//   EpiActivation   params and value of Z = bf16(acc + b1[e]), A = act(Z)       (step 4; EpiActivationTma)
//   EpiDgated       G = bf16(acc); A = act(Z) recomputed, dZ, s*A, per-row <G, A> partials  (step 7)
// wgmma accumulator layout (m64nNk16, fp32): values 2i and 2i+1 of a thread are columns c, c+1 (c even) of one
// row, and a warp's stores of one value pair cover 8 rows x 4 lanes; with the +8-element row padding those
// 4-byte staging stores hit 32 distinct banks. Rows past the tile's valid rows and columns past n are never written to global memory.
#pragma once

#include <cute/tensor.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#include <cstdint>

#include "cuda/elementwise/elementwise_common.cuh"
#include "cuda/gemm/pipeline_sm90.cuh"
#include "cuda/gemm/tile_scheduler_varlen_m.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

struct EpiTile {
  VarlenTile t;
  int col0;  // first column of the tile
};

__device__ __forceinline__ std::uint32_t pack_bf162(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<std::uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_bf162(std::uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}

// The 16-bit element types of the native kernels (Cfg::Element: cutlass::bfloat16_t or cutlass::half_t): fp32 to
// and from their codes, rounded to nearest even. The epilogues' pointers and the staging tile are typed
// __nv_bfloat16 for both (16-bit codes: loads, stores and TMA move bytes); only these conversions read the type.
// f16: values beyond 65504 round to inf (as PyTorch's half does).
template <class E>
struct Elem16;
template <>
struct Elem16<cutlass::bfloat16_t> {
  __device__ static std::uint32_t pack(float x, float y) { return pack_bf162(x, y); }
  __device__ static float2 unpack(std::uint32_t u) { return unpack_bf162(u); }
  __device__ static float to_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static std::uint16_t code(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
template <>
struct Elem16<cutlass::half_t> {
  __device__ static std::uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
  __device__ static float2 unpack(std::uint32_t u) { return __half22float2(*reinterpret_cast<const __half2*>(&u)); }
  __device__ static float to_float(const __nv_bfloat16* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
  __device__ static std::uint16_t code(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// The staging functions' f when there is nothing to apply: the pair rounded to the element type.
template <class E = cutlass::bfloat16_t>
struct PackPair {
  __device__ std::uint32_t operator()(float v0, float v1, int, int) const { return Elem16<E>::pack(v0, v1); }
};

// v0, v1 (columns col, col + 1) += bias[col], bias[col + 1] when there is a bias and the columns exist.
template <class E = cutlass::bfloat16_t>
__device__ __forceinline__ void add_bias_pair(const __nv_bfloat16* bias, int col, int n, float& v0, float& v1) {
  if (bias && col < n) {
    const float2 b = Elem16<E>::unpack(*reinterpret_cast<const std::uint32_t*>(bias + col));
    v0 += b.x;
    v1 += b.y;
  }
}

// The same for b1 in two parts (concatenated [gate; up] halves, part = I; or separate gate / up tensors, part = up -
// gate; MoEConfig::w1_layout): the pair (col, col + 1) of the interleaved Z is (gate_j, up_j), j = col / 2, at
// bias[j] and bias[part + j] (bias: the expert's gate row).
template <class E = cutlass::bfloat16_t>
__device__ __forceinline__ void add_bias_concat(const __nv_bfloat16* bias, int col, int n, std::int64_t half,
                                                float& v0, float& v1) {
  if (bias && col < n) {
    v0 += Elem16<E>::to_float(bias + col / 2);
    v1 += Elem16<E>::to_float(bias + half + col / 2);
  }
}

// Consumer side shared by the policies: staging[m][n] = bf16(f(acc pair, row m, tile column n)).
// f(v0, v1, m, n) -> packed bf16x2 of columns n, n+1.
// Shared-space stores at a per-thread base plus constants (the offsets of a thread's pairs differ by constants).
template <class Cfg, class Acc, class Crd, class F>
__device__ __forceinline__ void stage_pairs(const Acc& acc, const Crd& crd, __nv_bfloat16* stage, F&& f) {
  constexpr int kVals = decltype(cute::size(acc))::value;
  const int m0 = cute::get<0>(crd(0)), n0 = cute::get<1>(crd(0));
  const std::uint32_t base = cute::cast_smem_ptr_to_uint(stage) + 2u * (m0 * Cfg::kStageLd + n0);
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    const int dm = cute::get<0>(crd(i)) - m0, dn = cute::get<1>(crd(i)) - n0;  // constants once unrolled
    const std::uint32_t v = f(acc(i), acc(i + 1), m0 + dm, n0 + dn);
    st_shared_u32(base + 2u * (dm * Cfg::kStageLd + dn), v);
  }
}

// In: lane q of each quad holds v[j] = X[q][j]. Out: v[j] = X[j][q]. Three exchanges; 32-bit values.
__device__ __forceinline__ void quad_transpose(std::uint32_t (&v)[4]) {
  const int q = threadIdx.x & 3;
  std::uint32_t out[4] = {v[0], v[1], v[2], v[3]};
#pragma unroll
  for (int r = 1; r < 4; ++r) {
    const int j = q ^ r;  // lane q ^ r sends X[q ^ r][q] and wants X[q][q ^ r] = v[j]
    const std::uint32_t send = j == 0 ? v[0] : j == 1 ? v[1] : j == 2 ? v[2] : v[3];
    const std::uint32_t got = __shfl_xor_sync(0xffffffffu, send, r);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      if (jj == j) out[jj] = got;
  }
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) v[jj] = out[jj];
}

// Direct store from the consumers' registers (no staging): C[row0 + m][col0 + n] = bf16(acc), rows < rows,
// columns < n_cols; a quad transpose gives each lane 8 consecutive columns, so every store is 16 bytes.
// zero: store zeros without reading the accumulators. Needs the single-atom fragment ((2,2,BN/8),1,1).
template <class E = cutlass::bfloat16_t, class Acc, class Crd>
__device__ __forceinline__ void store_direct(__nv_bfloat16* c, std::int64_t ld, std::int64_t row0, int rows, int col0,
                                             int n_cols, const Acc& acc, const Crd& crd, bool zero) {
  constexpr int G = decltype(cute::size(acc))::value / 4;  // 8-column groups
  const int q = cute::get<1>(crd(0)) / 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = cute::get<0>(crd(2 * h));
    const bool row_ok = m < rows;
#pragma unroll
    for (int jb = 0; jb < G / 4; ++jb) {
      std::uint32_t v[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int i = 4 * (4 * jb + jj) + 2 * h;  // value i = 4g + 2h + c: row m0 + 8h, column 8g + 2q + c
        v[jj] = zero ? 0u : Elem16<E>::pack(acc(i), acc(i + 1));
      }
      quad_transpose(v);
      const int gcol = col0 + 8 * (4 * jb + q);
      if (row_ok && gcol < n_cols)
        *reinterpret_cast<uint4*>(c + (row0 + m) * ld + gcol) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// Transposed store of a consumer warp's 16 rows (a kernel that computes D^T writes D):
// C[(col0 + n) * ld + row0 + m] = bf16(acc(m, n)) for m < rows, col0 + n < n_cols. The warp writes its values into
// a private shared-memory scratch laid out [n][m] (kTrPitch elements per n: 16 m and 8 padding, so the 2-byte
// writes of a warp hit 32 distinct banks), 64 columns per pass, and reads it back as 16-byte vectors of 8
// consecutive m: two lanes write one column's 32 contiguous bytes. zero: store zeros without reading acc.
// Needs ld, row0 and rows multiples of 8 and c 16-byte aligned (the host validates m, n % 8 and the pointer).
inline constexpr int kTrPitch = 24, kTrCols = 64;
inline constexpr int kTrScratchElems = kTrCols * kTrPitch;  // per warp
template <class E = cutlass::bfloat16_t, class Acc, class Crd>
__device__ __forceinline__ void store_transposed(__nv_bfloat16* c, std::int64_t ld, int row0, int rows, int col0,
                                                 int n_cols, const Acc& acc, const Crd& crd, bool zero,
                                                 __nv_bfloat16* scratch) {
  constexpr int kVals = decltype(cute::size(acc))::value;
  constexpr int kPerPass = 32;  // a thread's values of 64 columns (8 column groups x 2 rows x 2)
  static_assert(kVals % kPerPass == 0, "whole passes");
  const int lane = threadIdx.x & 31;
  const int mw = cute::get<0>(crd(0)) & ~15;  // the warp's first row in the tile
#pragma unroll
  for (int pass = 0; pass < kVals / kPerPass; ++pass) {
    __syncwarp();  // the previous pass's reads are done
#pragma unroll
    for (int j = 0; j < kPerPass; ++j) {
      const int i = pass * kPerPass + j;
      const int m = cute::get<0>(crd(i)) - mw, n = cute::get<1>(crd(i)) - pass * kTrCols;
      scratch[n * kTrPitch + m] = __ushort_as_bfloat16(Elem16<E>::code(zero ? 0.0f : static_cast<float>(acc(i))));
    }
    __syncwarp();
#pragma unroll
    for (int v = 0; v < 2 * kTrCols / 32; ++v) {
      const int idx = lane + 32 * v, n = idx >> 1, half = idx & 1;
      const int gn = col0 + pass * kTrCols + n, ml = mw + 8 * half;
      if (gn >= n_cols || ml >= rows) continue;
      *reinterpret_cast<uint4*>(c + static_cast<std::int64_t>(gn) * ld + row0 + ml) =
          *reinterpret_cast<const uint4*>(scratch + n * kTrPitch + 8 * half);
    }
  }
}

// An epilogue warp's lanes over a staged tile: 8 columns (16 bytes) a lane, BN / 8 lanes a row, so a warp covers
// kRows rows at once (BN = 256: one row, lane = column lane; the FP8 kernel's BN = 128: two rows, a half-warp each).
template <class Cfg>
struct RowLanes {
  static_assert(Cfg::BN % 8 == 0 && Cfg::BN <= 256 && 32 % (Cfg::BN / 8) == 0, "a warp covers whole rows");
  static constexpr int kLanes = Cfg::BN / 8, kRows = 32 / kLanes;
  __device__ static int col_lane(int lane) { return kRows == 1 ? lane : lane % kLanes; }
  __device__ static int row_lane(int lane) { return kRows == 1 ? 0 : lane / kLanes; }
};

// A tile's rows shared between the consumer warps and the epilogue warps (an FP8 epilogue policy's consumer_rows c):
// consumer warp cw (0 .. 7) staged rows 16 cw .. 16 cw + 15 (two warpgroups of m64 wgmma) and emits the first c of
// them right after staging them (it reads only what it wrote: no barrier beyond __syncwarp); the epilogue warps take
// the other 16 - c of each group, as rows epilogue_row(v) for v < epilogue_count. c = 0: the epilogue warps take
// every row in order.
struct ConsumerRowSplit {
  static constexpr int kGroupRows = 16, kGroups = 8;
  int c;
  __device__ int epilogue_count(int rows) const { return c == 0 ? rows : kGroups * (kGroupRows - c); }
  __device__ int epilogue_row(int v) const {
    const int per = kGroupRows - c;
    return c == 0 ? v : kGroupRows * (v / per) + c + v % per;
  }
  __device__ int consumer_first(int cw) const { return kGroupRows * cw; }
  __device__ int consumer_count(int cw, int rows) const { return min(c, rows - consumer_first(cw)); }
};

// 8 staged bf16 of row m, tile columns 8 * lane ...
template <class Cfg>
__device__ __forceinline__ uint4 staged8(const __nv_bfloat16* stage, int m, int lane) {
  return ld_shared_v4(cute::cast_smem_ptr_to_uint(stage) + 2u * (m * Cfg::kStageLd + 8 * lane));
}

// ---- plain store ---------------------------------------------------------------------------------
template <class E>
struct EpiStoreOf {
  struct Params {
    __nv_bfloat16* c = nullptr;           // [rows, n]
    const __nv_bfloat16* bias = nullptr;  // [E, n] or null
    const float* row_scale = nullptr;     // [rows] or null
    int n = 0;
  };
  // f(v0, v1, m, n) of stage_swizzled (tma_store_sm90.cuh): bias, row scale, bf16.
  __device__ static auto value(const Params& p, const EpiTile& et) {
    const __nv_bfloat16* bias = p.bias ? p.bias + static_cast<std::int64_t>(et.t.expert) * p.n : nullptr;
    const float* row_scale = p.row_scale;
    const int n_all = p.n;
    return [=](float v0, float v1, int m, int n) {
      add_bias_pair<E>(bias, et.col0 + n, n_all, v0, v1);
      if (row_scale && m < et.t.rows) {
        const float sc = __ldg(row_scale + et.t.row0 + m);
        v0 *= sc;
        v1 *= sc;
      }
      return Elem16<E>::pack(v0, v1);
    };
  }
};
using EpiStore = EpiStoreOf<cutlass::bfloat16_t>;

// ---- up-projection: Z and A = act(Z) -------------------------------------------------------------------
// Needs n % 8 == 0 and, for GLU, I = n / 2 a multiple of 4 (8-byte A stores); the host entry checks I % 8.
template <Activation A, class E = cutlass::bfloat16_t>
struct EpiActivation {
  static constexpr bool kGlu = ew::kGlu<A>;
  struct Params {
    __nv_bfloat16* z = nullptr;           // [rows, n]  (n = z width: 2I for GLU, I otherwise)
    __nv_bfloat16* a = nullptr;           // [rows, I]
    const __nv_bfloat16* bias = nullptr;  // b1 [E, n] or null
    int n = 0;
    // > 0: b1 in two parts (add_bias_concat), the up part bias_part elements after the gate's, bias_expert elements
    // per expert (concatenated: I and n; separate: up - gate and I). 0: b1 [E, n] interleaved.
    std::int64_t bias_part = 0, bias_expert = 0;
  };
  // f(v0, v1, m, n) of stage_swizzled (tma_store_sm90.cuh): bias, bf16.
  __device__ static auto value(const Params& p, const EpiTile& et) {
    const std::int64_t expert_stride = p.bias_part > 0 ? p.bias_expert : p.n;
    const __nv_bfloat16* bias = p.bias ? p.bias + static_cast<std::int64_t>(et.t.expert) * expert_stride : nullptr;
    const int n_all = p.n, col0 = et.col0;
    const std::int64_t half = p.bias_part;
    return [=](float v0, float v1, int, int n) {
      if (half > 0) add_bias_concat<E>(bias, col0 + n, n_all, half, v0, v1);
      else add_bias_pair<E>(bias, col0 + n, n_all, v0, v1);
      return Elem16<E>::pack(v0, v1);
    };
  }
  // Row r of A from the 8 Z values zv of Z columns gcol .. gcol + 7.
  __device__ static void store_a(const Params& p, std::int64_t r, int gcol, const uint4& zv) {
    const int I = kGlu ? p.n / 2 : p.n;
    const std::uint32_t* zu = reinterpret_cast<const std::uint32_t*>(&zv);
    if constexpr (kGlu) {  // (gate, up) pairs -> 4 A values at A column gcol / 2
      float av[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 z = Elem16<E>::unpack(zu[j]);
        av[j] = ew::act_fwd<A>(z.x, z.y);
      }
      *reinterpret_cast<uint2*>(p.a + r * I + gcol / 2) =
          make_uint2(Elem16<E>::pack(av[0], av[1]), Elem16<E>::pack(av[2], av[3]));
    } else {
      std::uint32_t au[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 z = Elem16<E>::unpack(zu[j]);
        au[j] = Elem16<E>::pack(ew::act_fwd<A>(z.x, 0.f), ew::act_fwd<A>(z.y, 0.f));
      }
      *reinterpret_cast<uint4*>(p.a + r * I + gcol) = make_uint4(au[0], au[1], au[2], au[3]);
    }
  }
};

// ---- dgated ------------------------------------------------------------------------------------------
// One lane's 8 G columns of a dgated epilogue (EpiDgated, EpiDgatedFp8), in column order: for column pair q (G columns
// 2q, 2q + 1: gu[q]) with its Z values (GLU: z[4q .. 4q + 3], the (gate, up) of each column; else z[2q], z[2q + 1]),
// a = act(Z) and dZ (dgated_elem), dZ packed into dzu (GLU: words 2q, 2q + 1; else word q), s * a into asu[q], and
// <G, a> added to dot pair by pair (the row sum's fixed order).
template <Activation A, class E>
__device__ __forceinline__ void dgated_lane8(const float* z, const std::uint32_t* gu, float s, std::uint32_t* dzu,
                                             std::uint32_t (&asu)[4], float& dot) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 g = Elem16<E>::unpack(gu[q]);
    float a0, a1;
    if constexpr (ew::kGlu<A>) {
      float d0, d1, d2, d3;
      a0 = ew::dgated_elem<A>(z[4 * q], z[4 * q + 1], g.x, s, d0, d1);
      a1 = ew::dgated_elem<A>(z[4 * q + 2], z[4 * q + 3], g.y, s, d2, d3);
      dzu[2 * q] = Elem16<E>::pack(d0, d1);
      dzu[2 * q + 1] = Elem16<E>::pack(d2, d3);
    } else {
      float d0, d1, unused;
      a0 = ew::dgated_elem<A>(z[2 * q], 0.f, g.x, s, d0, unused);
      a1 = ew::dgated_elem<A>(z[2 * q + 1], 0.f, g.y, s, d1, unused);
      dzu[q] = Elem16<E>::pack(d0, d1);
    }
    dot = fmaf(g.x, a0, dot);
    dot = fmaf(g.y, a1, dot);
    asu[q] = Elem16<E>::pack(s * a0, s * a1);
  }
}

template <Activation A, class E = cutlass::bfloat16_t>
struct EpiDgated {
  static constexpr bool kGlu = ew::kGlu<A>;
  static constexpr int kZv = kGlu ? 2 : 1;  // 16-byte Z vectors per 8 G columns
  struct Params {
    const __nv_bfloat16* z = nullptr;    // [rows, zw]  (zw = 2n for GLU, n otherwise)
    const float* pair_score = nullptr;   // [pairs]
    const std::int32_t* pair = nullptr;  // [rows]
    __nv_bfloat16* dz = nullptr;         // [rows, zw]
    __nv_bfloat16* as = nullptr;         // [rows, n] or null
    float* ds_partial = nullptr;         // [n_tiles, partial_stride]: per-row <G, A> over one N tile
    std::int64_t partial_stride = 0;
    int n = 0;  // I
  };
  template <class Cfg, class Acc, class Crd>
  __device__ static void stage(const Params&, const EpiTile&, const Acc& acc, const Crd& crd, __nv_bfloat16* st) {
    stage_pairs<Cfg>(acc, crd, st, PackPair<E>{});
  }
  // A warp's rows are software-pipelined kDepth deep: the Z loads of row j + kDepth - 1 are issued before row j is
  // computed (a register ring), the first rows' Z and this warp's router scores before the staging tile is
  // ready. Z, pair and score reads do not depend on the accumulators, so only the G reads wait for `ready`.
  // No L2 prefetch of the tile's Z rows up front: it cost the mainloop's gathered rows and weight panels their L2
  // residency (ncu: the consumers wait on `full`, not on the epilogue); without it the fused dgated runs 2-7%
  // faster on every config (docs/notes/dgated_z_prefetch.md).
#ifndef SONICMOE_DGATED_DEPTH
#define SONICMOE_DGATED_DEPTH 4
#endif
  static constexpr int kDepth = SONICMOE_DGATED_DEPTH;
  // Registers of the epilogue warpgroup (the gathering warpgroup keeps 56): the 4-deep Z ring without spills.
  static constexpr int kEpilogueRegs = 104;
  template <class Cfg, class Ready>
  __device__ static void emit(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int lane,
                              Ready&& ready) {
    constexpr int kEW = Cfg::kEpilogueWarps;
    constexpr int kRowsPerLane = (Cfg::BM + 32 * kEW - 1) / (32 * kEW);  // this warp's rows over its lanes
    const int rows = et.t.rows;
    const int gcol = et.col0 + 8 * lane;  // G columns gcol .. gcol + 7 of this lane
    // BN < 256 (the FP8 kernel): the lanes past the tile's columns idle (the row sums below stay whole-warp)
    const bool col_ok = (Cfg::BN >= 256 || 8 * lane < Cfg::BN) && gcol < p.n;
    const int zw = kGlu ? 2 * p.n : p.n;
    const std::int64_t row0 = et.t.row0;
    const __nv_bfloat16* zlane = p.z + row0 * zw + kZv * gcol;  // this lane's Z of the tile's row 0
    // Router score of row warp + kEW * (lane + 32 i) in s_own[i].
    float s_own[kRowsPerLane];
#pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int m = warp + kEW * (lane + 32 * i);
      s_own[i] = m < rows ? __ldg(p.pair_score + __ldg(p.pair + row0 + m)) : 0.0f;
    }
    using ZRow = uint4[kZv];
    auto load = [&](ZRow& zv, int m) {
      const bool ok = m < rows && col_ok;
#pragma unroll
      for (int u = 0; u < kZv; ++u)
        zv[u] = ok ? __ldg(reinterpret_cast<const uint4*>(zlane + m * zw) + u) : make_uint4(0, 0, 0, 0);
    };
    auto compute = [&](const ZRow& zv, int m) {
      const int j = (m - warp) / kEW;  // this warp's j-th row: its score sits in lane j % 32, s_own[j / 32]
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const float si = __shfl_sync(0xffffffffu, s_own[i], j & 31);
        if (i == j / 32) s = si;
      }
      const std::int64_t r = row0 + m;
      float dot = 0.0f;
      if (col_ok) {
        const uint4 gv = staged8<Cfg>(st, m, lane);
        const std::uint32_t* gu = reinterpret_cast<const std::uint32_t*>(&gv);
        const std::uint32_t* zu = reinterpret_cast<const std::uint32_t*>(zv);
        float z[8 * kZv];
#pragma unroll
        for (int w = 0; w < 4 * kZv; ++w) {
          const float2 zf = Elem16<E>::unpack(zu[w]);
          z[2 * w] = zf.x;
          z[2 * w + 1] = zf.y;
        }
        std::uint32_t dzu[4 * kZv], asu[4];
        dgated_lane8<A, E>(z, gu, s, dzu, asu, dot);
        uint4* dzp = reinterpret_cast<uint4*>(p.dz + r * zw + kZv * gcol);
#pragma unroll
        for (int u = 0; u < kZv; ++u) dzp[u] = make_uint4(dzu[4 * u], dzu[4 * u + 1], dzu[4 * u + 2], dzu[4 * u + 3]);
        if (p.as)
          *reinterpret_cast<uint4*>(p.as + r * p.n + gcol) = make_uint4(asu[0], asu[1], asu[2], asu[3]);
      }
      // Row sum over the warp's lanes (fixed butterfly: deterministic), one partial per (row, N tile).
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) p.ds_partial[static_cast<std::int64_t>(et.t.n_tile) * p.partial_stride + r] = dot;
    };
    ZRow zr[kDepth];
#pragma unroll
    for (int i = 0; i + 1 < kDepth; ++i) load(zr[i], warp + i * kEW);
    ready();
#pragma unroll 1
    for (int m0 = warp; m0 < rows; m0 += kDepth * kEW) {
#pragma unroll
      for (int ph = 0; ph < kDepth; ++ph) {
        const int m = m0 + ph * kEW;
        if (m >= rows) break;  // uniform across the warp
        load(zr[(ph + kDepth - 1) % kDepth], m + (kDepth - 1) * kEW);
        compute(zr[ph], m);
      }
    }
  }
};

}  // namespace sonicmoe::cuda::gemm::sm90

// Epilogue policies whose full output tiles leave shared memory by TMA (tma_store_sm90.cuh) instead of the
// epilogue warps' 16-byte st.global (epilogue_sm90.cuh has the math they share with EpiStore / EpiActivation). ncu showed
// our epilogue warps stalled on L1TEX with row-guarded stores where CUTLASS's kernel stores by TMA
// (docs/notes/tma_store_epilogue.md). A partial tile (an expert's last rows) is stored by the epilogue warps.
//   EpiStoreTma            C = bf16((acc + bias[e]) * row_scale[r])     (EpiStore)
//   EpiActivationTma<A>    Z = bf16(acc + b1[e]) by TMA; A = act(Z) by the epilogue warps (EpiActivation)
// (bf16 written; the ...Of<E> / <A, E> forms round to the element type E, f16 as well.)
#pragma once

#include "cuda/gemm/tma_store_sm90.cuh"
#include "cuda/gemm/epilogue_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// `stage` of both policies: the accumulators into the swizzled staging tile (the layout tma_store_tile reads) through
// the base policy's per-value functor (bias, row scale), made by `value()` only where there is one to apply; without,
// a plain bf16 pack that loads nothing (the layer's case).
template <class Cfg, class E, class Acc, class Crd, class MakeValue>
__device__ __forceinline__ void stage_for_tma(bool plain, const Acc& acc, const Crd& crd, __nv_bfloat16* st,
                                              MakeValue&& value) {
  if (plain)
    stage_swizzled<Cfg>(acc, crd, st, PackPair<E>{});
  else
    stage_swizzled<Cfg>(acc, crd, st, value());
}

// ---- plain store -----------------------------------------------------------------------------------------
// E: the element type (Cfg::Element of the kernel, cutlass::bfloat16_t or cutlass::half_t).
template <class E>
struct EpiStoreTmaOf {
  using Base = EpiStoreOf<E>;
  struct Params {
    typename Base::Params store;  // c, bias, row_scale, n
    TmaOut out;              // over c [rows, n]
  };
  static Params make_params(__nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale, int n, int rows) {
    return {{c, bias, row_scale, n}, TmaOut::make(c, rows, n)};
  }
  template <class Cfg, class Acc, class Crd>
  __device__ static void stage(const Params& p, const EpiTile& et, const Acc& acc, const Crd& crd,
                               __nv_bfloat16* st) {
    const bool plain = p.store.bias == nullptr && p.store.row_scale == nullptr;
    stage_for_tma<Cfg, E>(plain, acc, crd, st, [&] { return Base::value(p.store, et); });
  }
  template <class Cfg, class Ready>
  __device__ static void emit(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int lane,
                              Ready&& ready) {
    ready();
    if (et.t.rows == Cfg::BM) {
      if (warp == 0 && lane == 0) {
        tma_store_tile<Cfg>(p.out, et.t.row0, et.col0, st);
        cute::tma_store_wait<0>();  // read out of shared memory: the buffer may be handed back
      }
      __syncwarp();
      return;
    }
    using RL = RowLanes<Cfg>;
    const int cl = RL::col_lane(lane);
    const int gcol = et.col0 + 8 * cl;
    if (gcol >= p.store.n) return;
#pragma unroll 4
    for (int m = warp * RL::kRows + RL::row_lane(lane); m < et.t.rows; m += Cfg::kEpilogueWarps * RL::kRows)
      *reinterpret_cast<uint4*>(p.store.c + static_cast<std::int64_t>(et.t.row0 + m) * p.store.n + gcol) =
          swizzled8(st, m, cl);
  }
};
using EpiStoreTma = EpiStoreTmaOf<cutlass::bfloat16_t>;

// ---- up-projection: Z by TMA, A = act(Z) by the epilogue warps ----------------------------------------------
template <Activation A, class E = cutlass::bfloat16_t>
struct EpiActivationTma {
  using Base = EpiActivation<A, E>;
  struct Params {
    typename Base::Params act;  // z, a, bias, n
    TmaOut out;                 // over z [rows, n]
  };
  // bias_part > 0: b1 in two parts (EpiActivation::Params::bias_part, bias_expert).
  static Params make_params(__nv_bfloat16* z, __nv_bfloat16* a, const __nv_bfloat16* bias, int n, int rows,
                            std::int64_t bias_part = 0, std::int64_t bias_expert = 0) {
    return {{z, a, bias, n, bias_part, bias_expert}, TmaOut::make(z, rows, n)};
  }
  template <class Cfg, class Acc, class Crd>
  __device__ static void stage(const Params& p, const EpiTile& et, const Acc& acc, const Crd& crd,
                               __nv_bfloat16* st) {
    stage_for_tma<Cfg, E>(p.act.bias == nullptr, acc, crd, st, [&] { return Base::value(p.act, et); });
  }
  template <class Cfg, class Ready>
  __device__ static void emit(const Params& p, const EpiTile& et, const __nv_bfloat16* st, int warp, int lane,
                              Ready&& ready) {
    ready();
    const bool full = et.t.rows == Cfg::BM;
    const bool issuer = full && warp == 0 && lane == 0;
    if (issuer) tma_store_tile<Cfg>(p.out, et.t.row0, et.col0, st);  // Z leaves while the warps compute A from the same buffer
    using RL = RowLanes<Cfg>;
    const int cl = RL::col_lane(lane);
    const int gcol = et.col0 + 8 * cl;
    if (gcol < p.act.n) {
#pragma unroll 2
      for (int m = warp * RL::kRows + RL::row_lane(lane); m < et.t.rows; m += Cfg::kEpilogueWarps * RL::kRows) {
        const std::int64_t r = et.t.row0 + m;
        const uint4 zv = swizzled8(st, m, cl);
        if (!full) *reinterpret_cast<uint4*>(p.act.z + r * p.act.n + gcol) = zv;
        Base::store_a(p.act, r, gcol, zv);
      }
    }
    if (issuer) cute::tma_store_wait<0>();
    __syncwarp();
  }
};

}  // namespace sonicmoe::cuda::gemm::sm90

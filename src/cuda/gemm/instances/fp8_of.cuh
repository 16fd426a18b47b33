// The FP8 varlen-M launches for one epilogue family (included by the instances/fp8_*.cu files, one kernel family per
// file): the FP8 arguments as the kernel's NativeVarlenM (codes in its a / b, read back as e4m3) plus the block scales.
#pragma once

#include "cuda/gemm/epilogue_fp8_dgated_sm90.cuh"
#include "cuda/gemm/epilogue_fp8_z_sm90.cuh"
#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/fp8_instances.h"
#include "cuda/gemm/instances/activation_dispatch.h"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"

namespace sonicmoe::cuda::gemm::detail {

// The tile-order rules these launches get (heuristics.h, RasterRule).
static_assert(sm90::varlen_m_raster_rule<sm90::VarlenMFp8GatherCfg, sm90::EpiDgatedFp8<Activation::swiglu>>() ==
              RasterRule::fp8_gathered_dgated);
static_assert(sm90::varlen_m_raster_rule<sm90::VarlenMFp8GatherCfg, sm90::EpiActivationFp8Z<Activation::swiglu>>() ==
              RasterRule::fp8_gathered);
static_assert(sm90::varlen_m_raster_rule<sm90::VarlenMFp8ContiguousWideCfg, sm90::EpiStoreTma>() ==
              RasterRule::by_mean_rows);
static_assert(sm90::varlen_m_raster_rule<sm90::VarlenMFp8ContiguousWideCfg,
                                         sm90::EpiActivationFp8Z<Activation::swiglu>>() == RasterRule::by_mean_rows);

inline NativeVarlenM fp8_as_native(const Fp8VarlenM& g) {
  NativeVarlenM n;
  n.a = reinterpret_cast<const __nv_bfloat16*>(g.a);  // launch_varlen_m reads it back as Cfg::Element (e4m3)
  n.a_rows = g.a_rows;
  n.gather = g.gather;
  n.b = reinterpret_cast<const __nv_bfloat16*>(g.b);
  n.b_kn = false;
  n.offsets = g.offsets;
  n.rows = g.rows;
  n.num_experts = g.num_experts;
  n.n = g.n;
  n.k = g.k;
  n.stream = g.stream;
  return n;
}

template <class Cfg>
void fp8_store_of(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale) {
  using namespace sm90;
  const auto ep = EpiStoreTma::make_params(c, bias, row_scale, g.n, static_cast<int>(g.rows));
  launch_varlen_m<Cfg, EpiStoreTma>(fp8_as_native(g), ep, Fp8BlockScales{g.a_scale, g.b_scale});
}

// Cfg: VarlenMFp8GatherCfg (X's rows gathered, BN 128) or VarlenMFp8ContiguousWideCfg (rows already in the
// routing's order, BN 256).
template <class Family, class Cfg>
void fp8_activation_of(const char* fn, const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias,
                       const Fp8ZOut& z, __nv_bfloat16* a_out) {
  using namespace sm90;
  const int rows = static_cast<int>(g.rows);
  with_activation<Family>(fn, act, [&](auto a) {
    using Epi = EpiActivationFp8Z<decltype(a)::value>;
    typename Epi::Params ep = Epi::make_params(z.z, z.q, z.scale, a_out, bias, g.n, rows);
    ep.consumer_rows = fp8_z_consumer_rows(g.k, /*wide=*/Cfg::BN == 256);
    launch_varlen_m<Cfg, Epi>(fp8_as_native(g), ep, Fp8BlockScales{g.a_scale, g.b_scale});
  });
}

template <class Family>
void fp8_dgated_of(const char* fn, const Fp8VarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                   const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  using namespace sm90;
  with_activation<Family>(fn, act, [&](auto a) {
    using Epi = EpiDgatedFp8<decltype(a)::value>;
    typename Epi::Params ep{z.q, z.scale, pair_score, pair, dz.z, dz.q, dz.scale, as, ds_partial, g.rows, g.n};
    ep.consumer_rows = fp8_dgated_consumer_rows(g.k);
    launch_varlen_m<VarlenMFp8GatherCfg, Epi>(fp8_as_native(g), ep, Fp8BlockScales{g.a_scale, g.b_scale});
  });
}

// dgated on bf16 operands (the native kernel layout Cfg of native_varlen_m_dgated: dO rows gathered, W2 [E, H, I]
// read as [E, k, n]) with the FP8 epilogue: Z read as codes, dZ out in bf16 and 1x128 codes; the consumer warps'
// share of its rows by heuristics.h (bf16_dgated_fp8z_consumer_rows).
template <class Cfg, class Family>
void bf16_dgated_fp8z_of(const char* fn, const NativeVarlenM& g, Activation act, const Fp8ZIn& z,
                         const float* pair_score, const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as,
                         float* ds_partial) {
  using namespace sm90;
  with_activation<Family>(fn, act, [&](auto a) {
    using Epi = EpiDgatedFp8<decltype(a)::value>;
    typename Epi::Params ep{z.q, z.scale, pair_score, pair, dz.z, dz.q, dz.scale, as, ds_partial, g.rows, g.n};
    ep.consumer_rows = bf16_dgated_fp8z_consumer_rows(g.k);
    launch_varlen_m<Cfg, Epi>(g, ep);
  });
}

// The layout by K, as native_varlen_m_dgated picks it (heuristics.h, dgated_mma_gather).
template <class Family>
void bf16_dgated_fp8z_family(const char* fn, const NativeVarlenM& g, Activation act, const Fp8ZIn& z,
                             const float* pair_score, const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as,
                             float* ds_partial) {
  using El = cutlass::bfloat16_t;
  if (dgated_mma_gather(g.k))
    bf16_dgated_fp8z_of<sm90::VarlenMMmaGatherBknCfgOf<El>, Family>(fn, g, act, z, pair_score, pair, dz, as,
                                                                    ds_partial);
  else
    bf16_dgated_fp8z_of<sm90::VarlenMWideGatherBknCfgOf<El>, Family>(fn, g, act, z, pair_score, pair, dz, as,
                                                                     ds_partial);
}

}  // namespace sonicmoe::cuda::gemm::detail

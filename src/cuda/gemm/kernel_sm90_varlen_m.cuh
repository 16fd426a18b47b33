// The native varlen-M GEMM kernel = scheduler + mainloop (mainloop_sm90_varlen_m.cuh) + an epilogue policy
// (epilogue_sm90.cuh), and its host-side launcher. Persistent: one CTA per SM (its shared memory allows no
// more). Warpgroups 1-2: consumers (cooperative wgmma, 128 x 256 tile); with kMmaGather they also gather their
// own rows of A (MmaGatherLoader). Warpgroup 0: the producer warp (TMA) and three epilogue warps; in the
// four-warpgroup layout (VarlenMConfig::kWide) warpgroup 0 gathers and warpgroup 3 is the epilogue
// (mainloop_sm90_varlen_m.cuh).
// At the end of a tile's K loop the consumers apply the policy's register part (`stage`: bias, row scale,
// rounding to bf16) into the shared staging tile and start the next tile at once; the epilogue warpgroup
// then do the memory-bound part (`emit`: activation, dgated, the global stores) under that next K loop. A policy
// with kConsumerEmit (the FP8 dgated and Z-quantising ones) has the consumers emit a share of the rows they staged
// before that next K loop.
// Included only by instantiation .cu files.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include <type_traits>

#include "core/cuda_check.h"
#include "cuda/gemm/epilogue_sm90.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_m.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_m_fp8.cuh"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gemm/tma_encode.h"

namespace sonicmoe::cuda::gemm::sm90 {

template <class Cfg, class Epi>
struct VarlenMKernelParams {
  VarlenMMainloopParams<Cfg> main;
  typename Epi::Params epi;
  const std::int32_t* offsets;
  int capacity;  // rows of C (and of the gather index)
  int n_tiles;
  bool raster_n;
};

// Registers of the wide layout's epilogue warpgroup: Epi::kEpilogueRegs where the policy declares it (EpiDgated:
// its Z ring spilled at 80), else 0: half of what the MMA warpgroups leave. The gathering warpgroup gets the rest.
template <class Epi, class = void>
struct EpilogueRegs {
  static constexpr int value = 0;
};
template <class Epi>
struct EpilogueRegs<Epi, std::void_t<decltype(Epi::kEpilogueRegs)>> {
  static constexpr int value = Epi::kEpilogueRegs;
};

// Whether the consumer warps run part of the policy's epilogue (Epi::kConsumerEmit: its consumer_rows, emit_rows).
template <class Epi, class = void>
struct ConsumerEmitFlag : std::false_type {};
template <class Epi>
struct ConsumerEmitFlag<Epi, std::void_t<decltype(Epi::kConsumerEmit)>> : std::bool_constant<Epi::kConsumerEmit> {};

// Consumer warp cw's share of a tile (ConsumerRowSplit): the first consumer_rows of the 16 rows it staged, by the
// policy's emit_rows as one warp with nothing to wait for (it wrote those rows itself).
template <class Cfg, class Epi>
__device__ __forceinline__ void emit_consumer_share(const typename Epi::Params& p, const EpiTile& et,
                                                    const __nv_bfloat16* st, int cw, int lane) {
  const ConsumerRowSplit sp{p.consumer_rows};
  const int count = sp.consumer_count(cw, et.t.rows), r0 = sp.consumer_first(cw);
  if (count > 0) Epi::template emit_rows<Cfg>(p, et, st, 0, 1, lane, count, [=](int v) { return r0 + v; }, [] {});
}

template <class Cfg, class Epi>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    varlen_m_kernel(const __grid_constant__ VarlenMKernelParams<Cfg, Epi> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  extern __shared__ char smem_raw[];
  // 1024-byte alignment for the 128-byte swizzle atoms (the launch asks for the slack).
  char* base = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  auto& s = *reinterpret_cast<VarlenMSmem<Cfg>*>(base);
  int* s_off = reinterpret_cast<int*>(base + sizeof(VarlenMSmem<Cfg>));
  int* s_prefix = s_off + p.main.num_experts + 1;

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::Stages; ++i) {
      Barrier::init(&s.full[i], 1 + Cfg::kGatherThreads);
      Barrier::init(&s.empty[i], Cfg::kConsumerWarps);
    }
    Barrier::init(&s.epi_full, Cfg::kConsumerWarps);
    Barrier::init(&s.epi_empty, Cfg::kEpilogueWarps);
    cutlass::arch::fence_barrier_init();
    prefetch_tma_descriptor(p.main.tma_b.get_tma_descriptor());
    if constexpr (!Cfg::kGatherA) prefetch_tma_descriptor(p.main.tma_a.get_tma_descriptor());
  }
  VarlenMScheduler<Cfg::BM>::build(p.offsets, p.main.num_experts, p.n_tiles, p.capacity, s_off, s_prefix);
  const VarlenMScheduler<Cfg::BM> sched{s_off, s_prefix, p.main.num_experts, p.n_tiles, p.raster_n};
  __nv_bfloat16* stage_tile = reinterpret_cast<__nv_bfloat16*>(s.d);
  const bool lane0 = (threadIdx.x & 31) == 0;

  const int wg = warp_uniform(threadIdx.x / 128);
  const int warp = warp_uniform(threadIdx.x / 32), lane = threadIdx.x & 31;
  // Epilogue warp `ewarp` (0 .. kEpilogueWarps - 1): every tile of this CTA, in the consumers' order.
  auto epilogue = [&](int ewarp) {
    std::uint32_t phase = 0;
    for (int t = blockIdx.x; t < sched.total(); t += gridDim.x) {
      const VarlenTile tile = sched.at(t);
      const EpiTile et{tile, tile.n_tile * Cfg::BN};
      // emit may start its loads before the staging tile is full; it calls `ready` before reading it.
      Epi::template emit<Cfg>(p.epi, et, stage_tile, ewarp, lane, [&] { Barrier::wait(&s.epi_full, phase); });
      phase ^= 1u;
      __syncwarp();
      if (lane0) Barrier::arrive(&s.epi_empty);
    }
  };
  // One if/else on the role (ptxas applies setmaxnreg only so); inside it, a policy that asks for its own
  // epilogue registers gets one branch per budget, which ptxas allocates within the setmaxnreg that starts it.
  constexpr int kEpiRegs = EpilogueRegs<Epi>::value;  // 0: the even split
  // Three warpgroups (contiguous A, or kMmaGather): warpgroup 0 (producer + epilogue warps) gets the policy's
  // epilogue registers where it declares them, the MMA warpgroups the rest.
  constexpr int kLightRegs = Cfg::kWide ? Cfg::kWideLightRegs / 2 : (kEpiRegs != 0 ? kEpiRegs : Cfg::kLightRegs);
  constexpr int kConsumerRegs =
      !Cfg::kWide && kEpiRegs != 0 ? (512 - kEpiRegs) / 2 / 8 * 8 : Cfg::kConsumerRegs;
  static_assert(Cfg::kWide || kLightRegs + 2 * kConsumerRegs <= 504, "register split (512 hung on the H100)");
  if (wg == 0 || wg == 3) {
    if constexpr (Cfg::kWide && kEpiRegs != 0) {
      static_assert(kEpiRegs % 8 == 0 && kEpiRegs >= 24 && Cfg::kWideLightRegs - kEpiRegs >= 24, "setmaxnreg values");
      if (wg == 0) {  // four gathering warps
        cutlass::arch::warpgroup_reg_dealloc<Cfg::kWideLightRegs - kEpiRegs>();
        varlen_m_produce<Cfg>(p.main, s, sched);
      } else {  // the epilogue warpgroup
        cutlass::arch::warpgroup_reg_dealloc<kEpiRegs>();
        epilogue(warp - 12);
      }
    } else {
      cutlass::arch::warpgroup_reg_dealloc<kLightRegs>();
      if (warp < Cfg::kProducerWarps) varlen_m_produce<Cfg>(p.main, s, sched);
      else epilogue(warp < 4 ? warp - Cfg::kProducerWarps : warp - 12 + (4 - Cfg::kProducerWarps));  // warpgroup 0's rest, then 3
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    typename Cfg::TiledMma mma;
    Tensor tCrA = mma_fragment_a<Cfg>(mma, s, wg);
    Tensor tCrB = mma_fragment_b<Cfg>(mma, s, wg);
    Tensor acc = partition_fragment_C(mma, make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{}));  // (MMA, 1, 1 or 2)
    Tensor crd = mma.get_slice(threadIdx.x - 128)
                     .partition_C(make_identity_tensor(make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{})));
    const int k_tiles = (p.main.k + Cfg::BK - 1) / Cfg::BK;
    PipeState<Cfg::Stages> rd;
    std::uint32_t epi_phase = 1;  // the staging tile starts free
    auto run = [&](auto&& refill) {
      for (int t = blockIdx.x; t < sched.total(); t += gridDim.x) {
        const VarlenTile tile = sched.at(t);
        if constexpr (Cfg::kBlockScaled)  // FP8: per-k-block promotion with the block scales
          mma_k_loop_promoted<Cfg>(mma, acc, tCrA, tCrB, s, rd, k_tiles, lane0, refill, p.main, tile, crd);
        else
          mma_k_loop<Cfg>(mma, acc, tCrA, tCrB, s, rd, k_tiles, lane0, refill);
        Barrier::wait(&s.epi_empty, epi_phase);
        epi_phase ^= 1u;
        const EpiTile et{tile, tile.n_tile * Cfg::BN};
        Epi::template stage<Cfg>(p.epi, et, acc, crd, stage_tile);
        __syncwarp();
        if (lane0) Barrier::arrive(&s.epi_full);
        // A policy that lets the consumers take part of its epilogue (kConsumerEmit): this warp's share of the rows
        // it staged, while the epilogue warps take the rest.
        if constexpr (ConsumerEmitFlag<Epi>::value)
          if (p.epi.consumer_rows > 0) emit_consumer_share<Cfg, Epi>(p.epi, et, stage_tile, warp - 4, lane);
      }
    };
    if constexpr (Cfg::kMmaGather) {
      MmaGatherLoader<Cfg> loader(p.main, sched, s, threadIdx.x - 128);
#pragma unroll 1
      for (int i = 0; i < Cfg::Stages; ++i) loader.issue();  // the ring starts empty
      run([&] { loader.issue(); });
      cp_async_wait_all();
    } else {
      run(NoRefill{});
    }
  }
#endif
}

template <class Cfg>
constexpr std::size_t varlen_m_smem_bytes(int num_experts) {
  return sizeof(VarlenMSmem<Cfg>) + 1024 + 2 * sizeof(int) * (static_cast<std::size_t>(num_experts) + 1);
}

// Whether Cfg reads W1 in two parts (W1ConcatCfg: make_tma_b takes the strides); the FP8 configs have no such flag.
template <class Cfg, class = void>
struct W1PartsFlag : std::false_type {};
template <class Cfg>
struct W1PartsFlag<Cfg, std::void_t<decltype(Cfg::kW1Parts)>> : std::bool_constant<Cfg::kW1Parts> {};
template <class Cfg>
constexpr bool w1_parts_cfg() { return W1PartsFlag<Cfg>::value; }

// The tile-order rule of the kernel <Cfg, Epi> (heuristics.h): the FP8 gathered kernels have their own, and with
// the FP8 dgated epilogue (its kDgated) another.
template <class Epi, class = void>
struct DgatedEpiFlag : std::false_type {};
template <class Epi>
struct DgatedEpiFlag<Epi, std::void_t<decltype(Epi::kDgated)>> : std::bool_constant<Epi::kDgated> {};
template <class Cfg, class Epi>
constexpr RasterRule varlen_m_raster_rule() {
  if constexpr (Cfg::kBlockScaled && Cfg::kGatherA)
    return DgatedEpiFlag<Epi>::value ? RasterRule::fp8_gathered_dgated : RasterRule::fp8_gathered;
  else
    return RasterRule::by_mean_rows;
}

// Builds the TMA descriptors and launches on args.stream; no host synchronisation. FP8 configs (kBlockScaled): args.a
// and args.b point at e4m3 codes (read back as Cfg::Element), `scales` at their block scales.
template <class Cfg, class Epi>
void launch_varlen_m(const NativeVarlenM& args, const typename Epi::Params& epi,
                     const typename Cfg::BlockScales& scales = {}) {
  using El = typename Cfg::Element;
  VarlenMKernelParams<Cfg, Epi> p;
  tma::check_encoded("the varlen-M GEMM's output C [rows, n] (epilogue TMA store)");  // made with `epi`
  const El* a = reinterpret_cast<const El*>(args.a);
  p.main.tma_a = Cfg::make_tma_a(a, static_cast<int>(args.a_rows), args.k);
  tma::check_encoded("the varlen-M GEMM's A operand [a_rows, k]");
  if constexpr (w1_parts_cfg<Cfg>())  // W1 in two parts: its strides are runtime values (w1_layout_sm90.cuh)
    p.main.tma_b = Cfg::make_tma_b(reinterpret_cast<const El*>(args.b), args.n, args.k, args.num_experts,
                                   {args.b_w1_part_stride, args.b_w1_expert_stride});
  else
    p.main.tma_b = Cfg::make_tma_b(reinterpret_cast<const El*>(args.b), args.n, args.k, args.num_experts);
  tma::check_encoded("the varlen-M GEMM's B operand (weights [E, n, k] or [E, k, n])");
  p.main.a = a;
  p.main.gather = args.gather;
  p.main.a_rows = static_cast<int>(args.a_rows);
  p.main.k = args.k;
  p.main.n = args.n;
  p.main.num_experts = args.num_experts;
  p.main.scales = scales;
  p.epi = epi;
  p.offsets = args.offsets;
  p.capacity = static_cast<int>(args.rows);
  p.n_tiles = (args.n + Cfg::BN - 1) / Cfg::BN;
  p.raster_n = native_raster_n(args, varlen_m_raster_rule<Cfg, Epi>());

  static_assert(varlen_m_smem_bytes<Cfg>(kNativeMaxExperts) <= 232448, "shared memory beyond 227 KB");
  auto kernel = varlen_m_kernel<Cfg, Epi>;
  const std::size_t smem = varlen_m_smem_bytes<Cfg>(args.num_experts);
  // Per call (attributes are per device; the call is cheap and allowed during graph capture).
  SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<current_sm_count(), Cfg::kThreads, smem, args.stream>>>(p);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::cuda::gemm::sm90

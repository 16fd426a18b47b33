// The FP8 blockwise varlen-K GEMM on Hopper (fp8_gemm.h, Fp8VarlenK): the weight gradients of the FP8 layer with FP8
// operands (DESIGN.md section 9; docs/ALGORITHM.md, "FP8 blockwise recipe"). Per expert e,
//   D[e] (m x n) = sum over the expert's k-blocks kb of (A_q[:, kb] . B_q[:, kb]^T) * a_scale[kb, row] * b_scale[kb, col]
// with both operands K-major ([m, k_cap] and [n, k_cap] codes: the transposed copies of the token-major activations,
// each expert's rows padded to whole 128-column blocks by fp8_quantize_segment_cols) and one fp32 scale per
// (k-block, row) of A and per (k-block, column) of B ("1D x 1D" scaling: both 128x1 along the reduced token
// dimension). Hopper has no block-scaled MMA: each k-block's wgmma write a zeroed fp32 fragment that the consumer
// threads then promote, acc += tmp * a_scale[row] * b_scale[col].
// Persistent: one CTA per SM walks the work units (expert, M tile, N tile), expert-major. Warpgroup 0: one producer
// thread (TMA of both operand tiles and, by bulk copy, the k-block's 128 + 128 scales into the stage); warpgroups
// 1-2: cooperative wgmma (128 x 128 tile, 64 rows each, one 64x128x32 e4m3 atom per k-step), promotion with the
// scales read at 32-bit shared addresses, and the tile written out: bf16 through a swizzled staging tile and a TMA
// store that runs under the next tile's K loop (1.35-1.66x the consumers' own stores at readme-default and
// fine-grained-256, docs/notes/fp8_weight_grads.md), or fp32 read-add-write into a main_grad straight from registers
// (each element by one thread, deterministic). An expert without rows gets zeros (store) or nothing (accumulate).
#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/float8.h>

#include "core/cuda_check.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/mainloop_sm90_varlen_m_fp8.cuh"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gemm/pipeline_sm90.cuh"
#include "cuda/gemm/tile_scheduler_varlen_k.cuh"
#include "cuda/gemm/tma_encode.h"
#include "cuda/gemm/tma_store_sm90.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm {
namespace sm90 {
namespace {

struct Fp8VarlenKCfg {
  static constexpr int BM = 128, BN = 128, BK = 128;
  // 32 KB of codes + 1 KB of scales a stage: 5 stages beside the 32 KB staging tile in 227 KB.
  static constexpr int Stages = 5;
  static constexpr int kThreads = 384, kConsumerWarps = 8;
  // 64 accumulator + 64 promotion registers a consumer thread, plus the k-block's scales
  static constexpr int kLightRegs = 40, kConsumerRegs = 232;
  static_assert(kLightRegs + 2 * kConsumerRegs <= 504, "register split (512 hung on the H100)");
  static constexpr int kStageBytes = (BM + BN) * BK + (BM + BN) * 4;
  using Element = cutlass::float_e4m3_t;
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BM>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Element>{},
                                                   cute::make_shape(cute::Int<BN>{}, cute::Int<BK>{}, cute::Int<Stages>{})));
  using TiledMma = decltype(cute::make_tiled_mma(cute::SM90_64x128x32_F32E4M3E4M3_SS_TN<>{},
                                                 cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
};

// TMA of a K-major [rows, k_cap] operand (rows = m or n; BM = BN, so A's and B's boxes are alike)
auto make_tma(const Fp8VarlenKCfg::Element* p, int rows, std::int64_t k_cap) {
  static_assert(Fp8VarlenKCfg::BM == Fp8VarlenKCfg::BN, "one box shape for A and B");
  auto g = cute::make_tensor(cute::make_gmem_ptr(p), cute::make_shape(rows, k_cap), cute::make_stride(k_cap, cute::_1{}));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, Fp8VarlenKCfg::SmemLayoutA{}(cute::_, cute::_, 0));
}
using Fp8VarlenKTma = decltype(make_tma(nullptr, 128, 128));

struct Fp8VarlenKSmem {
  using Cfg = Fp8VarlenKCfg;
  alignas(1024) std::uint8_t a[Cfg::Stages * Cfg::BM * Cfg::BK];
  alignas(1024) std::uint8_t b[Cfg::Stages * Cfg::BN * Cfg::BK];
  alignas(1024) __nv_bfloat16 d[Cfg::BM * Cfg::BN];  // the bf16 output tile, as TmaStage boxes
  alignas(16) float sa[Cfg::Stages][Cfg::BM];
  alignas(16) float sb[Cfg::Stages][Cfg::BN];
  alignas(8) std::uint64_t full[Cfg::Stages];
  alignas(8) std::uint64_t empty[Cfg::Stages];
};

struct Fp8VarlenKParams {
  Fp8VarlenKTma tma_a, tma_b;
  const float* a_scale;  // [k_cap / 128, m]
  const float* b_scale;  // [k_cap / 128, n]
  const std::int32_t* offsets;  // [E + 1] in 128-column blocks (block_offsets), clamped to [0, rows]
  int rows;                     // k_cap / 128
  std::int64_t k_cap;
  int num_experts, m, n, m_tiles, n_tiles;
  __nv_bfloat16* d;
  float* d_f32;
  TmaOut out;  // d as [E * m, n], when d is given
};

// Work unit t: (expert, M tile, N tile) and the expert's k-blocks [kb0, kb0 + k_tiles), by the varlen-K scheduler's
// decoding (its "rows" are this kernel's 128-column blocks).
struct Unit {
  int expert, m_tile, n_tile, kb0, k_tiles;
};
__device__ __forceinline__ Unit decode(const Fp8VarlenKParams& p, int t) {
  const VarlenKUnit v = varlen_k_unit(p, t);
  return {v.expert, v.m_tile, v.n_tile, v.row_begin, v.row_end - v.row_begin};
}

__device__ __forceinline__ void produce(const Fp8VarlenKParams& p, Fp8VarlenKSmem& s, int units) {
  using namespace cute;
  using Cfg = Fp8VarlenKCfg;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<Cfg::Element*>(s.a)), Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<Cfg::Element*>(s.b)), Cfg::SmemLayoutB{});
  Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m, p.k_cap));
  Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n, p.k_cap));
  auto cta_a = p.tma_a.get_slice(0);
  auto cta_b = p.tma_b.get_slice(0);
  Tensor tAsA = cta_a.partition_D(sA);
  Tensor tBsB = cta_b.partition_D(sB);
  PipeState<Cfg::Stages> st;
  st.phase = 1;
  for (int t = blockIdx.x; t < units; t += gridDim.x) {
    const Unit u = decode(p, t);
    Tensor tAgA = cta_a.partition_S(local_tile(mA, make_shape(Int<Cfg::BM>{}, Int<Cfg::BK>{}), make_coord(u.m_tile, _)));
    Tensor tBgB = cta_b.partition_S(local_tile(mB, make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}), make_coord(u.n_tile, _)));
    for (int kt = 0; kt < u.k_tiles; ++kt) {
      const int kb = u.kb0 + kt;
      Barrier::wait(&s.empty[st.index], st.phase);
      TxBarrier::arrive_and_expect_tx(&s.full[st.index], Cfg::kStageBytes);
      copy(p.tma_a.with(s.full[st.index]), tAgA(_, _, _, kb), tAsA(_, _, _, st.index));
      copy(p.tma_b.with(s.full[st.index]), tBgB(_, _, _, kb), tBsB(_, _, _, st.index));
      SM90_BULK_COPY_G2S::copy(p.a_scale + static_cast<std::int64_t>(kb) * p.m + u.m_tile * Cfg::BM, &s.full[st.index],
                               s.sa[st.index], Cfg::BM * 4);
      SM90_BULK_COPY_G2S::copy(p.b_scale + static_cast<std::int64_t>(kb) * p.n + u.n_tile * Cfg::BN, &s.full[st.index],
                               s.sb[st.index], Cfg::BN * 4);
      st.advance();
    }
  }
}

// fp32 accumulation: adds this thread's values into d_f32, rows r0 + 8h, columns c0 + 8j + {0, 1} (the wgmma
// accumulator layout: value i = 4j + 2h + v, v the column within the pair); each element by one thread, so the sum
// is deterministic. An expert without rows adds nothing.
template <class Acc>
__device__ __forceinline__ void add_tile(const Fp8VarlenKParams& p, const Unit& u, const Acc& acc, int r0, int c0,
                                         bool zero) {
  if (zero) return;
  const std::int64_t base = static_cast<std::int64_t>(u.expert) * p.m * p.n;
  const int row0 = u.m_tile * Fp8VarlenKCfg::BM + r0, col0 = u.n_tile * Fp8VarlenKCfg::BN + c0;
#pragma unroll
  for (int j = 0; j < Fp8VarlenKCfg::BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2* dst = reinterpret_cast<float2*>(p.d_f32 + base + static_cast<std::int64_t>(row0 + 8 * h) * p.n + col0 + 8 * j);
      float2 cur = *dst;
      cur.x += acc(4 * j + 2 * h);
      cur.y += acc(4 * j + 2 * h + 1);
      *dst = cur;
    }
  }
}

// The consumers' named barrier around the staging tile (an id past CUTLASS's reserved ones).
constexpr int kStageBarrier = 0, kConsumerThreads = 256;

// The k-block's scales of this thread's two rows (r0, r0 + 8) and 32 columns (c0 + 8j + {0, 1}) in stage `st`, at
// 32-bit shared addresses (generic loads went through L1TEX's long scoreboard).
struct KBlockScales {
  float a0, a1;
  float2 b[Fp8VarlenKCfg::BN / 8];
  __device__ __forceinline__ void load(Fp8VarlenKSmem& s, int st, int r0, int c0) {
    const std::uint32_t sa = cute::cast_smem_ptr_to_uint(&s.sa[st][r0]);
    const std::uint32_t sb = cute::cast_smem_ptr_to_uint(&s.sb[st][c0]);
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(a0) : "r"(sa) : "memory");
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(a1) : "r"(sa + 32u) : "memory");
#pragma unroll
    for (int j = 0; j < Fp8VarlenKCfg::BN / 8; ++j)
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(b[j].x), "=f"(b[j].y) : "r"(sb + 32u * j) : "memory");
  }
};

// acc += tmp * a_scale[row] * b_scale[col], fenced so that the FFMA stay between the wgmma around them.
template <class Acc, class Tmp>
__device__ __forceinline__ void promote(Acc& acc, const Tmp& tmp, const KBlockScales& sc) {
  cute::warpgroup_fence_operand(acc);
#pragma unroll
  for (int j = 0; j < Fp8VarlenKCfg::BN / 8; ++j) {
    acc(4 * j) = fmaf(tmp(4 * j), sc.a0 * sc.b[j].x, acc(4 * j));
    acc(4 * j + 1) = fmaf(tmp(4 * j + 1), sc.a0 * sc.b[j].y, acc(4 * j + 1));
    acc(4 * j + 2) = fmaf(tmp(4 * j + 2), sc.a1 * sc.b[j].x, acc(4 * j + 2));
    acc(4 * j + 3) = fmaf(tmp(4 * j + 3), sc.a1 * sc.b[j].y, acc(4 * j + 3));
  }
  cute::warpgroup_fence_operand(acc);
}

__global__ void __launch_bounds__(Fp8VarlenKCfg::kThreads, 1) fp8_varlen_k_kernel(const __grid_constant__ Fp8VarlenKParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Cfg = Fp8VarlenKCfg;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  extern __shared__ char smem_raw[];
  char* base = reinterpret_cast<char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023));
  auto& s = *reinterpret_cast<Fp8VarlenKSmem*>(base);
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::Stages; ++i) {
      Barrier::init(&s.full[i], 1);
      Barrier::init(&s.empty[i], Cfg::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
    prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
  }
  __syncthreads();
  const int units = p.num_experts * p.m_tiles * p.n_tiles;
  const int wg = warp_uniform(threadIdx.x / 128);
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kLightRegs>();
    if (threadIdx.x == 0) produce(p, s, units);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    Cfg::TiledMma mma;
    auto wg_mma = mma.get_slice((wg - 1) * 128);
    Tensor tCrA = wg_mma.make_fragment_A(
        wg_mma.partition_A(make_tensor(make_smem_ptr(reinterpret_cast<Cfg::Element*>(s.a)), Cfg::SmemLayoutA{})));
    Tensor tCrB = wg_mma.make_fragment_B(
        wg_mma.partition_B(make_tensor(make_smem_ptr(reinterpret_cast<Cfg::Element*>(s.b)), Cfg::SmemLayoutB{})));
    Tensor acc = partition_fragment_C(mma, make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{}));  // ((2,2,16), 1, 1)
    Tensor tmp = make_fragment_like(acc(_, 0, 0));
    Tensor crd = mma.get_slice(threadIdx.x - 128).partition_C(make_identity_tensor(make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{})));
    const int r0 = get<0>(crd(0)), c0 = get<1>(crd(0));
#ifndef NDEBUG
#pragma unroll
    for (int i = 0; i < decltype(size(crd))::value; ++i)
      assert(get<0>(crd(i)) == r0 + 8 * ((i >> 1) & 1) && get<1>(crd(i)) == c0 + (i & 1) + 8 * (i >> 2));
#endif
    const bool release_lane = (threadIdx.x & 31) == 0;
    const bool issuer = threadIdx.x == 128;  // the TMA-store thread
    PipeState<Cfg::Stages> rd;
    for (int t = blockIdx.x; t < units; t += gridDim.x) {
      const Unit u = decode(p, t);
#pragma unroll
      for (int i = 0; i < decltype(size(acc))::value; ++i) acc(i) = 0.0f;
      // Each k-block's wgmma, then its promotion: a second fragment in flight under the promotion (k-block kt + 1
      // issued before kt is promoted) made ptxas serialise the wgmma (C7514), as in the FP8 varlen-M kernel.
#pragma unroll 1
      for (int kt = 0; kt < u.k_tiles; ++kt) {
        Barrier::wait(&s.full[rd.index], rd.phase);
        chunk_wgmma(mma, tCrA, tCrB, tmp, 0, rd.index);
        KBlockScales sc;  // read while the wgmma run
        sc.load(s, rd.index, r0, c0);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tmp);
        asm volatile("" ::: "memory");  // the scale loads stay before the release
        if (release_lane) Barrier::arrive(&s.empty[rd.index]);
        rd.advance();
        promote(acc, tmp, sc);
      }
      const bool zero = u.k_tiles == 0;
      if (p.d_f32 != nullptr) {
        add_tile(p, u, acc, r0, c0, zero);
        continue;
      }
      // bf16: the tile through the swizzled staging buffer, stored by TMA under the next tile's K loop. The buffer
      // is free once the previous tile's store has read it.
      if (issuer) tma_store_wait<0>();
      NamedBarrier::sync(kConsumerThreads, kStageBarrier);
      stage_swizzled<Cfg>(acc, crd, s.d, [zero](float v0, float v1, int, int) {
        const __nv_bfloat162 h = zero ? __floats2bfloat162_rn(0.0f, 0.0f) : __floats2bfloat162_rn(v0, v1);
        return *reinterpret_cast<const std::uint32_t*>(&h);
      });
      NamedBarrier::sync(kConsumerThreads, kStageBarrier);
      if (issuer) tma_store_tile<Cfg>(p.out, u.expert * p.m + u.m_tile * Cfg::BM, u.n_tile * Cfg::BN, s.d);
    }
    if (issuer) tma_store_wait<0>();  // shared memory stays until the last store has read it
  }
#endif
}

void launch(const Fp8VarlenKParams& p, long long units, cudaStream_t stream) {
  using Cfg = Fp8VarlenKCfg;
  constexpr std::size_t smem = sizeof(Fp8VarlenKSmem) + 1024;
  static_assert(smem <= 232448, "shared memory beyond 227 KB");
  auto kernel = fp8_varlen_k_kernel;
  SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int sms = current_sm_count();
  const int grid = static_cast<int>(units < sms ? units : sms);
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(p);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace sm90

void fp8_varlen_k(const Fp8VarlenK& g) {
  using Cfg = sm90::Fp8VarlenKCfg;
  SONICMOE_CHECK(g.m > 0 && g.m % Cfg::BM == 0 && g.n > 0 && g.n % Cfg::BN == 0, "fp8_varlen_k: m and n must be ",
                 "positive multiples of 128, got m = ", g.m, ", n = ", g.n);
  SONICMOE_CHECK(g.k_cap > 0 && g.k_cap % Cfg::BK == 0, "fp8_varlen_k: k_cap must be a positive multiple of 128, got ",
                 g.k_cap);
  SONICMOE_CHECK((g.d != nullptr) != (g.d_f32 != nullptr), "fp8_varlen_k: exactly one of d (bf16) and d_f32 (added into)");
  if (g.num_experts == 0) return;
  sm90::Fp8VarlenKParams p;
  using El = Cfg::Element;
  p.tma_a = sm90::make_tma(reinterpret_cast<const El*>(g.a), g.m, g.k_cap);
  tma::check_encoded("the FP8 varlen-K GEMM's A operand [m, k_cap]");
  p.tma_b = sm90::make_tma(reinterpret_cast<const El*>(g.b), g.n, g.k_cap);
  tma::check_encoded("the FP8 varlen-K GEMM's B operand [n, k_cap]");
  p.a_scale = g.a_scale;
  p.b_scale = g.b_scale;
  p.offsets = g.block_offsets;
  SONICMOE_CHECK(g.k_cap / Cfg::BK < (std::int64_t{1} << 31), "fp8_varlen_k: k_cap = ", g.k_cap, " is too large");
  p.rows = static_cast<int>(g.k_cap / Cfg::BK);
  p.k_cap = g.k_cap;
  p.num_experts = g.num_experts;
  p.m = g.m;
  p.n = g.n;
  p.m_tiles = g.m / Cfg::BM;
  p.n_tiles = g.n / Cfg::BN;
  p.d = g.d;
  p.d_f32 = g.d_f32;
  const long long units = static_cast<long long>(p.num_experts) * p.m_tiles * p.n_tiles;
  SONICMOE_CHECK(units < (1ll << 31), "fp8_varlen_k: ", units, " tiles exceed one launch");
  if (g.d != nullptr) {
    const long long rows = static_cast<long long>(g.num_experts) * g.m;
    SONICMOE_CHECK(rows < (1ll << 31), "fp8_varlen_k: E * m = ", rows, " rows exceed the output's TMA map");
    p.out = sm90::TmaOut::make(g.d, static_cast<int>(rows), g.n);
    tma::check_encoded("the FP8 varlen-K GEMM's output D [E * m, n]");
  }
  sm90::launch(p, units, g.stream);
}

}  // namespace sonicmoe::cuda::gemm

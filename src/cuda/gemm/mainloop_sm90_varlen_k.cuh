// Mainloop of the native varlen-K GEMM on Hopper (kernel_sm90_varlen_k.cuh; DESIGN.md section 5): the kernel
// variant's configuration (VarlenKConfig and its named aliases), its shared memory and kernel parameters, and the
// producer warps that fill the stage ring. The consumers' K loop is mma_k_loop (mainloop_sm90_varlen_m.cuh), shared
// with varlen-M; the tile store is epilogue_sm90_varlen_k.cuh; the work units are tile_scheduler_varlen_k.cuh.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/gemm/epilogue_sm90.cuh"
#include "cuda/gemm/mainloop_sm90_varlen_m.cuh"
#include "cuda/gemm/tile_scheduler_varlen_k.cuh"
#include "cuda/gemm/tma_reduce_sm90.cuh"
#include "cuda/gemm/tma_store_sm90.cuh"
#include "cuda/gemm/w1_layout_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// kTmaQ: Q (not gathered) by TMA instead of cp.async. Only with gathered P. Whichever operand comes by TMA, the
// k-tile running past a unit's last row comes by zero-filling cp.async on both sides (varlen_k_produce).
// kTransposeD: the kernel computes D^T (m x n per expert) and writes D [E, n, m]: the host swaps P and Q when only
// Q is gathered, so that the gathered operand is the 128-wide M side (half the cp.async per k-tile, half the
// gathered bytes) and the contiguous one comes by TMA. Its staging tile holds the tile's transpose
// (stage_transposed_swizzled, boxes of 256 D rows x 64 columns).
// kConcatD (VarlenKConcatDCfg): D = dW1 [E, 2I, H] written in the concatenated W1 layout (w1_layout_sm90.cuh), every
// tile by TMA (W1ConcatOut clips each expert's own rows).
// kAccumF32 (VarlenKAccumF32Cfg): D += the tile in fp32, into an f32 D in place (the gradient-accumulation fusion of
// an fp32 main_grad; epilogue_sm90_varlen_k.cuh): kAccumTma, by TMA reduce-add from the staging tile in two halves
// (tma_reduce_sm90.cuh; not with kConcatD), else by the consumers' own loads and stores (varlen_k_accumulate_tile).
// Element_: the 16-bit operand type, cutlass::bfloat16_t or cutlass::half_t (as VarlenMConfig).
template <bool kGatherP_, bool kTmaQ_ = false, bool kTransposeD_ = false, class Element_ = cutlass::bfloat16_t>
struct VarlenKConfig {
  static constexpr bool kGatherP = kGatherP_;
  static constexpr bool kTmaQ = kTmaQ_;
  static constexpr bool kTransposeD = kTransposeD_;
  static constexpr bool kConcatD = false;
  static constexpr bool kAccumF32 = false, kAccumTma = false;
  static_assert(!kTmaQ || kGatherP, "Q by TMA needs zero-filled (gathered) P rows past each expert");
  static constexpr int BM = 128, BN = 256, BK = 64;
  // The consumers write a full tile into a swizzled staging tile in shared memory and one thread stores it by TMA
  // while the next K loop runs; the staging tile takes the shared memory of a fourth stage. Storing straight from
  // registers (store_direct) took a third of the consumers' samples at 512 rows per expert (ncu, H100). A tile
  // whose D rows run past the expert's (m % 128, or n % 256 when transposed) keeps the register stores
  // (store_direct; store_transposed with its per-warp scratch in the staging tile).
  static constexpr int Stages = 3;
  static constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = 384;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kLightRegs = 56, kConsumerRegs = 224;
  static_assert(kLightRegs + 2 * kConsumerRegs <= 512, "register split");
  static constexpr int kStageBytesA = BM * BK * 2, kStageBytesB = BN * BK * 2;

  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>,
                "16-bit operands: bf16 or f16");
  using Atom = cute::GMMA::Layout_MN_SW128_Atom<Element>;
  using SmemLayoutA = decltype(cute::tile_to_shape(Atom{}, cute::make_shape(cute::Int<BM>{}, cute::Int<BK>{}, cute::Int<Stages>{}),
                                                   cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(Atom{}, cute::make_shape(cute::Int<BN>{}, cute::Int<BK>{}, cute::Int<Stages>{}),
                                                   cute::Step<cute::_2, cute::_1, cute::_3>{}));
  using MmaAtom = std::conditional_t<
      std::is_same_v<Element, cutlass::half_t>,
      cute::SM90_64x256x16_F32F16F16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::MN>,
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::MN, cute::GMMA::Major::MN>>;
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  // P [p_rows, m] row-major as the (m, rows) tensor A.
  static auto make_tma_p(const Element* p, int m, int p_rows) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(p), cute::make_shape(m, p_rows),
                               cute::make_stride(cute::_1{}, static_cast<std::int64_t>(m)));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutA{}(cute::_, cute::_, 0));
  }
  using TmaP = decltype(make_tma_p(nullptr, 8, 1));
  // Q [q_rows, n] row-major as the (n, rows) tensor B.
  static auto make_tma_q(const Element* q, int n, int q_rows) {
    auto g = cute::make_tensor(cute::make_gmem_ptr(q), cute::make_shape(n, q_rows),
                               cute::make_stride(cute::_1{}, static_cast<std::int64_t>(n)));
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutB{}(cute::_, cute::_, 0));
  }
  using TmaQ = decltype(make_tma_q(nullptr, 8, 1));
};

// The varlen-K variants by name (instances/, tests, tools name these, never a row of bools). P contiguous by TMA
// with Q gathered by cp.async; P gathered with Q by cp.async; P gathered with Q by TMA (kTmaQ); and the last with D
// computed transposed (kTransposeD: the host's swapped dW1).
// The ...Of<E> forms take the element type; the plain names are bf16.
template <class E>
using VarlenKContiguousPCfgOf = VarlenKConfig</*kGatherP=*/false, false, false, E>;
template <class E>
using VarlenKGatheredPCfgOf = VarlenKConfig</*kGatherP=*/true, false, false, E>;
template <class E>
using VarlenKGatheredPTmaQCfgOf = VarlenKConfig</*kGatherP=*/true, /*kTmaQ=*/true, false, E>;
template <class E>
using VarlenKGatheredPTmaQTransposedCfgOf = VarlenKConfig</*kGatherP=*/true, /*kTmaQ=*/true, /*kTransposeD=*/true, E>;
using VarlenKContiguousPCfg = VarlenKContiguousPCfgOf<cutlass::bfloat16_t>;
using VarlenKGatheredPCfg = VarlenKGatheredPCfgOf<cutlass::bfloat16_t>;
using VarlenKGatheredPTmaQCfg = VarlenKGatheredPTmaQCfgOf<cutlass::bfloat16_t>;
using VarlenKGatheredPTmaQTransposedCfg = VarlenKGatheredPTmaQTransposedCfgOf<cutlass::bfloat16_t>;
// The same kernel writing D = dW1 in the concatenated W1 layout (MoEConfig::w1_layout): the staged tile's interleaved
// D rows go to their concatenated rows by W1ConcatOut (D's rows are the tile's rows, or its columns when kTransposeD).
template <class Base>
struct VarlenKConcatDCfg : Base {
  static constexpr bool kConcatD = true;
};
// The same kernel adding its tiles into an f32 D (NativeVarlenK::d_f32) instead of storing 16-bit ones, by TMA
// reduce-add (kTma) or from the consumers' registers.
template <class Base, bool kTma = false>
struct VarlenKAccumF32Cfg : Base {
  static constexpr bool kAccumF32 = true, kAccumTma = kTma;
  static_assert(!(kTma && Base::kConcatD), "the reduce-add map is over the interleaved D");
};

template <class Cfg>
struct VarlenKSmem {
  alignas(1024) typename Cfg::Element a[Cfg::Stages * Cfg::BM * Cfg::BK];
  alignas(1024) typename Cfg::Element b[Cfg::Stages * Cfg::BN * Cfg::BK];
  // the output tile: TMA boxes in the 128-byte swizzle (tma_store_sm90.cuh), 128 x 64 (D) or 256 x 64 (D^T); also
  // the consumer warps' scratch of store_transposed
  alignas(1024) __nv_bfloat16 d[Cfg::BM * Cfg::BN];
  static_assert(Cfg::BM * Cfg::BN >= Cfg::kConsumerWarps * kTrScratchElems, "store_transposed scratch");
  alignas(8) std::uint64_t full[Cfg::Stages];
  alignas(8) std::uint64_t empty[Cfg::Stages];
};

template <class Cfg>
struct VarlenKKernelParams {
  typename Cfg::TmaP tma_p;
  typename Cfg::TmaQ tma_q;  // used when Cfg::kTmaQ
  const typename Cfg::Element* p;
  const std::int32_t* p_gather;
  int p_rows;
  const typename Cfg::Element* q;
  const std::int32_t* q_gather;  // null: identity
  int q_rows;
  const std::int32_t* offsets;
  int rows;  // capacity: offsets are clamped to [0, rows]
  int num_experts, m, n, m_tiles, n_tiles;
  __nv_bfloat16* d;  // [E, m, n], or [E, n, m] when Cfg::kTransposeD
  TmaOut out;                                     // over d as [E * m, n]
  TmaOutBoxes<Cfg::BN> out_t;                     // kTransposeD: over d as [E * n, m]
  struct NoConcatOut {};
  // kConcatD: over d = dW1 [E, 2I, H] concatenated, boxes of the staged D rows (BM, or BN when kTransposeD)
  std::conditional_t<Cfg::kConcatD, W1ConcatOut<Cfg::kTransposeD ? Cfg::BN : Cfg::BM>, NoConcatOut> out_c;
  // kAccumF32: the f32 D, in d's layout ([E, m, n], [E, n, m] when kTransposeD), and its reduce-add map (kAccumTma);
  // with kConcatD the two-part W1 layout's part and expert strides (elements), so D row r of expert e
  // starts at e * expert + (r % 2) * part + (r / 2) * (row length).
  float* d_f32;
  std::int64_t d_part_stride, d_expert_stride;
  TmaReduceF32 red;
};

// Producer warps (128 threads): per k-tile of 64 rows, Q (B tile, 64 rows x 256 columns) by cp.async (by TMA under
// kTmaQ), thread t moving 16-byte chunk t % 32 of rows t / 32 + 4i; P (A tile, 64 rows x 128 columns) by cp.async
// (chunk t % 16 of rows t / 16 + 8i) when gathered, else by TMA; the k-tile past a unit's last row by cp.async
// on both sides, rows past the unit zero-filled. Addresses follow the MN-major 128-byte-swizzle smem layout:
// 16-byte chunk c (8 elements along M/N) of row k sits at (c/8)*8192 + (k/8)*1024 + (k%8)*128 +
// ((c%8) ^ (k%8))*16 bytes of the stage (checked against CuTe by test_gemm_layouts).
template <class Cfg>
__device__ void varlen_k_produce(const VarlenKKernelParams<Cfg>& p, VarlenKSmem<Cfg>& s, int units) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  const int pt = threadIdx.x;  // 0..127
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Cfg::SmemLayoutA{});
  Tensor mP = p.tma_p.get_tma_tensor(make_shape(p.m, p.p_rows));
  auto cta_p = p.tma_p.get_slice(0);
  Tensor tAsA = cta_p.partition_D(sA);
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename Cfg::SmemLayoutB{});
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.n, p.q_rows));
  auto cta_q = p.tma_q.get_slice(0);
  Tensor tBsB = cta_q.partition_D(sB);

  const int cb = pt & 31, kb = pt >> 5;  // Q chunk and first row (rows kb + 4i)
  const int ca = pt & 15, ka = pt >> 4;  // P chunk and first row (rows ka + 8i, gathered P)
  const std::uint32_t a_smem = cast_smem_ptr_to_uint(s.a), b_smem = cast_smem_ptr_to_uint(s.b);
  // Q row k = kb + 4i: k % 8 = kb + 4 (i & 1), k / 8 = i / 2.  P row k = ka + 8i: k % 8 = ka, k / 8 = i.
  const std::uint32_t off_b_even = (cb / 8) * 8192 + kb * 128 + (((cb & 7) ^ kb) << 4);
  const std::uint32_t off_b_odd = (cb / 8) * 8192 + (kb + 4) * 128 + (((cb & 7) ^ (kb + 4)) << 4);
  const std::uint32_t off_a0 = (ca / 8) * 8192 + ka * 128 + (((ca & 7) ^ ka) << 4);
  auto off_b = [&](int i) { return (i >> 1) * 1024 + ((i & 1) ? off_b_odd : off_b_even); };
  auto off_a = [&](int i) { return i * 1024 + off_a0; };
  // Source-row indices: each warp touches 16 distinct rows of Q (and of P) per k-tile; lane l < 16 loads one of
  // them a k-tile ahead of its use, and the warp shares them by shuffles. The range check waits an iteration too: a
  // check right after the load made every producer warp wait out the load's latency each k-tile (ncu, dW2 at 512
  // rows per expert: the producers' largest stall).
  const int lane = pt & 31, warp = pt >> 5;
  auto q_index = [&](const VarlenKUnit& u, int kt) {  // row warp + 4 * lane
    const int r = u.row_begin + kt * BK + warp + 4 * lane;
    if (lane >= 16 || r >= u.row_end) return -1;
    return p.q_gather ? __ldg(p.q_gather + r) : r;  // checked against q_rows an iteration later
  };
  auto p_index = [&](const VarlenKUnit& u, int kt) {  // row 2 * warp + (lane & 1) + 8 * (lane >> 1)
    const int r = u.row_begin + kt * BK + 2 * warp + (lane & 1) + 8 * (lane >> 1);
    if (lane >= 16 || r >= u.row_end) return -1;
    return Cfg::kGatherP ? __ldg(p.p_gather + r) : r;  // checked against p_rows an iteration later
  };

  PipeState<Cfg::Stages> st;
  st.phase = 1;
  for (int t = blockIdx.x; t < units; t += gridDim.x) {
    const VarlenKUnit u = varlen_k_unit(p, t);
    const int k_tiles = (u.row_end - u.row_begin + BK - 1) / BK;
    const int n_col = u.n_tile * BN + 8 * cb, m_col = u.m_tile * BM + 8 * ca;
    const bool n_ok = n_col < p.n, m_ok = m_col < p.m;
    Tensor gA = local_tile(domain_offset(make_coord(0, u.row_begin), mP), make_shape(Int<BM>{}, Int<BK>{}),
                           make_coord(u.m_tile, _));
    Tensor tAgA = cta_p.partition_S(gA);
    Tensor gB = local_tile(domain_offset(make_coord(0, u.row_begin), mQ), make_shape(Int<BN>{}, Int<BK>{}),
                           make_coord(u.n_tile, _));
    Tensor tBgB = cta_q.partition_S(gB);
    int q_next = k_tiles > 0 ? q_index(u, 0) : -1;
    int p_next = k_tiles > 0 ? p_index(u, 0) : -1;
    for (int kt = 0; kt < k_tiles; ++kt) {
      // loaded an iteration ago: checked once per lane here, not per row after the shuffles
      const int q_cur = q_next < p.q_rows ? q_next : -1, p_cur = p_next < p.p_rows ? p_next : -1;
      if (kt + 1 < k_tiles) {
        q_next = q_index(u, kt + 1);
        p_next = p_index(u, kt + 1);
      }
      // The k-tile that runs past the unit's last row loads both operands by zero-filling cp.async (identity rows
      // for a contiguous one): a row past the unit meets zeros on both sides, never the memory past offsets[E]
      // that nobody wrote (rows a capacity dropped, DeepEP's unused pair rows), where NaN * 0 would be NaN.
      const bool tail = kt == k_tiles - 1 && (u.row_end - u.row_begin) % BK != 0;
      const bool p_tma = !Cfg::kGatherP && !tail, q_tma = Cfg::kTmaQ && !tail;
      Barrier::wait(&s.empty[st.index], st.phase);
      if (pt == 0) {
        const std::uint32_t tx = (p_tma ? Cfg::kStageBytesA : 0u) + (q_tma ? Cfg::kStageBytesB : 0u);
        TxBarrier::arrive_and_expect_tx(&s.full[st.index], tx);
        if (p_tma) copy(p.tma_p.with(s.full[st.index]), tAgA(_, _, _, kt), tAsA(_, _, _, st.index));
        if (q_tma) copy(p.tma_q.with(s.full[st.index]), tBgB(_, _, _, kt), tBsB(_, _, _, st.index));
      }
      if (!q_tma) {
        const std::uint32_t b_stage = b_smem + st.index * Cfg::kStageBytesB;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int g = __shfl_sync(0xffffffffu, q_cur, i);  // row kb + 4i of this k-tile
          const bool ok = n_ok && g >= 0;
          const typename Cfg::Element* src = p.q + (ok ? static_cast<std::int64_t>(g) * p.n + n_col : 0);
          cp_async_16_zfill(b_stage + off_b(i), src, ok ? 16 : 0);
        }
      }
      if (!p_tma) {
        const std::uint32_t a_stage = a_smem + st.index * Cfg::kStageBytesA;
        const int half = lane >> 4;  // this thread's row ka = 2 * warp + half
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int g = __shfl_sync(0xffffffffu, p_cur, 2 * i + half);  // row ka + 8i
          const bool ok = m_ok && g >= 0;
          const typename Cfg::Element* src = p.p + (ok ? static_cast<std::int64_t>(g) * p.m + m_col : 0);
          cp_async_16_zfill(a_stage + off_a(i), src, ok ? 16 : 0);
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[st.index]);
      st.advance();
    }
  }
  cp_async_wait_all();
}

}  // namespace sonicmoe::cuda::gemm::sm90

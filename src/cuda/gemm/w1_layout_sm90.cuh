// W1 in the concatenated gate/up layout ([gate_0 .. gate_{I-1}, up_0 .. up_{I-1}] rows per expert, Hugging Face /
// Megatron / the original's concat_layout=True) or as separate gate and up tensors (torchtitan's w1 / w3) read by TMA
// in the library's interleaved row order (gate_j at row 2j, up_j at row 2j + 1), with no copy: the row index
// n' = part + 2j of the interleaved order is a hierarchical mode (2, I) with strides (P, H), P the part stride: I*H
// into the concatenated tensor (expert stride 2*I*H), or up - gate (elements) for the separate pair (expert stride
// I*H; the memory between the two tensors is never touched). P and the expert stride are runtime values of one
// descriptor type (W1Strides), so both layouts run the same kernel instances. The TMA box over BN interleaved rows is
// then the 2-D box (2, BN/2) of that mode, so shared memory receives exactly the interleaved tile and every epilogue
// is unchanged (Z stays interleaved: internal to the layer). The descriptor has one mode more than the interleaved
// one (4 of the 5 TMA allows); the box's extents (2, BN/2 <= 128, BK) are within the 256 limit, and TMA's stride
// rule (multiples of 16 bytes below 2^40) is what the separate pair's addresses must satisfy
// (w1_separate_addresses_ok, sonicmoe/moe.h).
//
// The two GEMMs that read W1 (DESIGN.md steps 4 and 10a), S = the expert stride:
//   up-projection, B = W1 [E, n = 2I, k = H]:     (n', k, E) = ((2, I), H, E) : ((P, H), 1, S)
//   dXe (kBMN), B = W1 read as [E, k = 2I, n = H]: (n, k', E) = (H, (2, I), E) : (1, (P, H), S)
// The coordinates handed to the TMA copy must be hierarchical the same way (w1_concat_coord_shape).
//
// The weight gradient dW1 (step 9, varlen-K) is written in the same layout by the store twin of the up-projection's
// descriptor: D [E, 2I, H] as ((2, I), H, E), the staged tile's interleaved rows landing at their stored rows
// (W1ConcatOut, tma_store_boxes_w1_concat). Its per-expert mode bounds also clip the rows past the expert's 2I, so
// partial tiles go by TMA too (the interleaved D's flat [E * 2I, H] map cannot clip them: the next expert's rows).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/gemm/mainloop_sm90_varlen_m.cuh"
#include "cuda/gemm/tma_store_sm90.cuh"

namespace sonicmoe::cuda::gemm::sm90 {

// The part and expert strides (elements) of W1 in two parts; 0 stands for the concatenated layout's (I*H, 2*I*H).
struct W1Strides {
  std::int64_t part = 0, expert = 0;
};

// The (n, k, E) gmem layout of W1 [E, 2I, H] in two parts (strides st), in the interleaved order. kBMN: W1 read as
// the B of dXe (k = 2I, n = H).
template <bool kBMN>
auto w1_concat_gmem_layout(int n, int k, int num_experts, W1Strides st = {}) {
  using namespace cute;
  if constexpr (kBMN) {  // n = H, k = 2I
    const std::int64_t H = n, I = k / 2;
    const std::int64_t P = st.part ? st.part : I * H, S = st.expert ? st.expert : 2 * I * H;
    return make_layout(make_shape(n, make_shape(_2{}, static_cast<int>(I)), num_experts),
                       make_stride(_1{}, make_stride(P, H), S));
  } else {  // n = 2I, k = H
    const std::int64_t H = k, I = n / 2;
    const std::int64_t P = st.part ? st.part : I * H, S = st.expert ? st.expert : 2 * I * H;
    return make_layout(make_shape(make_shape(_2{}, static_cast<int>(I)), k, num_experts),
                       make_stride(make_stride(P, H), _1{}, S));
  }
}

// The coordinate shape of the TMA tensor (get_tma_tensor) that matches w1_concat_gmem_layout.
template <bool kBMN>
CUTE_HOST_DEVICE auto w1_concat_coord_shape(int n, int k, int num_experts) {
  using namespace cute;
  if constexpr (kBMN)
    return make_shape(n, make_shape(_2{}, k / 2), num_experts);
  else
    return make_shape(make_shape(_2{}, n / 2), k, num_experts);
}

// The TMA load of W1 in two parts (strides st; concatenated by default), for a shared-memory tile layout SmemLayoutB
// (one stage, (BN, BK)).
template <bool kBMN, class SmemLayoutB, class Element>
auto make_tma_w1_concat(const Element* w1, int n, int k, int num_experts, W1Strides st = {}) {
  auto g = cute::make_tensor(cute::make_gmem_ptr(w1), w1_concat_gmem_layout<kBMN>(n, k, num_experts, st));
  return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, g, SmemLayoutB{}(cute::_, cute::_, 0));
}

// A varlen-M configuration Base (VarlenMConfig) whose B operand is W1 in two parts (concatenated or separate, by the
// runtime strides: NativeVarlenM::b_w1_part_stride / b_w1_expert_stride): the same kernel, smem layout and epilogues,
// only B's descriptor and coordinates differ (B = W1 [E, 2I, H] for the up-projection; with Base::kBMN, W1 read as
// [E, k = 2I, n = H] for dXe).
template <class Base>
struct W1ConcatCfg : Base {
  using Element = typename Base::Element;
  static constexpr bool kW1Parts = true;  // launch_varlen_m passes the strides
  static auto make_tma_b(const Element* b, int n, int k, int num_experts, W1Strides st = {}) {
    return make_tma_w1_concat<Base::kBMN, typename Base::SmemLayoutB>(b, n, k, num_experts, st);
  }
  CUTE_HOST_DEVICE static auto b_coord_shape(int n, int k, int num_experts) {
    return w1_concat_coord_shape<Base::kBMN>(n, k, num_experts);
  }
  using TmaB = decltype(make_tma_b(nullptr, 8, 8, 1));
};

// ---- dW1 stored in two parts (varlen-K, step 9) --------------------------------------------------------------------

// TMA store into D = dW1 [E, zw = 2I, h = H] stored in two parts (strides st; concatenated by default), in boxes of
// BoxRows interleaved rows x 64 columns (SwizzledStage<BoxRows>::BoxLayout, the staging layout of the varlen-K
// epilogue).
template <int BoxRows>
inline auto make_tma_store_w1_concat(const cutlass::bfloat16_t* d, int zw, int h, int num_experts,
                                     W1Strides st = {}) {
  auto g = cute::make_tensor(cute::make_gmem_ptr(d), w1_concat_gmem_layout<false>(zw, h, num_experts, st));
  return cute::make_tma_copy(cute::SM90_TMA_STORE{}, g, typename SwizzledStage<BoxRows>::BoxLayout{});
}

template <int BoxRows>
struct W1ConcatOut {
  static constexpr int kBoxRows = BoxRows;
  decltype(make_tma_store_w1_concat<BoxRows>(nullptr, 2, 8, 1)) tma;
  int zw = 0, h = 0, num_experts = 0;
  static W1ConcatOut make(__nv_bfloat16* d, int zw, int h, int num_experts, W1Strides st = {}) {
    return {make_tma_store_w1_concat<BoxRows>(reinterpret_cast<const cutlass::bfloat16_t*>(d), zw, h, num_experts, st),
            zw, h, num_experts};
  }
};

// One thread: the staged tile of interleaved D rows row0 .. row0 + BoxRows - 1 (row0 a multiple of BoxRows) and
// columns col0 .. col0 + Cols - 1 (col0 a multiple of 64) of expert e, as Cols / 64 boxes, committed as one bulk
// group (wait with cute::tma_store_wait). Rows past 2I and columns past H are clipped by the tensor map.
template <int Cols, int BoxRows>
__device__ __forceinline__ void tma_store_boxes_w1_concat(const W1ConcatOut<BoxRows>& out, int e, int row0, int col0,
                                                          const __nv_bfloat16* st) {
  using namespace cute;
  constexpr int BC = SwizzledStage<BoxRows>::kBoxCols;
  static_assert(Cols % BC == 0, "whole boxes");
  Tensor mD = out.tma.get_tma_tensor(w1_concat_coord_shape<false>(out.zw, out.h, out.num_experts));
  auto cta = out.tma.get_slice(0);
#pragma unroll
  for (int b = 0; b < Cols / BC; ++b) {
    const int c0 = col0 + b * BC;
    if (c0 >= out.h) break;
    Tensor gD = local_tile(mD(_, _, e), make_shape(Int<BoxRows>{}, Int<BC>{}), make_coord(row0 / BoxRows, c0 / BC));
    Tensor sD = make_tensor(make_smem_ptr(reinterpret_cast<const cutlass::bfloat16_t*>(st) + b * BoxRows * BC),
                            typename SwizzledStage<BoxRows>::BoxLayout{});
    copy(out.tma, cta.partition_S(sD), cta.partition_D(gD));
  }
  tma_store_arrive();
}

}  // namespace sonicmoe::cuda::gemm::sm90

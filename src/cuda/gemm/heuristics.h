// Every tuning decision of the native GEMM kernels, one small function each with its reason in a line; the
// measurements are in docs/notes/ (cited by name). Host code only; called where the kernel is picked
// (native_gemm.cu). Capacity limits (kNativeMaxExperts) are not tuning and live with the kernels.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace sonicmoe::cuda::gemm {

// Whether environment variable `name` leaves an FP8 output to the epilogue of the GEMM that makes it (the default), or
// asks (=pass) for the 1x128 quantiser after that GEMM (a tuning override, read at every call).
inline bool quantised_in_epilogue(const char* name) {
  const char* v = std::getenv(name);
  return !(v != nullptr && std::strcmp(v, "pass") == 0);
}

// The FP8 layer's saved Z (src/cuda/fp8/fp8_layer.cu): quantised in the up-projection's epilogue (EpiActivationFp8Z),
// never written in bf16. SONICMOE_FP8_Z=pass quantises a bf16 Z after the GEMM instead, =epilogue (the default)
// forces this (read at every call; moe_memory_estimate follows it). Below K 3072 the epilogue warps alone made that
// GEMM slower than GEMM + pass; with the consumer warps' share (fp8_z_consumer_rows) it runs as fast and the forward
// peak drops by the bf16 Z (docs/notes/fp8_dgated_epilogue.md).
inline bool fp8_z_in_epilogue() { return quantised_in_epilogue("SONICMOE_FP8_Z"); }

// The FP8 up-projection's operand X (src/cuda/fp8/fp8_layer.cu): quantised 1x128 straight into the routing's row
// order ([N, H] codes, fp8_quantize_rows_scatter: X read once, each token's codes written to its K rows) for the
// contiguous kernel's 128 x 256 tile, or once per token ([T, H]) for the gathering kernel's 128 x 128 tile. The wide
// tile reads each A row once per 256 columns instead of 128 (the gathering kernel is bound by L2 throughput at 128 and
// loses at 256: docs/notes/fp8_consumer_registers.md); the scatter writes N x H bytes more, which a narrow GEMM (n =
// z_width) does not repay. In place from n = 1024. Forward with pre-quantised weights, gathered vs in place, H200
// (sonicmoe-bench --precision fp8, one call, docs/notes/fp8_up_in_place.md), ms: readme-default 9.05 / 8.27,
// coarse-8x8 2.36 / 2.07, olmoe-like 4.90 / 4.36, fine-grained-256 4.62 / 4.35, small-k2 0.375 / 0.346 (n 2048-3072);
// mid-128x8 1.352 / 1.332 (n 1024); sparse-16of256 1.659 / 1.757 (n 512). SONICMOE_FP8_UP=gathered|in_place forces
// one (read at every call; moe_memory_estimate follows it).
inline constexpr std::int64_t kFp8UpInPlaceMinN = 1024;
inline bool fp8_up_in_place(std::int64_t n) {
  const char* v = std::getenv("SONICMOE_FP8_UP");
  if (v != nullptr && std::strcmp(v, "gathered") == 0) return false;
  if (v != nullptr && std::strcmp(v, "in_place") == 0) return true;
  return n >= kFp8UpInPlaceMinN;
}

// dXe's operand dZ (src/cuda/fp8/fp8_layer.cu): quantised 1x128 in the dgated GEMM's epilogue beside its bf16 dZ
// (EpiDgatedFp8), or with SONICMOE_FP8_DZ=pass by the 1x128 quantiser reading that bf16 dZ after the GEMM (read at
// every call; the same codes and buffers either way). The epilogue measured as fast or faster on five configs
// (docs/notes/fp8_dgated_epilogue.md).
inline bool fp8_dz_in_epilogue() { return quantised_in_epilogue("SONICMOE_FP8_DZ"); }

// K (= H) from which the FP8 gathered kernels' K loop is long enough to hide their epilogue warps' work better.
inline constexpr std::int64_t kFp8LongK = 3072;

// Tile order inside an expert, by the experts' mean row count (host-known: capacity / E, no device read).
inline constexpr std::int64_t kNativeRasterMRows = 3072;
// N-tile major below kNativeRasterMRows mean rows an expert (a wave's CTAs share each panel of B[e] while they sweep
// the expert's rows), M-tile major from there (a wave holds a few row panels and all of B[e]): docs/notes/tile_order.md.
constexpr bool mean_rows_below(std::int64_t rows, int num_experts, std::int64_t threshold) {
  return num_experts > 0 && rows / num_experts < threshold;
}
constexpr bool raster_n_by_mean_rows(std::int64_t rows, int num_experts) {
  return mean_rows_below(rows, num_experts, kNativeRasterMRows);
}

// Which tile-order rule a varlen-M kernel follows (picked at compile time from its config and epilogue).
enum class RasterRule {
  by_mean_rows,         // raster_n_by_mean_rows: the bf16 / f16 kernels and the FP8 contiguous-A ones
  fp8_gathered,         // FP8, A rows gathered (the up-projection): N-tile major below kFp8GatherRasterMRows
  fp8_gathered_dgated,  // FP8, A rows gathered, dgated epilogue: M-tile major always
};
// The FP8 gathered kernels' tile is 128 wide (twice the bf16 kernel's N tiles over the same gathered rows): M-tile
// major pays earlier. Per kernel, ncu, H100 (docs/notes/tile_order.md): dgated 11% faster M-tile major at 2048 mean
// rows, 21% at 512, never slower; the up-projection 4% at 2048, within 1% at 512 but for small-k2 (N-tile major 2.5%
// faster there), hence its threshold.
inline constexpr std::int64_t kFp8GatherRasterMRows = 1024;
constexpr bool raster_n_of(RasterRule rule, std::int64_t rows, int num_experts) {
  switch (rule) {
    case RasterRule::fp8_gathered_dgated: return false;
    case RasterRule::fp8_gathered: return mean_rows_below(rows, num_experts, kFp8GatherRasterMRows);
    case RasterRule::by_mean_rows: break;
  }
  return raster_n_by_mean_rows(rows, num_experts);
}

// A consumer-row share forced by environment variable `name` (a tuning override: an even 0 .. 16), else `rule`.
inline int consumer_rows_or(const char* name, int rule) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return rule;
  const int c = std::atoi(v);
  return c < 0 ? 0 : c > 16 ? 16 : c & ~1;
}

// The FP8 dgated kernel (EpiDgatedFp8): rows of each consumer warp's 16 that the consumer emits itself after staging
// (EpiDgatedFp8::Params::consumer_rows), the three epilogue warps the rest. Alone, those warps (dgated, Z's
// dequantisation, dZ's 1x128 quantisation) set the kernel's pace at every K; sharing the rows, it ran 1.11x
// (K 4096) to 1.37x (K 1536) faster, best at 12 rows up to K 2048 and 8 from 3072 (sonicmoe-bench-gemm fp8, H100:
// docs/notes/fp8_dgated_epilogue.md). SONICMOE_FP8_DGATED_CONSUMER_ROWS=0..16 (even) forces it (read at every call).
inline int fp8_dgated_consumer_rows(std::int64_t k) {
  return consumer_rows_or("SONICMOE_FP8_DGATED_CONSUMER_ROWS", k < kFp8LongK ? 12 : 8);
}

// The dgated kernel on bf16 operands with the FP8 epilogue (MoEConfig::dgated_precision bf16,
// bf16_varlen_m_dgated_fp8z): the same share for its consumer warps, 8 rows. Layer backward (fp8pq, H100), 8 rows
// against none: readme-default 19.76 vs 20.71 ms, olmoe-like 10.79 vs 11.44, fine-grained-256 12.26 vs 12.65,
// coarse-8x8 5.02 vs 5.43, small-k2 0.726 vs 0.783 (12 within the spread of 8; 4 between 0 and 8).
// SONICMOE_BF16_DGATED_CONSUMER_ROWS=0..16 (even) forces it (read at every call).
inline int bf16_dgated_fp8z_consumer_rows(std::int64_t /*k*/) {
  return consumer_rows_or("SONICMOE_BF16_DGATED_CONSUMER_ROWS", 8);
}

// The FP8 up-projection's Z-quantising epilogue (EpiActivationFp8Z): the same share of its rows for the consumer
// warps (EpiActivationFp8Z::Params::consumer_rows). The gathering kernel's 128-wide tile (wide false): 8 below K 3072,
// none from there (H100, sonicmoe-bench --precision fp8, forward with pre-quantised weights: olmoe-like 5.14-5.17 ms
// against 5.72-5.75 with none and 5.18-5.19 with the separate pass; readme-default within the spread either way).
// The contiguous kernel's 256-wide tile (wide true, X's rows in place): 16 below K 3072, 8 from there (H200,
// sonicmoe-bench-gemm fp8, the GEMM with Z's codes, TF/s at 0 / 4 / 8 / 16 rows: readme-default 783 / 850 / 926 /
// 862, fine-grained-256 672 / 722 / 765 / 786, coarse-8x8 728 / 768 / 905 / 916, olmoe-like 589 / 637 / 754 / 792:
// docs/notes/fp8_up_in_place.md). SONICMOE_FP8_Z_CONSUMER_ROWS=0..16 (even) forces it (read at every call).
inline int fp8_z_consumer_rows(std::int64_t k, bool wide) {
  const int rule = wide ? (k < kFp8LongK ? 16 : 8) : (k < kFp8LongK ? 8 : 0);
  return consumer_rows_or("SONICMOE_FP8_Z_CONSUMER_ROWS", rule);
}

// The dgated kernel's layout by K (= H).
inline constexpr int kDgatedMmaGatherMinK = 3072;
// MMA-warp gathering (three epilogue warps) from K = 3072; below it the four-warpgroup layout, whose four epilogue
// warps keep up with the heavy dgated epilogue under short K loops: docs/notes/mma_warp_gathering.md.
constexpr bool dgated_mma_gather(int k) { return k >= kDgatedMmaGatherMinK; }

// The swapped dW1 kernel from this many rows an expert.
inline constexpr std::int64_t kSwapMinRowsPerExpert = 1024;
// Only Q gathered: compute D^T so the gathered operand is on the 128-wide M side (half the cp.async per k-tile); pays
// off on long reductions only (1.10-1.12x at 2048-4096 rows an expert, 0.95-0.98x at 512):
// docs/notes/varlen_k_weight_grads.md.
constexpr bool varlen_k_swap_operands(bool p_gathered, bool q_gathered, std::int64_t rows, int num_experts) {
  return !p_gathered && q_gathered && rows >= kSwapMinRowsPerExpert * num_experts;
}

// The accumulating varlen-K epilogue (D += the tile into an fp32 main_grad, NativeVarlenK::d_f32): by TMA reduce-add
// from this many rows an expert (long K loops hide part of the read-modify-write), else from the consumers' registers
// (their loads in flight at once drain short tiles faster): python/bench/main_grad_bench.py.
inline constexpr std::int64_t kAccumTmaMinRowsPerExpert = 1024;
constexpr bool varlen_k_accum_by_tma(std::int64_t rows, int num_experts) {
  return rows >= kAccumTmaMinRowsPerExpert * num_experts;
}

}  // namespace sonicmoe::cuda::gemm

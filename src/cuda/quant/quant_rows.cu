// 1x128 quantisation of rows (docs/ALGORITHM.md, "FP8 blockwise recipe"), optionally gathering the rows by an index
// list, or scattering each row's codes to the routing rows that read it (fp8_quantize_rows_scatter). A group of 8
// lanes owns one block, 16 elements a lane (two 16-byte loads of bf16, four of f32, all issued before any is used):
// amax by 8-lane shuffles, each lane's 16 codes in one 16-byte store, the scale by the group's first lane.
// Consecutive groups take the consecutive blocks of a row: loads and stores are coalesced.
#include <cuda_bf16.h>

#include "cuda/launch_util.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quant_common.cuh"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {

namespace {

constexpr int kThreads = 256;

// Where a quantised block goes: q's row i of x's row rows[i] (or i), the gathering and plain forms; or, kScatter
// (fp8_quantize_rows_scatter), x's row i to row rev[p] of each of its pairs p in [token_offsets[i],
// token_offsets[i + 1]) (rev[p] = -1: a pair without a row, nothing written), each lane's 16 codes converted once and
// stored K times.
struct RowDest {
  const std::int32_t* rows = nullptr;           // gathering: [M] or null
  const std::int32_t* token_offsets = nullptr;  // scatter: [M + 1]
  const std::int32_t* rev = nullptr;            // scatter: [pairs]
};

template <typename T, bool kScatter>
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const T* __restrict__ x, RowDest dest,
                                                                  std::int64_t num_x_rows, std::int64_t M, int K,
                                                                  std::uint8_t* __restrict__ q,
                                                                  float* __restrict__ scale) {
  constexpr int V = quant::kVec<T>, kPerLane = 16, G = fp8::kBlock / kPerLane, kGroupsPerWarp = 32 / G;
  const int nb = (K + fp8::kBlock - 1) / fp8::kBlock;
  const std::int64_t groups = M * nb;
  const int lane = threadIdx.x % 32, sub = lane % G;
  const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kThreads / 32;
  // The loop bound is uniform across the warp (its shuffles need every lane); groups past the end only idle.
  for (std::int64_t base = warp * kGroupsPerWarp; base < groups; base += warps * kGroupsPerWarp) {
    const std::int64_t g = base + lane / G;
    const bool valid = g < groups;
    const std::int64_t i = valid ? g / nb : 0;
    const int blk = static_cast<int>(valid ? g % nb : 0), col = blk * fp8::kBlock + sub * kPerLane;
    const std::int64_t src = !kScatter && dest.rows ? (valid ? dest.rows[i] : 0) : i;
    const bool in_range = src >= 0 && src < num_x_rows;
    float v[kPerLane] = {};
    if (valid && in_range && col < K) {  // K is a multiple of 16: a lane's 16 elements are all in or all out
#pragma unroll
      for (int j = 0; j < kPerLane / V; ++j)
        quant::load_vec<T>(x + src * K + col + j * V, v + j * V);
    }
    // A row index outside x is stored as a NaN row (the CPU backend rejects it up front).
    const std::uint32_t amax = quant::group_max(in_range ? quant::amax_bits(v) : fp8::kNonFiniteBits, G);
    const fp8::BlockScale s = fp8::block_scale(amax);
    if (!valid) continue;
    if constexpr (kScatter) {
      const uint4 codes = quant::codes16(v, s);
      for (int p = dest.token_offsets[i], end = dest.token_offsets[i + 1]; p < end; ++p) {
        const std::int64_t r = dest.rev[p];
        if (r < 0) continue;
        if (sub == 0) scale[r * nb + blk] = s.scale;
        if (col < K) *reinterpret_cast<uint4*>(q + r * K + col) = codes;
      }
    } else {
      if (sub == 0) scale[g] = s.scale;
      if (col < K) quant::store_codes<kPerLane>(q + i * K + col, v, s);
    }
  }
}

// The kernel over the M rows of blocks it quantises (q's rows; x's rows under kScatter).
template <typename T, bool kScatter>
void launch_rows(const Context& ctx, const TensorView& x, const RowDest& dest, std::int64_t M, const TensorView& q,
                 const TensorView& scale) {
  const int K = static_cast<int>(x.shape[1]);
  const std::int64_t threads = M * fp8_num_blocks(K) * (fp8::kBlock / 16);
  quantize_rows_kernel<T, kScatter><<<blocks_for(threads, kThreads), kThreads, 0, stream_of(ctx)>>>(
      x.ptr<const T>(), dest, x.shape[0], M, K, q.ptr<std::uint8_t>(), scale.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fp8_quantize_rows(const Context& ctx, const TensorView& x, const TensorView& rows, const TensorView& q,
                       const TensorView& scale) {
  if (q.shape[0] == 0 || x.shape[1] == 0) return;
  RowDest dest;
  dest.rows = rows.given() ? rows.ptr<const std::int32_t>() : nullptr;
  if (x.dtype == DType::bf16) launch_rows<__nv_bfloat16, false>(ctx, x, dest, q.shape[0], q, scale);
  else launch_rows<float, false>(ctx, x, dest, q.shape[0], q, scale);
}

void fp8_quantize_rows_scatter(const Context& ctx, const TensorView& x, const TensorView& token_offsets,
                               const TensorView& rev, const TensorView& q, const TensorView& scale) {
  if (x.shape[0] == 0 || x.shape[1] == 0 || q.shape[0] == 0) return;
  SONICMOE_CHECK(x.dtype == DType::bf16, "fp8_quantize_rows_scatter: x must be bf16, got ", dtype_name(x.dtype));
  RowDest dest;
  dest.token_offsets = token_offsets.ptr<const std::int32_t>();
  dest.rev = rev.ptr<const std::int32_t>();
  launch_rows<__nv_bfloat16, true>(ctx, x, dest, x.shape[0], q, scale);
}

}  // namespace sonicmoe::cuda

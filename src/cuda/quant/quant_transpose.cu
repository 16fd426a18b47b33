// Quantisers with a transposed, K-major FP8 result (docs/ALGORITHM.md, "FP8 blockwise recipe"):
//  - 128x1: x [M, K] -> q_t [K, M] with one scale per (column k, 128 rows);
//  - 128x128: w [E, N, K] -> q [E, N, K] and q_t [E, K, N] with one scale per block, from one read of w;
//  - 128x1 per expert segment (quant_segments.h): each expert's (gathered) rows into whole 128-column blocks.
// A CTA owns a tile of 128 rows x KT columns. Its threads read the rows with 16-byte loads (coalesced along K) and
// write the values as fp32 into a k-major shared tile (quant_tile.h: row kk of the tile holds the 128 values of
// column kk, 16-byte groups XOR-swizzled by kk, which keeps the scattered stores of the load phase and the 16-byte
// reads of the store phase free of bank conflicts; tests/cuda/test_quant_layout.cpp counts them). The store phase
// gives each column to 8 lanes (16 values each) of a warp: they reduce the column's amax by shuffles (128x1) or use
// the block's (128x128), cast, and write the column's 128 codes as 8 coalesced 16-byte stores. On bf16 input the
// 128x128 and per-expert kernels transpose with ldmatrix instead (quantize_blocks_bf16_kernel,
// quantize_segment_cols_bf16_kernel).
#include <cuda_bf16.h>

#include <cub/block/block_scan.cuh>

#include <type_traits>

#include "cuda/launch_util.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quant_common.cuh"
#include "cuda/quant/quant_segments.h"
#include "cuda/quant/quant_tile.h"

namespace sonicmoe::cuda {

namespace {

using quant::tile_offset;
constexpr int kThreads = quant::kTileThreads, kWarps = quant::kTileWarps;
constexpr int kRows = quant::kTileRows;  // tile rows (M for 128x1, N for 128x128)
static_assert(kRows == fp8::kBlock, "a tile is one block of rows");

// The thread's share of a kRows x KT tile: its 16-byte chunks, kept in registers (the 128x128 kernel stores them
// again as the non-transposed copy).
template <typename T, int KT>
struct TileChunks {
  static constexpr int V = quant::kVec<T>, kPerRow = KT / V, kCount = kRows * kPerRow / kThreads;
  static_assert(kCount * kThreads == kRows * kPerRow, "tile must split evenly over the threads");
  float v[kCount][V];
  __device__ static int row(int c) { return quant::load_row(threadIdx.x, c, kPerRow); }
  __device__ static int col(int c) { return quant::load_col(threadIdx.x, c, kPerRow, V); }

  // Loads rows [r0, r0 + 128) x columns [k0, k0 + KT) of a row-major matrix with `rows` rows of length ld (zeros
  // outside), writes them into the shared tile (unless tile is null) and returns the thread's amax bits.
  __device__ std::uint32_t load(const T* __restrict__ x, int rows, int ld, int r0, int k0, float* tile) {
    return load_mapped(x, ld, k0, tile, [&](int rr) { return r0 + rr < rows ? r0 + rr : -1; });
  }
  // The same with tile row rr read from matrix row row_of(rr) (-1: zeros).
  template <class RowOf>
  __device__ std::uint32_t load_mapped(const T* __restrict__ x, int ld, int k0, float* tile, RowOf&& row_of) {
    std::uint32_t amax = 0;
#pragma unroll
    for (int c = 0; c < kCount; ++c) {
      const int r = row_of(row(c)), k = k0 + col(c);
#pragma unroll
      for (int t = 0; t < V; ++t) v[c][t] = 0.0f;
      if (r >= 0 && k < ld) quant::load_vec<T>(x + static_cast<std::int64_t>(r) * ld + k, v[c]);
      amax = max(amax, quant::amax_bits(v[c]));
      if (tile) {
#pragma unroll
        for (int t = 0; t < V; ++t) tile[tile_offset(col(c) + t, row(c))] = v[c][t];
      }
    }
    return amax;
  }
};

// The store phase. Column kk of the tile goes to q_t row (k0 + kk) (length ld_t, valid rows < num_k), its values
// m0 + [0, 128) of which those < num_m are written; a lane holds 16 of them (quant_tile.h: the column's 8 lanes
// differ in lane bits 2-4, the bits the amax shuffles run over).
// kPerColumn: each column has its own scale (128x1), written to scale_t[(k0 + kk) * scale_ld + scale_col];
// otherwise every column uses `block`.
template <int KT, bool kPerColumn>
__device__ __forceinline__ void store_columns(const float* tile, int k0, int num_k, int m0, int num_m, int ld_t,
                                              std::uint8_t* __restrict__ q_t, fp8::BlockScale block,
                                              float* __restrict__ scale_t, int scale_ld, int scale_col) {
  const int first = quant::store_first(threadIdx.x);
#pragma unroll
  for (int pass = 0; pass < quant::store_passes(KT); ++pass) {
    const int kk = quant::store_col(threadIdx.x, pass), k = k0 + kk;
    float v[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 f = *reinterpret_cast<const float4*>(tile + tile_offset(kk, first + 4 * i));
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
    fp8::BlockScale s = block;
    if constexpr (kPerColumn) {
      std::uint32_t amax = quant::amax_bits(v);
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 8));
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
      s = fp8::block_scale(amax);
      if (first == 0 && k < num_k) scale_t[static_cast<std::int64_t>(k) * scale_ld + scale_col] = s.scale;
    }
    const int m = m0 + first;
    if (k < num_k && m < num_m) quant::store_codes<16>(q_t + static_cast<std::int64_t>(k) * ld_t + m, v, s);
  }
}

// 128x1: grid (ceil(M / 128), ceil(K / 64)).
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_cols_t_kernel(const T* __restrict__ x, int M, int K,
                                                                    std::uint8_t* __restrict__ q_t,
                                                                    float* __restrict__ scale_t) {
  constexpr int KT = 64;
  __shared__ __align__(16) float tile[KT * kRows];
  const int m0 = blockIdx.x * kRows, k0 = blockIdx.y * KT;
  TileChunks<T, KT> chunks;
  chunks.load(x, M, K, m0, k0, tile);
  __syncthreads();
  store_columns<KT, true>(tile, k0, K, m0, M, M, q_t, {}, scale_t, gridDim.x, blockIdx.x);
}

// A 128x128 block's scale from every thread's amax bits: each warp's maximum into warp_amax (publish_warp_amax), then,
// after a barrier the caller places, the block's scale from them (block_scale_of; thread 0 writes it to *scale).
__device__ __forceinline__ void publish_warp_amax(std::uint32_t amax, std::uint32_t* warp_amax) {
  amax = quant::group_max(amax, 32);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
}
__device__ __forceinline__ fp8::BlockScale block_scale_of(const std::uint32_t* warp_amax, float* scale) {
  std::uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) amax = max(amax, warp_amax[i]);
  const fp8::BlockScale s = fp8::block_scale(amax);
  if (threadIdx.x == 0) *scale = s.scale;
  return s;
}

// 128x128: grid (ceil(N / 128) * ceil(K / 128), E); dynamic shared memory: the fp32 tile when q_t is written.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(const T* __restrict__ w, int N, int K,
                                                                    std::uint8_t* __restrict__ q,
                                                                    std::uint8_t* __restrict__ q_t,
                                                                    float* __restrict__ scale) {
  constexpr int KT = fp8::kBlock;
  extern __shared__ __align__(16) float tile[];
  __shared__ std::uint32_t warp_amax[kWarps];
  const int nbk = (K + KT - 1) / KT, bn = blockIdx.x / nbk, bk = blockIdx.x % nbk;
  const int n0 = bn * kRows, k0 = bk * KT;
  const std::int64_t e = blockIdx.y, NK = static_cast<std::int64_t>(N) * K;
  TileChunks<T, KT> chunks;
  publish_warp_amax(chunks.load(w + e * NK, N, K, n0, k0, q_t ? tile : nullptr), warp_amax);
  __syncthreads();
  const fp8::BlockScale s = block_scale_of(warp_amax, scale + e * gridDim.x + blockIdx.x);
  // The [E, N, K] copy from the registers, the chunks as they were loaded.
  std::uint8_t* qe = q + e * NK;
#pragma unroll
  for (int c = 0; c < TileChunks<T, KT>::kCount; ++c) {
    const int n = n0 + chunks.row(c), k = k0 + chunks.col(c);
    if (n < N && k < K) quant::store_codes<quant::kVec<T>>(qe + static_cast<std::int64_t>(n) * K + k, chunks.v[c], s);
  }
  if (q_t) store_columns<KT, false>(tile, k0, K, n0, N, N, q_t + e * NK, s, nullptr, 0, 0);
}

// The bf16 tiles' swizzle (chunk c of row r at c ^ seg_swizzle(r)): distinct on the 8 rows 32a + 2g + b (a < 4, b < 2)
// of one ldmatrix matrix, so each 8-row phase of the transposed reads is free of bank conflicts.
__device__ __forceinline__ int seg_swizzle(int r) { return (r & 1) | (((r >> 5) & 3) << 1); }

// Shared address of chunk ch (8 bf16) of row rr in a bf16 tile of KT columns at `base`, swizzled.
template <int KT>
__device__ __forceinline__ std::uint32_t swizzled_chunk(std::uint32_t base, int rr, int ch) {
  return base + 2u * (rr * KT + ((ch ^ seg_swizzle(rr)) * 8));
}
__device__ __forceinline__ void st_shared_chunk(std::uint32_t at, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// Four ldmatrix.x4.trans over chunk column cc of a 128-row bf16 tile (KT columns, swizzled): lane L gets f[i] = row
// 32 (L % 4) + i of column 8 cc + L / 4, as fp32 (matrix g's 8 rows are 32a + 2g + b, a < 4, b < 2; after the
// transpose lane L holds rows 2 (L % 4), + 1 of each matrix, i.e. rows 32 (L % 4) + 2g + {0, 1}).
template <int KT>
__device__ __forceinline__ void ldmatrix_column32(std::uint32_t base, int cc, int lane, float (&f)[32]) {
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int g = 4 * n + lane / 8, rho = lane % 8, row = 32 * (rho / 2) + 2 * g + (rho % 2);
    std::uint32_t d[4];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(swizzled_chunk<KT>(base, row, cc))
                 : "memory");
#pragma unroll
    for (int m = 0; m < 4; ++m) {  // matrix 4n + m
      f[2 * (4 * n + m)] = __uint_as_float(d[m] << 16);
      f[2 * (4 * n + m) + 1] = __uint_as_float(d[m] & 0xffff0000u);
    }
  }
}

// The bf16 form of quantize_blocks_kernel (the layer's weights), transposing by ldmatrix as
// quantize_segment_cols_bf16_kernel does: the 128 x 128 block lands in shared memory as loaded (32 KB of bf16, against
// the fp32 tile's 64 KB, so four CTAs an SM), the [E, N, K] copy leaves from there too (each thread reads back its own
// chunks: no registers held across the barrier), and warp w owns the transposed columns of chunk columns w and w + 8
// (ldmatrix_column32), stored as 2 x 16 codes a lane. The same codes and scales as the fp32-tile kernel (the block's
// amax of the same values, the same cast).
__global__ void __launch_bounds__(kThreads, 4) quantize_blocks_bf16_kernel(const __nv_bfloat16* __restrict__ w, int N,
                                                                        int K, std::uint8_t* __restrict__ q,
                                                                        std::uint8_t* __restrict__ q_t,
                                                                        float* __restrict__ scale) {
  constexpr int KT = fp8::kBlock, kChunks = KT / 8;  // 16 chunks (8 columns, 16 bytes) a row
  constexpr int kPerThread = kRows * kChunks / kThreads, kPasses = kChunks / kWarps;
  __shared__ __align__(128) std::uint16_t tile[kRows * KT];
  __shared__ std::uint32_t warp_amax[kWarps];
  const int nbk = (K + KT - 1) / KT, bn = blockIdx.x / nbk, bk = blockIdx.x % nbk;
  const int n0 = bn * kRows, k0 = bk * KT;
  const std::int64_t e = blockIdx.y, NK = static_cast<std::int64_t>(N) * K;
  const __nv_bfloat16* we = w + e * NK;
  uint4 v[kPerThread];
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {  // all loads in flight before the first use
    const int id = threadIdx.x + c * kThreads, n = n0 + id / kChunks, k = k0 + (id % kChunks) * 8;
    v[c] = make_uint4(0, 0, 0, 0);
    if (n < N && k < K) v[c] = __ldg(reinterpret_cast<const uint4*>(we + static_cast<std::int64_t>(n) * K + k));
  }
  std::uint32_t amax = 0;
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {
    float f[8];
    quant::bf16x8_to_f32(v[c], f);
    amax = max(amax, quant::amax_bits(f));
  }
  publish_warp_amax(amax, warp_amax);
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile));
  auto chunk_at = [&](int c) {  // shared address of the thread's chunk c
    const int id = threadIdx.x + c * kThreads;
    return swizzled_chunk<KT>(base, id / kChunks, id % kChunks);
  };
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) st_shared_chunk(chunk_at(c), v[c]);
  __syncthreads();
  const fp8::BlockScale sc = block_scale_of(warp_amax, scale + e * gridDim.x + blockIdx.x);
  std::uint8_t* qe = q + e * NK;
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {  // the [E, N, K] copy, each chunk read back where the thread stored it
    const int id = threadIdx.x + c * kThreads, n = n0 + id / kChunks, k = k0 + (id % kChunks) * 8;
    float f[8];
    uint4 u;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                 : "r"(chunk_at(c)));
    quant::bf16x8_to_f32(u, f);
    if (n < N && k < K) quant::store_codes<8>(qe + static_cast<std::int64_t>(n) * K + k, f, sc);
  }
  if (!q_t) return;
  const int wp = threadIdx.x / 32, lane = threadIdx.x % 32, qd = lane % 4;
#pragma unroll 1
  for (int pass = 0; pass < kPasses; ++pass) {
    const int cc = wp + kWarps * pass;  // chunk column
    float f[32];  // rows 32 qd + i of column k0 + 8 cc + lane / 4
    ldmatrix_column32<KT>(base, cc, lane, f);
    const int k = k0 + 8 * cc + lane / 4, n = n0 + 32 * qd;
    if (k >= K) continue;
    std::uint8_t* dst = q_t + e * NK + static_cast<std::int64_t>(k) * N + n;
    const float(&lo16)[16] = *reinterpret_cast<const float(*)[16]>(f);
    const float(&hi16)[16] = *reinterpret_cast<const float(*)[16]>(f + 16);
    if (n < N) quant::store_codes<16>(dst, lo16, sc);
    if (n + 16 < N) quant::store_codes<16>(dst + 16, hi16, sc);
  }
}

// Padded block j (< block_offsets[E]) of the per-expert segments: the routing rows [r0, end) it covers (end - r0 <=
// 128; the block's rows past end are zero padding), from the last expert whose first block is <= j (experts without
// rows have no blocks).
struct SegmentRows {
  int r0, end;
  // The input row of the block's row rr: x[gather[r0 + rr]] (or x[r0 + rr]); -1 (zeros) past end or for an index
  // outside x's x_rows rows.
  __device__ __forceinline__ int source(int rr, const std::int32_t* __restrict__ gather, int x_rows) const {
    const int r = r0 + rr;
    if (r >= end) return -1;
    const int g = gather ? __ldg(gather + r) : r;
    return g >= 0 && g < x_rows ? g : -1;
  }
};
__device__ __forceinline__ SegmentRows segment_rows(int j, const std::int32_t* __restrict__ offsets,
                                                    const std::int32_t* __restrict__ block_offsets, int E) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(block_offsets + mid) <= j) lo = mid;
    else hi = mid - 1;
  }
  return {__ldg(offsets + lo) + (j - __ldg(block_offsets + lo)) * kRows, __ldg(offsets + lo + 1)};
}

// 128x1 per expert segment, fp32 rows (bf16 ones: quantize_segment_cols_bf16_kernel below): grid (capacity blocks,
// ceil(C / 64)). CTA (j, .) quantises padded block j: the rows
// [offsets[e] + 128 (j - block_offsets[e]), +128) of expert e (the e with block_offsets[e] <= j < block_offsets[e+1]),
// cut at offsets[e+1] (zeros past it), read from x[gather[r]] (or x[r]); codes into columns [128 j, 128 j + 128) of
// q_t [C, 128 capacity], scales into scale_t[j, :]. Blocks past block_offsets[E] are left as they are.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_segment_cols_kernel(
    const T* __restrict__ x, int x_rows, int C, const std::int32_t* __restrict__ gather,
    const std::int32_t* __restrict__ offsets, const std::int32_t* __restrict__ block_offsets, int E, int ld_t,
    std::uint8_t* __restrict__ q_t, float* __restrict__ scale_t) {
  constexpr int KT = 64;
  __shared__ __align__(16) float tile[KT * kRows];
  const int j = blockIdx.x, k0 = blockIdx.y * KT;
  if (j >= __ldg(block_offsets + E)) return;
  const SegmentRows seg = segment_rows(j, offsets, block_offsets, E);
  TileChunks<T, KT> chunks;
  chunks.load_mapped(x, C, k0, tile, [&](int rr) { return seg.source(rr, gather, x_rows); });
  __syncthreads();
  store_columns<KT, true>(tile, k0, C, j * kRows, ld_t, ld_t, q_t, {}, scale_t, 1, j * C);
}

// The bf16 form of the kernel above (the layer's operands), transposed by ldmatrix instead of per-value shared stores:
// the copy was bound by instruction issue (docs/notes/fp8_weight_grads.md). The 128 rows x 64 columns land in shared
// memory as loaded (one 16-byte store a chunk; chunk c of row r at c ^ seg_swizzle(r)). Warp w then owns columns
// k0 + 8w .. + 8: ldmatrix_column32 gives lane L the 32 rows 32 (L % 4) .. + 32 of column k0 + 8w + L / 4, in order;
// the column's amax over its 4 lanes, its 128 codes as 2 x 16 bytes a lane. The same codes and scales as
// quantize_segment_cols_kernel (amax of the same values, the same cast).
__global__ void __launch_bounds__(kThreads, 6) quantize_segment_cols_bf16_kernel(
    const __nv_bfloat16* __restrict__ x, int x_rows, int C, const std::int32_t* __restrict__ gather,
    const std::int32_t* __restrict__ offsets, const std::int32_t* __restrict__ block_offsets, int E, int ld_t,
    std::uint8_t* __restrict__ q_t, float* __restrict__ scale_t) {
  constexpr int KT = 64, kChunks = KT / 8;  // 8 columns (16 bytes) a chunk
  static_assert(kThreads == 32 * kChunks, "a warp per chunk column in the transpose");
  __shared__ __align__(128) std::uint16_t tile[kRows * KT];
  const int j = blockIdx.x, k0 = blockIdx.y * KT;
  if (j >= __ldg(block_offsets + E)) return;
  const SegmentRows seg = segment_rows(j, offsets, block_offsets, E);
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile));
  constexpr int kPerThread = kRows * kChunks / kThreads;
  uint4 v[kPerThread];
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {  // all loads in flight before the first store
    const int id = threadIdx.x + c * kThreads, rr = id / kChunks, k = k0 + (id % kChunks) * 8;
    const int g = seg.source(rr, gather, x_rows);
    v[c] = make_uint4(0, 0, 0, 0);
    if (g >= 0 && k < C) v[c] = __ldg(reinterpret_cast<const uint4*>(x + static_cast<std::int64_t>(g) * C + k));
  }
#pragma unroll
  for (int c = 0; c < kPerThread; ++c) {
    const int id = threadIdx.x + c * kThreads;
    st_shared_chunk(swizzled_chunk<KT>(base, id / kChunks, id % kChunks), v[c]);
  }
  __syncthreads();
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane % 4;
  float f[32];  // rows 32 q + i of column k0 + 8 w + lane / 4
  ldmatrix_column32<KT>(base, w, lane, f);
  std::uint32_t amax = quant::amax_bits(f);
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const fp8::BlockScale sc = fp8::block_scale(amax);
  const int k = k0 + 8 * w + lane / 4;
  if (k >= C) return;
  if (q == 0) scale_t[static_cast<std::int64_t>(j) * C + k] = sc.scale;
  std::uint8_t* dst = q_t + static_cast<std::int64_t>(k) * ld_t + static_cast<std::int64_t>(j) * kRows + 32 * q;
  const float(&lo16)[16] = *reinterpret_cast<const float(*)[16]>(f);
  const float(&hi16)[16] = *reinterpret_cast<const float(*)[16]>(f + 16);
  quant::store_codes<16>(dst, lo16, sc);
  quant::store_codes<16>(dst + 16, hi16, sc);
}

// block_offsets[e] = sum over e' < e of ceil(rows of e' / 128), e in [0, E]: one CTA, CUB's block scan over chunks
// of kScanThreads experts with a running carry.
constexpr int kScanThreads = 1024;
__global__ void __launch_bounds__(kScanThreads) segment_block_offsets_kernel(const std::int32_t* __restrict__ offsets,
                                                                             int E, std::int32_t* __restrict__ block_offsets) {
  using Scan = cub::BlockScan<std::int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  std::int32_t carry = 0;  // the same in every thread: the sum of the chunks before
  for (int base = 0; base < E; base += kScanThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const std::int32_t n = e < E ? max(__ldg(offsets + e + 1) - __ldg(offsets + e), 0) : 0;
    std::int32_t ex, total;
    Scan(tmp).ExclusiveSum((n + kRows - 1) / kRows, ex, total);
    if (e < E) block_offsets[e] = carry + ex;
    carry += total;
    __syncthreads();  // tmp is reused by the next chunk
  }
  if (threadIdx.x == 0) block_offsets[E] = carry;
}

}  // namespace

std::int64_t fp8_segment_block_capacity(std::int64_t rows, std::int64_t num_experts) {
  return fp8_num_blocks(rows) + num_experts;
}

void fp8_segment_block_offsets(const Context& ctx, const TensorView& offsets, const TensorView& block_offsets) {
  const int E = static_cast<int>(offsets.shape[0] - 1);
  segment_block_offsets_kernel<<<1, kScanThreads, 0, stream_of(ctx)>>>(offsets.ptr<const std::int32_t>(), E,
                                                              block_offsets.ptr<std::int32_t>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void fp8_quantize_segment_cols(const Context& ctx, const TensorView& x, const TensorView& gather,
                               const TensorView& offsets, const TensorView& block_offsets, const TensorView& q_t,
                               const TensorView& scale_t) {
  const int C = static_cast<int>(x.shape[1]), E = static_cast<int>(offsets.shape[0] - 1);
  const std::int64_t cap = scale_t.shape[0];
  SONICMOE_CHECK(cap * kRows < (std::int64_t{1} << 31),
                 "sonicmoe::fp8_quantize_segment_cols: ", cap, " blocks of 128 rows exceed the int32 column range");
  if (cap == 0 || C == 0 || E == 0) return;
  const dim3 grid(static_cast<unsigned>(cap), static_cast<unsigned>((C + 63) / 64));
  SONICMOE_CHECK(grid.y <= 65535, "sonicmoe::fp8_quantize_segment_cols: C = ", C, " exceeds ", 65535 * 64);
  const std::int32_t* g = gather.given() ? gather.ptr<const std::int32_t>() : nullptr;
  const int x_rows = static_cast<int>(x.shape[0]), ld_t = static_cast<int>(cap * kRows);
  SONICMOE_CHECK(C % quant::kVec<std::uint16_t> == 0 || x.dtype != DType::bf16,
                 "sonicmoe::fp8_quantize_segment_cols: bf16 rows need C a multiple of 8 (16 bytes), got ", C);
  if (x.dtype == DType::bf16)
    quantize_segment_cols_bf16_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
        x.ptr<const __nv_bfloat16>(), x_rows, C, g, offsets.ptr<const std::int32_t>(),
        block_offsets.ptr<const std::int32_t>(), E, ld_t, q_t.ptr<std::uint8_t>(), scale_t.ptr<float>());
  else
    quantize_segment_cols_kernel<float><<<grid, kThreads, 0, stream_of(ctx)>>>(
        x.ptr<const float>(), x_rows, C, g, offsets.ptr<const std::int32_t>(), block_offsets.ptr<const std::int32_t>(),
        E, ld_t, q_t.ptr<std::uint8_t>(), scale_t.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void fp8_quantize_cols_transposed(const Context& ctx, const TensorView& x, const TensorView& q_t,
                                  const TensorView& scale_t) {
  const int M = static_cast<int>(x.shape[0]), K = static_cast<int>(x.shape[1]);
  if (M == 0 || K == 0) return;
  const dim3 grid(static_cast<unsigned>(fp8_num_blocks(M)), static_cast<unsigned>((K + 63) / 64));
  SONICMOE_CHECK(grid.y <= 65535, "sonicmoe::fp8_quantize_cols_transposed: K = ", K, " exceeds ", 65535 * 64);
  if (x.dtype == DType::bf16)
    quantize_cols_t_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream_of(ctx)>>>(
        x.ptr<const __nv_bfloat16>(), M, K, q_t.ptr<std::uint8_t>(), scale_t.ptr<float>());
  else
    quantize_cols_t_kernel<float><<<grid, kThreads, 0, stream_of(ctx)>>>(x.ptr<const float>(), M, K,
                                                                         q_t.ptr<std::uint8_t>(), scale_t.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

namespace {
template <typename T>
void launch_blocks(const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t,
                   const TensorView& scale) {
  const int N = static_cast<int>(w.shape[1]), K = static_cast<int>(w.shape[2]);
  const std::int64_t tiles = fp8_num_blocks(N) * fp8_num_blocks(K);
  SONICMOE_CHECK(tiles < (std::int64_t{1} << 31) && w.shape[0] <= 65535, "sonicmoe::fp8_quantize_blocks: w ",
                 w.shape_str(), " has more blocks than one launch holds (E <= 65535, blocks per expert < 2^31)");
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(w.shape[0]));
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    quantize_blocks_bf16_kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(
        w.ptr<const T>(), N, K, q.ptr<std::uint8_t>(), q_t.given() ? q_t.ptr<std::uint8_t>() : nullptr,
        scale.ptr<float>());
  } else {
    const std::size_t smem = q_t.given() ? sizeof(float) * fp8::kBlock * kRows : 0;
    allow_dynamic_smem(reinterpret_cast<const void*>(&quantize_blocks_kernel<T>), smem);
    quantize_blocks_kernel<T><<<grid, kThreads, smem, stream_of(ctx)>>>(
        w.ptr<const T>(), N, K, q.ptr<std::uint8_t>(), q_t.given() ? q_t.ptr<std::uint8_t>() : nullptr,
        scale.ptr<float>());
  }
  SONICMOE_CUDA_CHECK_LAUNCH();
}
}  // namespace

void fp8_quantize_blocks(const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t,
                         const TensorView& scale) {
  if (w.shape[0] == 0 || w.shape[1] == 0 || w.shape[2] == 0) return;
  if (w.dtype == DType::bf16) launch_blocks<__nv_bfloat16>(ctx, w, q, q_t, scale);
  else launch_blocks<float>(ctx, w, q, q_t, scale);
}

}  // namespace sonicmoe::cuda

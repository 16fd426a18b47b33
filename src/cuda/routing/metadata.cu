// Routing metadata on the GPU (DESIGN.md section 3): a stable grouping of the N (token, expert) pairs by
// expert. Default: a segmented counting sort in three launches and one allocation for all its arrays.
//   1. count:   the pairs are cut into S segments of `seg` pairs, one warp each, kWarps per block;
//               per-segment expert histograms seg[s][e] (shared atomics), their per-block
//               sums blk[b][e], and token_offsets from the token boundaries.
//   2. colscan: per expert, the exclusive prefix of blk[.][e] over blocks (in place) and counts[e].
//   3. scatter: every block scans counts into offsets (block 0 stores them); each warp walks its segment
//               in order, 32 pairs at a time, lanes with the same expert (ranked in lane order) taking
//               consecutive rows after the segment's cursor offsets[e] + blk[b][e] + the block's earlier
//               segments' seg[.][e].
// Rows of one expert therefore follow increasing p (bitwise the reference's stable sort) and no position
// depends on atomic ordering. No host synchronisation: capturable in a CUDA graph.
// The CUB radix-sort variant is kept for the benchmark's comparison.
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda_check.h"
#include "cuda/cuda_backend.h"
#include "cuda/launch_util.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

constexpr int kWarps = 8;             // warps (segments) per block of the count and scatter kernels
constexpr int kChunk = 8;             // pairs per lane loaded ahead of use
constexpr int kSegUnit = 32 * kChunk;  // segments are a multiple of this many pairs
constexpr std::int64_t kMaxSegments = 8192;
constexpr int kMaxExperts = 512;

// Writes token_offsets[t] = p for every token t that starts at pair p (prev < t <= tok[p], prev the token of
// pair p-1), and N for the tokens after the last pair. tok is non-decreasing and in [0, T) (validated).
// t = tok[p], prev = tok[p - 1] (-1 for p = 0), loaded by the caller.
__device__ __forceinline__ void token_boundary(int t, int prev, int p, int N, int T, int* __restrict__ toff) {
  for (int u = prev + 1; u <= t; ++u) toff[u] = p;
  if (p == N - 1)
    for (int u = t + 1; u <= T; ++u) toff[u] = N;
}

__global__ void __launch_bounds__(32 * kWarps)
    meta_count_kernel(const int* __restrict__ tok, const int* __restrict__ exp, int N, int T, int E, int seg, int S,
                      int* __restrict__ seg_counts, int* __restrict__ blk_counts, int* __restrict__ toff) {
  extern __shared__ int hist_all[];  // [kWarps][E]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int s = blockIdx.x * kWarps + w;
  int* h = hist_all + w * E;
  for (int e = lane; e < E; e += 32) h[e] = 0;
  __syncwarp();
  const int p0 = min(N, s * seg), p1 = min(N, p0 + seg);  // empty for warps past the last segment
  for (int c = p0; c < p1; c += kSegUnit) {
    int ev[kChunk], tv[kChunk], pv[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      ev[i] = p < p1 ? exp[p] : -1;
      tv[i] = p < p1 ? tok[p] : -1;
      pv[i] = p < p1 && p > 0 ? tok[p - 1] : -1;
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      if (p < p1) {
        atomicAdd(&h[ev[i]], 1);
        token_boundary(tv[i], pv[i], p, N, T, toff);
      }
    }
  }
  __syncthreads();
  if (s < S)
    for (int e = lane; e < E; e += 32) seg_counts[static_cast<std::int64_t>(s) * E + e] = h[e];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int sum = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += hist_all[v * E + e];
    blk_counts[static_cast<std::int64_t>(blockIdx.x) * E + e] = sum;
  }
}

// One block per 32 experts; lane = expert, warp w owns a contiguous range of segments.
__global__ void __launch_bounds__(1024)
    meta_colscan_kernel(int* __restrict__ seg_counts, int S, int E, int* __restrict__ counts) {
  __shared__ int tot[32][33];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int e = blockIdx.x * 32 + lane;
  const int per = (S + 31) / 32;
  const int s0 = min(S, w * per), s1 = min(S, s0 + per);
  int sum = 0;
  if (e < E)
#pragma unroll 8
    for (int s = s0; s < s1; ++s) sum += seg_counts[static_cast<std::int64_t>(s) * E + e];
  tot[w][lane] = sum;
  __syncthreads();
  int run = 0;
  for (int v = 0; v < w; ++v) run += tot[v][lane];
  if (e >= E) return;
  if (w == 31) counts[e] = run + sum;
  for (int s = s0; s < s1; s += 8) {  // eight loads in flight, then eight stores
    int v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = s + i < s1 ? seg_counts[static_cast<std::int64_t>(s + i) * E + e] : 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (s + i < s1) seg_counts[static_cast<std::int64_t>(s + i) * E + e] = run;
      run += v[i];
    }
  }
}

// offs[e] = exclusive scan of counts over experts (E <= 512 = 2 per thread); block 0 also stores offsets.
__device__ __forceinline__ void block_offsets(const int* __restrict__ counts, int E, int* offs,
                                              int* __restrict__ offsets) {
  using Scan = cub::BlockScan<int, 32 * kWarps>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int in[2], out[2], total;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = 2 * static_cast<int>(threadIdx.x) + i;
    in[i] = e < E ? counts[e] : 0;
  }
  Scan(scan_tmp).ExclusiveSum(in, out, total);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = 2 * static_cast<int>(threadIdx.x) + i;
    if (e < E) {
      offs[e] = out[i];
      if (blockIdx.x == 0) offsets[e] = out[i];
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) offsets[E] = total;
  __syncthreads();
}

__global__ void __launch_bounds__(32 * kWarps)
    meta_scatter_kernel(const int* __restrict__ tok, const int* __restrict__ exp, int N, int E, int seg, int S,
                        const int* __restrict__ seg_counts, const int* __restrict__ blk_prefix,
                        const int* __restrict__ counts,
                        int* __restrict__ offsets, int* __restrict__ pair, int* __restrict__ gather,
                        int* __restrict__ rev) {
  extern __shared__ int sm[];  // offs[E], then per warp its segment's counts, turned into its cursors
  __shared__ int wexp_all[kWarps][32];
  int* offs = sm;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int s = blockIdx.x * kWarps + w;
  int* cursor = sm + E + w * E;
  for (int e = lane; e < E; e += 32) cursor[e] = s < S ? seg_counts[static_cast<std::int64_t>(s) * E + e] : 0;
  block_offsets(counts, E, offs, offsets);  // ends with __syncthreads: every warp's counts are in place
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // exclusive prefix over the block's segments
    int run = offs[e] + blk_prefix[static_cast<std::int64_t>(blockIdx.x) * E + e];
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      int* q = sm + E + v * E + e;
      const int c = *q;
      *q = run;
      run += c;
    }
  }
  __syncthreads();
  if (s >= S) return;
  int* wexp = wexp_all[w];
  const int p0 = s * seg, p1 = min(N, p0 + seg);
  for (int c = p0; c < p1; c += kSegUnit) {
    int ev[kChunk], tv[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      ev[i] = p < p1 ? exp[p] : -1;
      tv[i] = p < p1 ? tok[p] : -1;
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      // rank = earlier lanes with the same expert, n = all of them (a compare loop over the warp's experts in
      // shared memory: its cost does not grow with the number of distinct experts, unlike __match_any_sync).
      const int e = ev[i];
      wexp[lane] = e;
      __syncwarp();
      int rank = 0, n = 0;
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const bool same = wexp[l] == e;
        rank += same && l < lane;
        n += same;
      }
      const int row = p < p1 ? cursor[e] + rank : 0;
      __syncwarp();  // every lane has read its cursor before the group's last lane advances it
      if (p < p1) {
        pair[row] = p;
        gather[row] = tv[i];
        rev[p] = row;
        if (rank == n - 1) cursor[e] += n;
      }
      __syncwarp();
    }
  }
}

// ---- CUB radix-sort variant (benchmark baseline) ----------------------------------------------
__global__ void iota_kernel(int* __restrict__ v, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int>(i);
}

__global__ void histogram_kernel(const int* __restrict__ keys, std::int64_t n, int E, int* __restrict__ counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    atomicAdd(&hist[keys[i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

__global__ void __launch_bounds__(32 * kWarps) offsets_kernel(const int* __restrict__ counts, int E,
                                                               int* __restrict__ offsets) {
  extern __shared__ int offs[];
  block_offsets(counts, E, offs, offsets);
}

__global__ void finish_radix_kernel(const int* __restrict__ pair, const int* __restrict__ tok, int N, int T,
                                    int* __restrict__ gather, int* __restrict__ rev, int* __restrict__ toff) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < N; r += gridDim.x * blockDim.x) {
    const int p = pair[r];
    gather[r] = tok[p];
    rev[p] = r;
    token_boundary(tok[r], r > 0 ? tok[r - 1] : -1, r, N, T, toff);  // indexed by pair, any thread will do
  }
}

// The metadata's arrays in one allocation.
RoutingMetadata empty_metadata(const Context& ctx, std::int64_t N, std::int64_t T, std::int64_t E) {
  ArrayPack pack;
  const int ic = pack.add({E}, DType::i32), io = pack.add({E + 1}, DType::i32), ip = pack.add({N}, DType::i32),
            ig = pack.add({N}, DType::i32), ir = pack.add({N}, DType::i32), it = pack.add({T + 1}, DType::i32);
  const std::vector<Tensor> a = pack.allocate(ctx);
  RoutingMetadata m;
  m.num_tokens = T;
  m.num_experts = E;
  m.num_pairs = N;
  m.counts = a[ic];
  m.offsets = a[io];
  m.pair = a[ip];
  m.gather = a[ig];
  m.rev = a[ir];
  m.token_offsets = a[it];
  return m;
}

void check_sizes(std::int64_t N, std::int64_t T, std::int64_t E) {
  SONICMOE_CHECK(E >= 1 && E <= kMaxExperts, "sonicmoe::build_metadata (cuda): num_experts = ", E,
                 ", expected 1..", kMaxExperts);
  SONICMOE_CHECK(N < (std::int64_t{1} << 31) - 4096 && T < (std::int64_t{1} << 31) - 1,
                 "sonicmoe::build_metadata (cuda): N = ", N, " pairs / T = ", T, " tokens exceed int32");
}

// Empty routing: counts, offsets and token_offsets are zeros.
RoutingMetadata zero_metadata(const Context& ctx, std::int64_t T, std::int64_t E) {
  RoutingMetadata m = empty_metadata(ctx, 0, T, E);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.counts.data(), 0, m.counts.nbytes(), stream_of(ctx)));
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.offsets.data(), 0, m.offsets.nbytes(), stream_of(ctx)));
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.token_offsets.data(), 0, m.token_offsets.nbytes(), stream_of(ctx)));
  return m;
}

}  // namespace

RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  check_sizes(N, T, E);
  if (N == 0) return zero_metadata(ctx, T, E);
  cudaStream_t s = stream_of(ctx);
  RoutingMetadata m = empty_metadata(ctx, N, T, E);
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  // Segments of 256 pairs (8 per lane), longer when N would need more than kMaxSegments of them.
  const std::int64_t units = (N + kSegUnit - 1) / kSegUnit;
  const int seg = static_cast<int>(kSegUnit * ((units + kMaxSegments - 1) / kMaxSegments));
  const int S = static_cast<int>((N + seg - 1) / seg);
  const int Ni = static_cast<int>(N), Ti = static_cast<int>(T), Ei = static_cast<int>(E);
  const int blocks = (S + kWarps - 1) / kWarps;
  ArrayPack work;
  const int i_seg = work.add({static_cast<std::int64_t>(S) * E}, DType::i32),
            i_blk = work.add({static_cast<std::int64_t>(blocks) * E}, DType::i32);
  const std::vector<Tensor> wk = work.allocate(ctx);
  int* seg_counts = wk[i_seg].ptr<int>();
  int* blk_counts = wk[i_blk].ptr<int>();
  const std::size_t e_bytes = sizeof(int) * static_cast<std::size_t>(E);
  meta_count_kernel<<<blocks, 32 * kWarps, kWarps * e_bytes, s>>>(tok, exp, Ni, Ti, Ei, seg, S, seg_counts, blk_counts,
                                                                   m.token_offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  meta_colscan_kernel<<<(Ei + 31) / 32, 1024, 0, s>>>(blk_counts, blocks, Ei, m.counts.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  meta_scatter_kernel<<<blocks, 32 * kWarps, (kWarps + 1) * e_bytes, s>>>(
      tok, exp, Ni, Ei, seg, S, seg_counts, blk_counts, m.counts.ptr<const int>(), m.offsets.ptr<int>(),
      m.pair.ptr<int>(), m.gather.ptr<int>(), m.rev.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  return m;
}

RoutingMetadata build_metadata_radix_sort(const Context& ctx, const TensorView& pair_token,
                                          const TensorView& pair_expert, std::int64_t num_tokens,
                                          std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  check_sizes(N, T, E);
  if (N == 0) return zero_metadata(ctx, T, E);
  cudaStream_t s = stream_of(ctx);
  RoutingMetadata m = empty_metadata(ctx, N, T, E);
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  const std::size_t e_bytes = sizeof(int) * static_cast<std::size_t>(E);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.counts.data(), 0, e_bytes, s));
  histogram_kernel<<<blocks_for(N, 1024, 264), 1024, e_bytes, s>>>(exp, N, static_cast<int>(E), m.counts.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, 32 * kWarps, e_bytes, s>>>(m.counts.ptr<const int>(), static_cast<int>(E), m.offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  // Stable LSD radix sort of (expert, p) pairs: rows of one expert keep increasing p.
  Tensor iota = workspace(ctx, N, DType::i32);
  Tensor keys_out = workspace(ctx, N, DType::i32);
  iota_kernel<<<blocks_for(N, 256), 256, 0, s>>>(iota.ptr<int>(), N);
  SONICMOE_CUDA_CHECK_LAUNCH();
  int end_bit = 1;
  while ((std::int64_t{1} << end_bit) < E) ++end_bit;
  std::size_t temp_bytes = 0;
  SONICMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, exp, keys_out.ptr<int>(),
                                                      iota.ptr<const int>(), m.pair.ptr<int>(), static_cast<int>(N),
                                                      0, end_bit, s));
  Tensor temp = workspace(ctx, static_cast<std::int64_t>((temp_bytes + 3) / 4), DType::i32);
  SONICMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, exp, keys_out.ptr<int>(),
                                                      iota.ptr<const int>(), m.pair.ptr<int>(), static_cast<int>(N),
                                                      0, end_bit, s));
  finish_radix_kernel<<<blocks_for(N, 256), 256, 0, s>>>(m.pair.ptr<const int>(), tok, static_cast<int>(N),
                                                         static_cast<int>(T), m.gather.ptr<int>(), m.rev.ptr<int>(),
                                                         m.token_offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  return m;
}

}  // namespace sonicmoe::cuda

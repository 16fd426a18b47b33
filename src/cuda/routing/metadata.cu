// Routing metadata on the GPU (DESIGN.md step 3, section 4): a stable grouping of the N (token, expert) pairs by
// expert. The pairs are cut into segments of `seg` pairs, one warp each, and blocks of kWarps segments:
//   1. per-block counts blk[b][e] (and token_offsets): from the pairs by meta_count_kernel, or, for top-K
//      routing, by the top-K kernel itself (topk_routing: the pairs come out in token order, and its blocks own
//      the same contiguous pair ranges);
//   2. colscan: per expert, the exclusive prefix of blk[.][e] over blocks (in place) and counts[e];
//   3. scatter: every block scans counts into offsets (block 0 stores them) and counts its warps' segments
//      again in shared memory; each warp walks its segment in order, 32 pairs at a time, lanes with the same
//      expert (ranked in lane order) taking consecutive rows after the cursor offsets[e] + blk[b][e] + the
//      block's earlier segments' counts.
// Rows of one expert therefore follow increasing p (bitwise the reference's stable sort) and no position
// depends on atomic ordering. No host synchronisation: capturable in a CUDA graph.
// A capacity C (top-K routing, RouterSpec::capacity_factor) is applied in steps 2-3: colscan stores the kept counts
// min(count, C) (and the demand, and adds the excess to `dropped`), and the scatter gives a pair a row only when its
// position inside its expert (its row before the capacity, less the expert's offset) is below C; the others get
// rev = -1. Positions follow p, so the first C pairs of every expert stay, as in ref::apply_capacity.
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "core/cuda_check.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_limits.h"
#include "cuda/launch_util.h"
#include "cuda/routing/routing_detail.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

constexpr int kWarps = detail::TopkGrid::kWarps;  // warps (segments) per block of the count and scatter kernels
constexpr int kMaxBlocks = detail::TopkGrid::kMaxBlocks;  // colscan: at most 8 rows per thread
constexpr int kChunk = 2;                                 // count kernel: pairs per lane loaded ahead of use
static_assert(2 * 32 * kWarps >= kMaxExperts, "block_offsets: two experts a thread (cuda_limits.h)");
static_assert(kMaxBlocks <= 128 * 8, "meta_colscan_kernel holds at most 8 block rows per thread");

// Writes token_offsets[t] = p for every token t that starts at pair p (prev < t <= tok[p], prev the token of
// pair p-1), and N for the tokens after the last pair. tok is non-decreasing and in [0, T) (validated).
// t = tok[p], prev = tok[p - 1] (-1 for p = 0), loaded by the caller.
__device__ __forceinline__ void token_boundary(int t, int prev, int p, int N, int T, int* __restrict__ toff) {
  for (int u = prev + 1; u <= t; ++u) toff[u] = p;
  if (p == N - 1)
    for (int u = t + 1; u <= T; ++u) toff[u] = N;
}

// The pairs [p0, p1) of warp w of this block (empty past N).
struct Segment {
  int p0, p1;
  __device__ Segment(int N, int seg) {
    const std::int64_t s = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const std::int64_t a = s * seg, b = a + seg;
    p0 = static_cast<int>(a < N ? a : N);
    p1 = static_cast<int>(b < N ? b : N);
  }
};

__global__ void __launch_bounds__(32 * kWarps)
    meta_count_kernel(const int* __restrict__ tok, const int* __restrict__ exp, int N, int T, int E, int seg,
                      int* __restrict__ blk_counts, int* __restrict__ toff) {
  extern __shared__ int hist_all[];  // [kWarps][E]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int* h = hist_all + w * E;
  for (int e = lane; e < E; e += 32) h[e] = 0;
  __syncwarp();
  const Segment sg(N, seg);
  for (int c = sg.p0; c < sg.p1; c += 32 * kChunk) {
    int ev[kChunk], tv[kChunk], pv[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      ev[i] = p < sg.p1 ? exp[p] : -1;
      tv[i] = p < sg.p1 ? tok[p] : -1;
      pv[i] = p < sg.p1 && p > 0 ? tok[p - 1] : -1;
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int p = c + 32 * i + lane;
      if (p < sg.p1) {
        atomicAdd(&h[ev[i]], 1);
        token_boundary(tv[i], pv[i], p, N, T, toff);
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int sum = 0;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) sum += hist_all[v * E + e];
    blk_counts[static_cast<std::int64_t>(blockIdx.x) * E + e] = sum;
  }
}

// One block of 1024 threads per 8 experts: thread (r, x) = (threadIdx.x / 8, threadIdx.x % 8) holds the rows
// [r per, (r + 1) per) (per <= 8) of expert 8 blockIdx.x + x in registers (one sector per 8 lanes). Warp x scans
// expert x's 128 row-group sums; the rows are rewritten as running prefixes. One round trip of loads.
// Capacity: counts[e] = min(sum, cap); demand (when given) the sum, and dropped[0] += the excess (zeroed before).
__global__ void __launch_bounds__(1024, 1)
    meta_colscan_kernel(int* __restrict__ blk_counts, int B, int E, int* __restrict__ counts, int cap,
                        int* __restrict__ demand, int* __restrict__ dropped) {
  __shared__ int tot[8][129];
  const int x = threadIdx.x & 7, r = threadIdx.x >> 3;
  const int e = blockIdx.x * 8 + x;
  const int per = (B + 127) / 128;
  const int b0 = r * per, n = e < E ? max(0, min(per, B - b0)) : 0;  // this thread's rows
  int* col = blk_counts + b0 * E + e;  // B * E <= 1024 * 512: int offsets
  int v[8];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = i < n ? col[i * E] : 0;
    sum += v[i];
  }
  tot[x][r] = sum;
  __syncthreads();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (w < 8) {  // warp w: exclusive scan of expert w's 128 sums, 4 per lane
    int q[4], a = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = tot[w][4 * lane + j];
      a += q[j];
    }
    int incl = a;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    int run = incl - a;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      tot[w][4 * lane + j] = run;
      run += q[j];
    }
    const int ew = blockIdx.x * 8 + w;
    if (lane == 31 && ew < E) {
      const int kept = min(incl, cap);
      counts[ew] = kept;
      if (demand) {
        demand[ew] = incl;
        if (incl > kept) atomicAdd(dropped, incl - kept);
      }
    }
  }
  __syncthreads();
  int run = tot[x][r];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (i < n) col[i * E] = run;
    run += v[i];
  }
}

// v[2 threadIdx.x + i] (0 past E): a per-expert array (counts, a block's prefixes) loaded early, two experts per
// thread, in the order block_offsets and the scatter's prefix loop use.
__device__ __forceinline__ void load_two_experts(const int* __restrict__ v, int E, int (&out)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = 2 * static_cast<int>(threadIdx.x) + i;
    out[i] = e < E ? v[e] : 0;
  }
}

// offs[e] = exclusive scan of counts over experts (E <= 512 = 2 per thread, `in` from load_two_experts);
// block 0 also stores offsets.
__device__ __forceinline__ void block_offsets(const int (&in)[2], int E, int* offs, int* __restrict__ offsets) {
  using Scan = cub::BlockScan<int, 32 * kWarps>;
  __shared__ typename Scan::TempStorage scan_tmp;
  int vals[2] = {in[0], in[1]}, out[2], total;
  Scan(scan_tmp).ExclusiveSum(vals, out, total);
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

// Every global read the block needs before its first store is issued at the start (counts, this block's
// prefixes, the warp's first 32 pairs), so the chain to the stores is one round trip. 8 resident blocks per SM.
// kCapacity: counts are the kept counts; a pair whose position in its expert is >= cap gets rev = -1 and no row.
template <bool kCapacity>
__global__ void __launch_bounds__(32 * kWarps, 8)
    meta_scatter_kernel(const int* __restrict__ tok, const int* __restrict__ exp, int N, int E, int seg,
                        const int* __restrict__ blk_prefix, const int* __restrict__ counts,
                        int* __restrict__ offsets, int* __restrict__ pair, int* __restrict__ gather,
                        int* __restrict__ rev, int cap) {
  extern __shared__ int sm[];  // offs[E], then per warp its segment's counts, turned into its cursors
  __shared__ int wexp_all[kWarps][32];
  int* offs = sm;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const Segment sg(N, seg);
  int cin[2], pre[2];
  load_two_experts(counts, E, cin);
  load_two_experts(blk_prefix + static_cast<std::int64_t>(blockIdx.x) * E, E, pre);
  int p = sg.p0 + lane;
  int ev = p < sg.p1 ? exp[p] : -1, tv = p < sg.p1 ? tok[p] : -1;
  int* cursor = sm + E + w * E;
  for (int e = lane; e < E; e += 32) cursor[e] = 0;
  __syncwarp();
  if (p < sg.p1) atomicAdd(&cursor[ev], 1);
  for (int q = p + 32; q < sg.p1; q += 32) atomicAdd(&cursor[exp[q]], 1);  // segments longer than 32 pairs
  block_offsets(cin, E, offs, offsets);  // ends with __syncthreads: every warp's counts are in place
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // exclusive prefix over the block's segments
    const int e = 2 * static_cast<int>(threadIdx.x) + i;
    if (e >= E) continue;
    int run = offs[e] + pre[i];
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      int* q = sm + E + v * E + e;
      const int c = *q;
      *q = run;
      run += c;
    }
  }
  __syncthreads();
  int* wexp = wexp_all[w];
  for (int c = sg.p0; c < sg.p1; c += 32) {
    if (c != sg.p0) {
      p = c + lane;
      ev = p < sg.p1 ? exp[p] : -1;
      tv = p < sg.p1 ? tok[p] : -1;
    }
    // rank = earlier lanes with the same expert, n = all of them (a compare loop over the warp's experts in
    // shared memory: its cost does not grow with the number of distinct experts, unlike __match_any_sync).
    wexp[lane] = ev;
    __syncwarp();
    int rank = 0, n = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
      const bool same = wexp[l] == ev;
      rank += same && l < lane;
      n += same;
    }
    const int row = p < sg.p1 ? cursor[ev] + rank : 0;
    __syncwarp();  // every lane has read its cursor before the group's last lane advances it
    if (p < sg.p1) {
      if (!kCapacity || row - offs[ev] < cap) {  // offs: the kept counts' offsets; row - offs[ev]: the position
        pair[row] = p;
        gather[row] = tv;
        rev[p] = row;
      } else {
        rev[p] = -1;
      }
      if (rank == n - 1) cursor[ev] += n;
    }
    __syncwarp();
  }
}

}  // namespace

namespace detail {
RoutingMetadata empty_metadata(const Context& ctx, std::int64_t N, std::int64_t T, std::int64_t E,
                               std::int64_t scratch_ints, Tensor* scratch, bool capacity) {
  RoutingMetadata m;
  m.num_tokens = T;
  m.num_experts = E;
  m.num_pairs = N;
  ArrayPack pack;
  pack.add(&m.counts, {E}, DType::i32);
  pack.add(&m.offsets, {E + 1}, DType::i32);
  for (Tensor* rows : {&m.pair, &m.gather, &m.rev}) pack.add(rows, {N}, DType::i32);
  pack.add(&m.token_offsets, {T + 1}, DType::i32);
  if (capacity) {
    pack.add(&m.demand, {E}, DType::i32);
    pack.add(&m.dropped, {1}, DType::i32);
  }
  if (scratch_ints > 0) pack.add(scratch, {scratch_ints}, DType::i32);
  pack.allocate(ctx);
  return m;
}

}  // namespace detail

namespace {
using detail::empty_metadata;

}  // namespace

RoutingMetadata detail::zero_metadata(const Context& ctx, std::int64_t T, std::int64_t E, bool capacity) {
  RoutingMetadata m = empty_metadata(ctx, 0, T, E, 0, nullptr, capacity);
  if (capacity) {
    SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.demand.data(), 0, m.demand.nbytes(), stream_of(ctx)));
    SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.dropped.data(), 0, m.dropped.nbytes(), stream_of(ctx)));
  }
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.counts.data(), 0, m.counts.nbytes(), stream_of(ctx)));
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.offsets.data(), 0, m.offsets.nbytes(), stream_of(ctx)));
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.token_offsets.data(), 0, m.token_offsets.nbytes(), stream_of(ctx)));
  return m;
}

namespace {
using detail::zero_metadata;

// Steps 2 and 3 (colscan, scatter) once blk_counts[blocks][E] holds the per-block counts of segments of
// `seg` pairs (and token_offsets is written). capacity >= 0: at most that many rows per expert (m.demand and
// m.dropped allocated; dropped is zeroed here).
void scan_and_scatter(const Context& ctx, const RoutingMetadata& m, const int* tok, const int* exp, int seg,
                      int blocks, int* blk_counts, std::int64_t capacity = -1) {
  cudaStream_t s = stream_of(ctx);
  const int N = static_cast<int>(m.num_pairs), E = static_cast<int>(m.num_experts);
  const bool capped = capacity >= 0;
  const int cap = capped ? static_cast<int>(std::min<std::int64_t>(capacity, N)) : N;
  if (capped) SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.dropped.data(), 0, sizeof(int), s));
  meta_colscan_kernel<<<(E + 7) / 8, 1024, 0, s>>>(blk_counts, blocks, E, m.counts.ptr<int>(), cap,
                                                   capped ? m.demand.ptr<int>() : nullptr,
                                                   capped ? m.dropped.ptr<int>() : nullptr);
  SONICMOE_CUDA_CHECK_LAUNCH();
  auto scatter = capped ? meta_scatter_kernel<true> : meta_scatter_kernel<false>;
  scatter<<<blocks, 32 * kWarps, (kWarps + 1) * sizeof(int) * E, s>>>(
      tok, exp, N, E, seg, blk_counts, m.counts.ptr<const int>(), m.offsets.ptr<int>(), m.pair.ptr<int>(),
      m.gather.ptr<int>(), m.rev.ptr<int>(), cap);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  if (N == 0) return zero_metadata(ctx, T, E);
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  // Segments of a multiple of 32 pairs, as short as kMaxBlocks blocks of kWarps segments allow.
  constexpr std::int64_t kMaxSegments = std::int64_t{kMaxBlocks} * kWarps;
  const int seg = static_cast<int>(32 * ((N + 32 * kMaxSegments - 1) / (32 * kMaxSegments)));
  const int S = static_cast<int>((N + seg - 1) / seg);
  const int blocks = (S + kWarps - 1) / kWarps;
  Tensor blk;
  RoutingMetadata m = empty_metadata(ctx, N, T, E, std::int64_t{blocks} * E, &blk);
  meta_count_kernel<<<blocks, 32 * kWarps, kWarps * sizeof(int) * E, stream_of(ctx)>>>(
      tok, exp, static_cast<int>(N), static_cast<int>(T), static_cast<int>(E), seg, blk.ptr<int>(),
      m.token_offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  scan_and_scatter(ctx, m, tok, exp, seg, blocks, blk.ptr<int>());
  return m;
}

RoutingMetadata topk_routing(const Context& ctx, const TensorView& logits, std::int64_t k,
                             const TensorView& topk_expert, const TensorView& topk_score,
                             const TensorView& pair_token, const RouterSpec& router) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1], N = T * k;
  if (N == 0) return zero_metadata(ctx, T, E, router.has_capacity());
  const detail::TopkGrid grid = detail::topk_grid(ctx, T, E);
  Tensor blk;
  RoutingMetadata m = empty_metadata(ctx, N, T, E, std::int64_t{grid.blocks} * E, &blk, router.has_capacity());
  detail::TopkOutputs out;
  out.pair_token = pair_token.ptr<int>();
  out.token_offsets = m.token_offsets.ptr<int>();
  out.block_counts = blk.ptr<int>();
  detail::launch_topk(ctx, logits, static_cast<int>(k), grid, topk_expert.ptr<int>(), topk_score.ptr<float>(), out,
                      router);
  // A top-K block owns tokens_per_warp tokens per warp: its warps' segments are tokens_per_warp * k pairs.
  scan_and_scatter(ctx, m, pair_token.ptr<const int>(), topk_expert.ptr<const int>(),
                   static_cast<int>(grid.tokens_per_warp * k), grid.blocks, blk.ptr<int>(),
                   router.has_capacity() ? router.expert_capacity(T, k, E) : -1);
  return m;
}

}  // namespace sonicmoe::cuda

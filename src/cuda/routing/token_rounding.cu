// GPU token rounding (DESIGN.md section 4), bitwise equal to ref::token_rounding on the same logits.
//
// Every (expert e, token t) gets one 64-bit rank key:
//   bit 63      1 if t picked e in its top-K (pickers rank first)
//   bits 62-32  the float bits of the pair's score: the renormalised top-K score for a picker, the full
//               softmax probability otherwise (both >= 0, so their bit patterns order like the values)
//   bits 31-0   ~t (ties go to the lower token id)
// Keys are unique per expert, so "the c best tokens of expert e" is exactly the set of keys >= the c-th
// largest key, which one block per expert finds by a radix select. The candidates' order never matters, so
// the result is deterministic, and the probabilities use exp_f32 (core/exp_f32.h) and the reference's
// summation order, so they match the CPU bit for bit.
//
// Pipeline (all on ctx.stream):
//   topk_softmax -> plan: c_e = rounded count, counts, offsets, N = sum c_e (copied to pinned host memory)
//   -> rank keys [E, T] (one warp per token) -> select: per expert the threshold, then the kept tokens as a
//   bitmask keep[E][W] (W = 32-token words) and each word's row prefix within the expert
//   -> kept pairs per token -> token_offsets (CUB exclusive scan) -> [host waits for N, allocates the pair
//   arrays] -> pairs and metadata written directly, one warp per 32-token word.
// The host waits for N only after the ranking work is queued, so the GPU stays busy across that
// synchronisation. Token-rounding routing is not CUDA-graph capturable (the pair arrays are sized [N] on
// the host); top-K and general routing are.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>
#include <mutex>
#include <unordered_map>

#include "core/cuda_check.h"
#include "core/exp_f32.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_limits.h"
#include "cuda/launch_util.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

constexpr unsigned kPickedBit = 0x80000000u;
constexpr int kSelectThreads = 1024;
constexpr int kMaxCandidates = 4096;  // select: token list once few keys match the radix prefix

// The rows expert e keeps from its top-K count f (the reference's rounded_count).
__device__ __forceinline__ int rounded_count(int f, int tile, int mode, int T) {
  const int down = f / tile * tile;
  const int up = (f + tile - 1) / tile * tile;
  int c = down;
  if (mode == static_cast<int>(RoutingMode::round_up)) c = up;
  if (mode == static_cast<int>(RoutingMode::round_nearest)) c = 2 * (f - down) >= tile ? up : down;
  return c < T ? c : T;
}

// counts[e] = c_e, offsets = exclusive scan (offsets[E] = N). One block of 512 threads, E <= 512.
__global__ void __launch_bounds__(kMaxExperts) plan_kernel(const int* __restrict__ topk_counts, int E, int T,
                                                            int tile, int mode, int* __restrict__ counts,
                                                            int* __restrict__ offsets) {
  using Scan = cub::BlockScan<int, kMaxExperts>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = threadIdx.x;
  const int c = e < E ? rounded_count(topk_counts[e], tile, mode, T) : 0;
  int ex, total;
  Scan(tmp).ExclusiveSum(c, ex, total);
  if (e < E) {
    counts[e] = c;
    offsets[e] = ex;
  }
  if (e == 0) offsets[E] = total;
}

// key_hi[e * T + t] = picked flag | score bits. One warp per token, its row in registers (lane l owns experts
// l, l+32, ...); the softmax denominator is summed in the reference's order (ref::softmax_denominator:
// per-lane partial sums, then an xor butterfly), so the probabilities match the CPU bit for bit. A block
// handles kRankTokens tokens and stages their keys in shared memory as [E][kRankTokens + 1] so that the
// global writes of the expert-major key array are 128-byte runs.
constexpr int kRankWarps = 8, kRankTokens = 32;

template <int P>
__global__ void __launch_bounds__(32 * kRankWarps)
    rank_keys_kernel(const float* __restrict__ L, const int* __restrict__ ids, const float* __restrict__ ts, int T,
                     int E, int K, unsigned* __restrict__ key_hi) {
  extern __shared__ unsigned tile[];  // [E][kRankTokens + 1]
  constexpr int kLd = kRankTokens + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.x * kRankTokens;
  for (int j = warp; j < kRankTokens; j += kRankWarps) {
    const int t = t0 + j;
    if (t >= T) break;
    const float* row = L + static_cast<std::int64_t>(t) * E;
    float v[P];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int e = lane + 32 * i;
      v[i] = e < E ? row[e] : -INFINITY;
      mx = fmaxf(mx, v[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      v[i] = lane + 32 * i < E ? exp_f32(v[i] - mx) : 0.0f;  // v becomes exp(l - max)
      if (lane + 32 * i < E) sum += v[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
    // The token's K choices (K <= 32): bit i of `picked` marks expert lane + 32 i, its score in sc[i].
    const int my_id = lane < K ? ids[static_cast<std::int64_t>(t) * K + lane] : -1;
    const float my_sc = lane < K ? ts[static_cast<std::int64_t>(t) * K + lane] : 0.0f;
    unsigned picked = 0;
    float sc[P];
#pragma unroll
    for (int i = 0; i < P; ++i) sc[i] = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int id = __shfl_sync(0xffffffffu, my_id, k);
      const float s = __shfl_sync(0xffffffffu, my_sc, k);
      if ((id & 31) == lane) {
#pragma unroll
        for (int i = 0; i < P; ++i)
          if (id >> 5 == i) {
            picked |= 1u << i;
            sc[i] = s;
          }
      }
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int e = lane + 32 * i;
      if (e < E) {
        const bool pk = (picked >> i) & 1u;
        const float q = pk ? sc[i] : v[i] / sum;
        tile[e * kLd + j] = (pk ? kPickedBit : 0u) | __float_as_uint(q);
      }
    }
  }
  __syncthreads();
  const int n_tok = min(kRankTokens, T - t0);
  for (int i = threadIdx.x; i < E * kRankTokens; i += blockDim.x) {
    const int e = i / kRankTokens, j = i - e * kRankTokens;
    if (j < n_tok) key_hi[static_cast<std::int64_t>(e) * T + t0 + j] = tile[e * kLd + j];
  }
}

__device__ __forceinline__ unsigned long long rank_key(const unsigned* key_hi, int t) {
  return (static_cast<unsigned long long>(key_hi[t]) << 32) | (0xffffffffu - static_cast<unsigned>(t));
}

// Warp 0 finds the digit d holding the need-th largest key (bins scanned from 255 down, 8 per lane).
__device__ __forceinline__ void find_digit(const int* hist, int need, int& digit, int& above) {
  const int lane = threadIdx.x & 31;
  int b[8], local = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    b[i] = hist[255 - 8 * lane - i];
    local += b[i];
  }
  int incl = local;  // keys in bins above and including this lane's eight
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  const int excl = incl - local;
  const unsigned hit = __ballot_sync(0xffffffffu, excl < need && incl >= need);
  const int src = __ffs(hit) - 1;  // need <= T = total keys, so some lane holds the crossing
  int d = 0, a = 0;
  if (lane == src) {
    a = excl;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (a + b[i] >= need) {
        d = 255 - 8 * lane - i;
        break;
      }
      a += b[i];
    }
  }
  digit = __shfl_sync(0xffffffffu, d, src);
  above = __shfl_sync(0xffffffffu, a, src);
}

// One block per expert: the threshold of the c best keys (8-bit radix select over the 64-bit keys; the
// expert's T key words are staged in shared memory when they fit; once at most kMaxCandidates keys match
// the prefix, later passes walk a list of those tokens instead of all T), then keep[e][w] = bitmask of the kept
// tokens of word w and wprefix[e][w] = kept tokens of e in words before w.
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(const unsigned* __restrict__ key_hi, const int* __restrict__ counts, int T, int W, bool staged,
                  unsigned* __restrict__ keep, int* __restrict__ wprefix) {
  extern __shared__ unsigned s_keys[];
  __shared__ int hist[256];
  __shared__ int cand[kMaxCandidates];
  __shared__ unsigned long long s_prefix;
  __shared__ int s_need, s_done, s_nmatch, s_nlist;
  const int e = blockIdx.x;
  const unsigned* keys = key_hi + static_cast<std::int64_t>(e) * T;
  if (staged) {
#pragma unroll 8
    for (int t = threadIdx.x; t < T; t += blockDim.x) s_keys[t] = keys[t];
    __syncthreads();
    keys = s_keys;
  }
  const int c = counts[e];
  unsigned long long thr = 0;  // keep keys >= thr (all of them when c == T; none when c == 0, below)
  if (c > 0 && c < T) {
    if (threadIdx.x == 0) {
      s_prefix = 0;
      s_need = c;
    }
    unsigned long long mask = 0;
    bool compact = false;  // iterate over the candidate list instead of all T tokens
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      const unsigned long long prefix = s_prefix;
      const int n = compact ? s_nlist : T;
      for (int base = 0; base < n; base += blockDim.x) {  // whole warps iterate together
        const int i = base + static_cast<int>(threadIdx.x);
        const int t = i < n ? (compact ? cand[i] : i) : 0;
        const unsigned long long k = i < n ? rank_key(keys, t) : 0ull;
        const bool match = i < n && (k & mask) == prefix;
        const unsigned d = static_cast<unsigned>(k >> shift) & 0xffu;
        // Warp-aggregated histogram: lanes with the same digit add once (keys of one expert cluster in a
        // few exponent bins, so plain shared atomics would serialise).
        const unsigned active = __ballot_sync(0xffffffffu, match);
        if (match) {
          const unsigned peers = __match_any_sync(active, d);
          if ((__ffs(peers) - 1) == (threadIdx.x & 31)) atomicAdd(&hist[d], __popc(peers));
        }
      }
      __syncthreads();
      if (threadIdx.x < 32) {
        const int need = s_need;
        int d, above;
        find_digit(hist, need, d, above);
        if (threadIdx.x == 0) {
          s_prefix = prefix | (static_cast<unsigned long long>(d) << shift);
          s_need = need - above;
          s_done = hist[d] == need - above;  // every key of this bin is kept: the threshold is the bin's floor
          s_nmatch = hist[d];                // keys matching the new prefix
        }
      }
      __syncthreads();
      mask |= 0xffull << shift;
      const bool done = s_done;
      const bool make_list = !compact && s_nmatch <= kMaxCandidates;
      const unsigned long long pre = s_prefix;
      __syncthreads();  // every thread has read the shared decisions before thread 0 writes them again
      if (done) break;
      if (make_list) {
        // Few keys match the prefix now: list their tokens once (any order: only counts are taken from them).
        if (threadIdx.x == 0) s_nlist = 0;
        __syncthreads();
        for (int base = 0; base < T; base += blockDim.x) {
          const int t = base + static_cast<int>(threadIdx.x);
          const bool m = t < T && (rank_key(keys, t) & mask) == pre;
          const unsigned bal = __ballot_sync(0xffffffffu, m);
          int slot0 = 0;
          if ((threadIdx.x & 31) == 0 && bal) slot0 = atomicAdd(&s_nlist, __popc(bal));
          slot0 = __shfl_sync(0xffffffffu, slot0, 0);
          if (m) cand[slot0 + __popc(bal & ((1u << (threadIdx.x & 31)) - 1u))] = t;
        }
        __syncthreads();
        compact = true;
      }
    }
    thr = s_prefix;
  }
  // Kept-token bitmask, one word per 32 tokens (tokens past T are not kept).
  unsigned* kw = keep + static_cast<std::int64_t>(e) * W;
  for (int base = 0; base < 32 * W; base += blockDim.x) {
    const int t = base + static_cast<int>(threadIdx.x);
    const bool kept = t < T && c > 0 && rank_key(keys, t) >= thr;
    const unsigned word = __ballot_sync(0xffffffffu, kept);
    if ((threadIdx.x & 31) == 0 && t < 32 * W) kw[t >> 5] = word;
  }
  __syncthreads();  // the block's bitmask stores are visible to the whole block
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  int* wp = wprefix + static_cast<std::int64_t>(e) * W;
  for (int base = 0; base < W; base += blockDim.x) {
    const int w = base + static_cast<int>(threadIdx.x);
    int ex, total;
    Scan(scan_tmp).ExclusiveSum(w < W ? __popc(kw[w]) : 0, ex, total);
    const int run = carry;
    if (w < W) wp[w] = run + ex;
    __syncthreads();
    if (threadIdx.x == 0) carry = run + total;
    __syncthreads();
  }
}

// cnt[t] = kept pairs of token t (cnt[T] = 0, so that an exclusive scan of T + 1 ends with N). One warp per
// 32-token word: lane l loads the words of experts l, l+32, ... (all loads first), then token j's count is
// the number of lanes' words with bit j set, summed over the expert groups.
__global__ void kept_per_token_kernel(const unsigned* __restrict__ keep, int T, int E, int W, int* __restrict__ cnt) {
  const int lane = threadIdx.x & 31;
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (w == 0 && lane == 0) cnt[T] = 0;
  if (w >= W) return;
  unsigned word[kMaxExperts / 32];
#pragma unroll
  for (int g = 0; g < kMaxExperts / 32; ++g) {
    const int e = 32 * g + lane;
    word[g] = e < E ? keep[static_cast<std::int64_t>(e) * W + w] : 0u;
  }
  int n = 0;
#pragma unroll
  for (int g = 0; g < kMaxExperts / 32; ++g) {
    if (32 * g >= E) break;
    for (int j = 0; j < 32; ++j) {
      const int c = __popc(__ballot_sync(0xffffffffu, (word[g] >> j) & 1u));
      if (lane == j) n += c;
    }
  }
  if (32 * w + lane < T) cnt[32 * w + lane] = n;
}

// Pairs in token order, then expert id (the reference's order), and the metadata. One block per 32-token
// word, one warp per group of 32 experts (lane = expert). Token j's kept experts in a group are the lanes
// with bit j set; they take consecutive pairs after the token's cursor (token_offsets[t] + the token's kept
// pairs in earlier groups, from the block's per-group counts), and rows offsets[e] + wprefix[e][w] + (kept
// tokens of e before t in the word). The top-K slot of a picked pair comes from a per-warp [token][lane]
// map built from the word's top-K ids.
// Dynamic shared memory of write_pairs_kernel with G = ceil(E / 32) warps: ids [32][32] and cntg [G][32] (int),
// then per warp its key tile [32][33] (unsigned) and slot map [32][32] (signed char).
std::size_t write_pairs_smem(int G) {
  return sizeof(int) * (32 * 32 + 32 * G) + G * (sizeof(unsigned) * 32 * 33 + 32 * 32);
}

__global__ void __launch_bounds__(512)
    write_pairs_kernel(const unsigned* __restrict__ keep, const int* __restrict__ wprefix,
                       const unsigned* __restrict__ key_hi, const int* __restrict__ ids,
                       const int* __restrict__ offsets, const int* __restrict__ toff, int T, int E, int K, int W,
                       int* __restrict__ ptok, int* __restrict__ pexp, float* __restrict__ pscore,
                       int* __restrict__ pslot, int* __restrict__ pair, int* __restrict__ gather,
                       int* __restrict__ rev) {
  extern __shared__ int smem[];
  const int G = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
  const int w = blockIdx.x, t0 = 32 * w;
  int* wid = smem;                                                   // [32 tokens][K] top-K ids
  int* cntg = wid + 32 * 32;                                         // [G][32 tokens] kept pairs per group
  unsigned(*tile)[33] = reinterpret_cast<unsigned(*)[33]>(cntg + 32 * G) + 32 * g;  // [32 experts][32 tokens]
  signed char(*slot_map)[32] =
      reinterpret_cast<signed char(*)[32]>(reinterpret_cast<unsigned*>(cntg + 32 * G) + G * 32 * 33) + 32 * g;
  const std::int64_t id0 = static_cast<std::int64_t>(t0) * K, id_end = static_cast<std::int64_t>(T) * K;
  for (int i = threadIdx.x; i < 32 * K; i += blockDim.x) wid[i] = id0 + i < id_end ? ids[id0 + i] : -1;
  const int e = 32 * g + lane;
  const unsigned word = e < E ? keep[static_cast<std::int64_t>(e) * W + w] : 0u;
  int mine = 0;  // lane j: kept pairs of token t0 + j in this group
  for (int j = 0; j < 32; ++j) {
    const int c = __popc(__ballot_sync(0xffffffffu, (word >> j) & 1u));
    if (lane == j) mine = c;
  }
  cntg[32 * g + lane] = mine;
  __syncthreads();
  const unsigned rows = __ballot_sync(0xffffffffu, word != 0u);
  if (rows == 0u) return;  // no kept pair of this group in this word
  int cur = 0;             // lane j: next pair of token t0 + j
  if (t0 + lane < T) {
    cur = toff[t0 + lane];
    for (int v = 0; v < g; ++v) cur += cntg[32 * v + lane];
  }
  // Stage the keys of the experts that keep something here (all loads issued before any store), and the
  // slot map: slot_map[j][l] = k if token j's k-th choice is expert 32 g + l, else -1.
  unsigned kv[32];
#pragma unroll
  for (int i = 0; i < 32; ++i)
    kv[i] = ((rows >> i) & 1u) && t0 + lane < T ? key_hi[static_cast<std::int64_t>(32 * g + i) * T + t0 + lane] : 0u;
#pragma unroll
  for (int i = 0; i < 32; ++i) tile[i][lane] = kv[i];
#pragma unroll
  for (int j = 0; j < 32; ++j) slot_map[j][lane] = -1;
  __syncwarp();
  for (int i = lane; i < 32 * K; i += 32) {
    const int id = wid[i] - 32 * g;
    if (id >= 0 && id < 32) slot_map[i / K][id] = static_cast<signed char>(i % K);
  }
  __syncwarp();
  const int row0 = e < E ? offsets[e] + wprefix[static_cast<std::int64_t>(e) * W + w] : 0;
  for (int j = 0; j < 32; ++j) {
    const bool bit = (word >> j) & 1u;
    const unsigned m = __ballot_sync(0xffffffffu, bit);
    if (m == 0u) continue;
    const int base = __shfl_sync(0xffffffffu, cur, j);
    if (bit) {
      const int p = base + __popc(m & ((1u << lane) - 1u));
      const int row = row0 + __popc(word & ((1u << j) - 1u));
      const unsigned k = tile[lane][j];
      const int t = t0 + j;
      ptok[p] = t;
      pexp[p] = e;
      pscore[p] = __uint_as_float(k & ~kPickedBit);
      pslot[p] = (k & kPickedBit) ? slot_map[j][lane] : -1;
      rev[p] = row;
      pair[row] = p;
      gather[row] = t;
    }
  }
}

// Up to this size the select kernel stages every token key in shared memory (allow_dynamic_smem raises its limit).
constexpr std::size_t kMaxStagedKeyBytes = 128 * 1024;  // T <= 32768 tokens staged per expert block

// Pinned host word + event per (thread, device) for reading N back without draining the stream.
struct HostCounter {
  int* value = nullptr;
  cudaEvent_t ready = nullptr;
};
HostCounter& host_counter(int device) {
  thread_local std::unordered_map<int, HostCounter> counters;
  HostCounter& h = counters[device];
  if (!h.value) {
    SONICMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&h.value), sizeof(int), cudaHostAllocDefault));
    SONICMOE_CUDA_CHECK(cudaEventCreateWithFlags(&h.ready, cudaEventDisableTiming));
  }
  return h;
}

void launch_rank_keys(const Context& ctx, const TensorView& logits, const Routing& r, int T, int E, int K,
                      unsigned* key_hi) {
  const std::size_t smem = sizeof(unsigned) * static_cast<std::size_t>(E) * (kRankTokens + 1);
  auto kernel = E <= 32    ? rank_keys_kernel<1>
                : E <= 64  ? rank_keys_kernel<2>
                : E <= 128 ? rank_keys_kernel<4>
                : E <= 256 ? rank_keys_kernel<8>
                           : rank_keys_kernel<16>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<static_cast<unsigned>((T + kRankTokens - 1) / kRankTokens), 32 * kRankWarps, smem, stream_of(ctx)>>>(
      logits.ptr<const float>(), r.topk_expert.ptr<const int>(), r.topk_score.ptr<const float>(), T, E, K, key_hi);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  const Device dev = ctx.device();
  cudaStream_t s = stream_of(ctx);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  SONICMOE_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
  SONICMOE_CHECK(capture == cudaStreamCaptureStatusNone,
                 "sonicmoe::token_rounding (cuda): cannot be captured in a CUDA graph (the number of pairs is read "
                 "back to size the routing); capture top-K or general routing instead");
  Routing r;
  r.mode = mode;
  r.top_k = k;
  r.topk_expert = Tensor::empty({T, k}, DType::i32, dev, ctx.allocator, ctx.stream);
  r.topk_score = Tensor::empty({T, k}, DType::f32, dev, ctx.allocator, ctx.stream);
  Tensor topk_counts = workspace(ctx, E, DType::i32);
  cuda::topk_softmax(ctx, logits, k, r.topk_expert, r.topk_score, topk_counts, RouterSpec{});

  const int Ti = static_cast<int>(T), Ei = static_cast<int>(E), Ki = static_cast<int>(k);
  const int W = static_cast<int>((T + 31) / 32);
  std::size_t scan_bytes = 0;
  SONICMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const int*>(nullptr),
                                                    static_cast<int*>(nullptr), Ti + 1, s));
  // Arrays whose sizes do not depend on N, in one allocation: metadata (kept) and scratch (this call only).
  ArrayPack meta_pack, work_pack;
  const int i_counts = meta_pack.add({E}, DType::i32), i_offsets = meta_pack.add({E + 1}, DType::i32),
            i_toff = meta_pack.add({T + 1}, DType::i32);
  const int i_key = work_pack.add({T * E}, DType::i32), i_keep = work_pack.add({E * W}, DType::i32),
            i_wpre = work_pack.add({E * W}, DType::i32), i_cnt = work_pack.add({T + 1}, DType::i32),
            i_tmp = work_pack.add({static_cast<std::int64_t>((scan_bytes + 3) / 4)}, DType::i32);
  const std::vector<Tensor> mt = meta_pack.allocate(ctx), wk = work_pack.allocate(ctx);
  RoutingMetadata& m = r.meta;
  m.num_tokens = T;
  m.num_experts = E;
  m.counts = mt[i_counts];
  m.offsets = mt[i_offsets];
  m.token_offsets = mt[i_toff];
  unsigned* key_hi = wk[i_key].ptr<unsigned>();
  unsigned* keep = wk[i_keep].ptr<unsigned>();
  int* wprefix = wk[i_wpre].ptr<int>();
  int* cnt = wk[i_cnt].ptr<int>();

  plan_kernel<<<1, kMaxExperts, 0, s>>>(topk_counts.ptr<const int>(), Ei, Ti, static_cast<int>(tile),
                                        static_cast<int>(mode), m.counts.ptr<int>(), m.offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  HostCounter& hc = host_counter(ctx.device_index);
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(hc.value, m.offsets.ptr<int>() + E, sizeof(int), cudaMemcpyDeviceToHost, s));
  SONICMOE_CUDA_CHECK(cudaEventRecord(hc.ready, s));
  if (T > 0) {
    launch_rank_keys(ctx, logits, r, Ti, Ei, Ki, key_hi);
    const std::size_t key_bytes = sizeof(unsigned) * static_cast<std::size_t>(T);
    const bool staged = key_bytes <= kMaxStagedKeyBytes;
    if (staged) allow_dynamic_smem(reinterpret_cast<const void*>(select_kernel), key_bytes);
    select_kernel<<<Ei, kSelectThreads, staged ? key_bytes : 0, s>>>(key_hi, m.counts.ptr<const int>(), Ti, W, staged,
                                                                      keep, wprefix);
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  kept_per_token_kernel<<<blocks_for(32 * static_cast<std::int64_t>(W), 256), 256, 0, s>>>(keep, Ti, Ei, W, cnt);
  SONICMOE_CUDA_CHECK_LAUNCH();
  SONICMOE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(wk[i_tmp].data(), scan_bytes, cnt, m.token_offsets.ptr<int>(),
                                                    Ti + 1, s));
  // The one host synchronisation: N sizes the Routing's pair tensors. The ranking work above is already
  // queued, so the GPU keeps running while the host waits for the plan's copy.
  SONICMOE_CUDA_CHECK(cudaEventSynchronize(hc.ready));
  const std::int64_t N = *hc.value;
  m.num_pairs = N;
  ArrayPack pair_pack;  // the [N] arrays, in this order in one allocation
  for (Tensor* a : {&r.pair_token, &r.pair_expert, &r.pair_score, &r.pair_slot, &m.pair, &m.gather, &m.rev})
    pair_pack.add(a, {N}, a == &r.pair_score ? DType::f32 : DType::i32);
  pair_pack.allocate(ctx);
  if (N > 0) {
    const int G = (Ei + 31) / 32;
    const std::size_t wsm = write_pairs_smem(G);
    allow_dynamic_smem(reinterpret_cast<const void*>(write_pairs_kernel), wsm);
    write_pairs_kernel<<<W, 32 * G, wsm, s>>>(
        keep, wprefix, key_hi, r.topk_expert.ptr<const int>(), m.offsets.ptr<const int>(),
        m.token_offsets.ptr<const int>(), Ti, Ei, Ki, W, r.pair_token.ptr<int>(), r.pair_expert.ptr<int>(),
        r.pair_score.ptr<float>(), r.pair_slot.ptr<int>(), m.pair.ptr<int>(), m.gather.ptr<int>(),
        m.rev.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  return r;
}

}  // namespace sonicmoe::cuda

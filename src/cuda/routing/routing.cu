// GPU routing stages (issue 4): router logits (cuBLAS), fused top-K softmax + histogram, routing
// metadata (stable radix sort on expert ids), aux loss, router backward and router weight grads.
// Everything is enqueued on ctx.stream; no host synchronisation (CUDA-graph capturable).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <algorithm>
#include <climits>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/cuda_check.h"
#include "core/exp_f32.h"
#include "cuda/cuda_backend.h"
#include "sonicmoe/error.h"

#define SONICMOE_CUBLAS_CHECK(call)                                                                    \
  do {                                                                                                 \
    cublasStatus_t st_ = (call);                                                                       \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                  \
      throw ::sonicmoe::Error(std::string("cuBLAS error ") + std::to_string(static_cast<int>(st_)) +  \
                              " in " #call " at " __FILE__ ":" + std::to_string(__LINE__));           \
  } while (0)

namespace sonicmoe::cuda {

namespace {

cudaStream_t stream_of(const Context& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// One cuBLAS handle per (thread, device), created lazily; the stream is set on every call.
cublasHandle_t cublas_handle(const Context& ctx) {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  auto it = handles.find(ctx.device_index);
  if (it == handles.end()) {
    cublasHandle_t h;
    SONICMOE_CUBLAS_CHECK(cublasCreate(&h));
    it = handles.emplace(ctx.device_index, h).first;
  }
  SONICMOE_CUBLAS_CHECK(cublasSetStream(it->second, stream_of(ctx)));
  return it->second;
}

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

int blocks_for(std::int64_t n, int threads) {
  std::int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

// ---- top-K softmax ----------------------------------------------------------------------------
// One warp per token; lane l holds experts l, l+32, ... (P per lane, E <= 32 P <= 512). A logit is
// mapped to an order-preserving uint32 (0 = taken); each round the warp takes the max key with
// redux.sync and, among equal keys, the lowest expert id (the reference's tie rule). Only the winning
// lane rescans its P values, so a round costs two warp reductions, one shuffle and one short scan.
constexpr int kMaxPerLane = 16;

__device__ __forceinline__ unsigned order_key(float v) {
  if (v == 0.0f) v = 0.0f;  // -0 == +0 in the reference's comparison
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // finite logits never map to 0
}

template <int P>
__device__ __forceinline__ void lane_best(const unsigned (&key)[P], unsigned& bk, int& bi) {
  bk = 0;
  bi = 0;
#pragma unroll
  for (int i = 0; i < P; ++i)
    if (key[i] > bk) {  // strict: the lowest index (= lowest id) wins ties
      bk = key[i];
      bi = i;
    }
}

template <int P>
__global__ void topk_softmax_kernel(const float* __restrict__ logits, int T, int E, int K,
                                    int* __restrict__ ids, float* __restrict__ scores, int* __restrict__ counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < T; t += gridDim.x * warps) {
    const float* row = logits + static_cast<std::int64_t>(t) * E;
    unsigned key[P];
    float val[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int e = lane + 32 * i;
      val[i] = e < E ? row[e] : 0.0f;
      key[i] = e < E ? order_key(val[i]) : 0u;
    }
    unsigned bk;
    int bi;
    lane_best(key, bk, bi);
    float sel_v = 0.0f;
    int sel_i = 0;
    for (int j = 0; j < K; ++j) {
      const unsigned wk = __reduce_max_sync(0xffffffffu, bk);
      const unsigned wid =
          __reduce_min_sync(0xffffffffu, bk == wk ? static_cast<unsigned>(lane + 32 * bi) : 0xffffffffu);
      const int wl = static_cast<int>(wid & 31u);
      float wv = 0.0f;
      if (lane == wl) {
#pragma unroll
        for (int i = 0; i < P; ++i)
          if (i == bi) {
            wv = val[i];
            key[i] = 0u;
          }
        lane_best(key, bk, bi);
      }
      wv = __shfl_sync(0xffffffffu, wv, wl);
      if (lane == j) {
        sel_v = wv;
        sel_i = static_cast<int>(wid);
      }
    }
    // Softmax over the K selected, in the reference's order (max is the first selection).
    const float mx = __shfl_sync(0xffffffffu, sel_v, 0);
    const float ex = lane < K ? exp_f32(sel_v - mx) : 0.0f;  // bitwise as the reference
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, ex, j);  // sequential, like the reference
    if (lane < K) {
      ids[static_cast<std::int64_t>(t) * K + lane] = sel_i;
      scores[static_cast<std::int64_t>(t) * K + lane] = ex / sum;
      atomicAdd(&hist[sel_i], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

__global__ void pair_token_kernel(int* __restrict__ pt, std::int64_t n, int k) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    pt[i] = static_cast<int>(i / k);
}

// ---- metadata by CUB radix sort (kept to measure against the counting sort below) -------------
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

// Exclusive scan of counts[E] into offsets[E+1], one block (E is small).
__global__ void scan_kernel(const int* __restrict__ counts, int E, int* __restrict__ offsets) {
  __shared__ int warp_sums[32];
  __shared__ int carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int c = e < E ? counts[e] : 0;
    int x = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[w] = x;
    __syncthreads();
    if (w == 0) {
      int s = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += y;
      }
      warp_sums[lane] = s;  // inclusive
    }
    __syncthreads();
    const int incl = x + (w > 0 ? warp_sums[w - 1] : 0) + carry;
    if (e < E) offsets[e] = incl - c;
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = incl;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[E] = carry;
}

__global__ void iota_kernel(int* __restrict__ v, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    v[i] = static_cast<int>(i);
}

__global__ void finish_metadata_kernel(const int* __restrict__ pair, const int* __restrict__ tok, std::int64_t n,
                                       int* __restrict__ gather, int* __restrict__ rev) {
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < n;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int p = pair[r];
    gather[r] = tok[p];
    rev[p] = static_cast<int>(r);
  }
}

// ---- metadata by a segmented counting sort (the default) -------------------------------------
// The N pairs are cut into S segments of `seg` pairs. (1) seg_count: per-segment expert histograms.
// (2) seg_scan (one block): counts[e] = sum over segments, offsets = exclusive scan over experts, and
// seg_prefix[s][e] = rows of expert e in segments before s. (3) seg_scatter: one warp per segment walks
// its pairs in order, 32 at a time; lanes with the same expert (__match_any_sync) take consecutive rows
// after the segment's cursor. Rows of one expert therefore follow increasing p (a stable sort, bitwise the
// reference's), positions never depend on atomic ordering, and a call is 4 launches (with token_offsets).
constexpr int kScatterWarps = 4;

__global__ void seg_count_kernel(const int* __restrict__ exp, int N, int E, int seg, int* __restrict__ seg_counts) {
  extern __shared__ int h[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int p0 = blockIdx.x * seg, p1 = min(N, p0 + seg);
  for (int base = p0; base < p1; base += blockDim.x) {  // whole warps iterate together
    const int p = base + static_cast<int>(threadIdx.x);
    const bool valid = p < p1;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    if (valid) {  // one shared atomic per distinct expert in the warp (skewed routing would serialise)
      const int e = exp[p];
      const unsigned peers = __match_any_sync(mask, e);
      if (__popc(peers & ((1u << (threadIdx.x & 31)) - 1u)) == 0) atomicAdd(&h[e], __popc(peers));
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) seg_counts[static_cast<std::int64_t>(blockIdx.x) * E + e] = h[e];
}

__global__ void seg_scan_kernel(int* __restrict__ seg_prefix, int S, int E, int* __restrict__ counts,
                                int* __restrict__ offsets) {
  extern __shared__ int sm[];  // [S][E] segment counts (staged with coalesced loads), then [E] totals
  int* tot = sm + S * E;
  for (int i = threadIdx.x; i < S * E; i += blockDim.x) sm[i] = seg_prefix[i];
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int s = 0; s < S; ++s) {
      const int v = sm[s * E + e];
      sm[s * E + e] = run;
      run += v;
    }
    tot[e] = run;
    counts[e] = run;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < S * E; i += blockDim.x) seg_prefix[i] = sm[i];
  if (threadIdx.x == 0) {  // E <= 512: a sequential scan over shared memory
    int run = 0;
    for (int e = 0; e < E; ++e) {
      offsets[e] = run;
      run += tot[e];
    }
    offsets[E] = run;
  }
}

__global__ void __launch_bounds__(32 * kScatterWarps)
    seg_scatter_kernel(const int* __restrict__ tok, const int* __restrict__ exp, int N, int E, int seg, int S,
                       const int* __restrict__ seg_prefix, const int* __restrict__ offsets, int* __restrict__ pair,
                       int* __restrict__ gather, int* __restrict__ rev) {
  extern __shared__ int cursor_all[];  // [kScatterWarps][E]
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int s = blockIdx.x * kScatterWarps + w;
  if (s >= S) return;  // whole warps leave together
  int* cursor = cursor_all + w * E;
  for (int e = lane; e < E; e += 32) cursor[e] = offsets[e] + seg_prefix[static_cast<std::int64_t>(s) * E + e];
  __syncwarp();
  const int p0 = s * seg, p1 = min(N, p0 + seg);
  for (int base = p0; base < p1; base += 32) {
    const int p = base + lane;
    const bool valid = p < p1;
    const unsigned mask = __ballot_sync(0xffffffffu, valid);
    if (valid) {
      const int e = exp[p];
      const unsigned peers = __match_any_sync(mask, e);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int row = cursor[e] + rank;
      pair[row] = p;
      gather[row] = tok[p];
      rev[p] = row;
      __syncwarp(mask);  // every lane has read its cursor before the group's leader advances it
      if (rank == 0) cursor[e] += __popc(peers);
    }
    __syncwarp();
  }
}

// token_offsets[t] = first p with tok[p] >= t (lower bound; tok is non-decreasing).
__global__ void token_offsets_kernel(const int* __restrict__ tok, std::int64_t n, int T, int* __restrict__ toff) {
  for (std::int64_t t = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; t <= T;
       t += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) >> 1;
      if (tok[mid] < t) lo = mid + 1;
      else hi = mid;
    }
    toff[t] = static_cast<int>(lo);
  }
}

// ---- softmax row statistics (max, sum of exp) and aux loss -------------------------------------
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// stats[t] = (max, sum_e exp(l - max)), one warp per row.
__global__ void row_stats_kernel(const float* __restrict__ L, int T, int E, float2* __restrict__ stats) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int t = blockIdx.x * warps + (threadIdx.x >> 5); t < T; t += gridDim.x * warps) {
    const float* row = L + static_cast<std::int64_t>(t) * E;
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    float s = 0.0f;
    for (int e = lane; e < E; e += 32) s += expf(row[e] - m);
    s = warp_sum(s);
    if (lane == 0) stats[t] = make_float2(m, s);
  }
}

constexpr int kAuxChunk = 64;  // tokens per partial column sum

// partial[c, e] = sum over the chunk's tokens of softmax[t, e] (fixed order: deterministic).
__global__ void softmax_colsum_kernel(const float* __restrict__ L, const float2* __restrict__ stats, int T, int E,
                                      float* __restrict__ partial) {
  const int c = blockIdx.x;
  const int t0 = c * kAuxChunk, t1 = min(T, t0 + kAuxChunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.0f;
    for (int t = t0; t < t1; ++t) {
      const float2 st = stats[t];
      acc += expf(L[static_cast<std::int64_t>(t) * E + e] - st.x) / st.y;
    }
    partial[static_cast<std::int64_t>(c) * E + e] = acc;
  }
}

// One block: P_e = sum of partials (double), loss = E * sum_e (P_e/T)(f_e/F).
__global__ void aux_finish_kernel(const float* __restrict__ partial, int chunks, const int* __restrict__ counts,
                                  int T, int E, float* __restrict__ out) {
  __shared__ double red[1024];
  __shared__ double Fs;
  double f = 0.0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) f += counts[e];
  red[threadIdx.x] = f;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) Fs = red[0];
  __syncthreads();
  const double F = Fs;
  double loss = 0.0;
  if (F > 0)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      double P = 0.0;
      for (int c = 0; c < chunks; ++c) P += partial[static_cast<std::int64_t>(c) * E + e];
      loss += (P / T) * (counts[e] / F);
    }
  __syncthreads();
  red[threadIdx.x] = loss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = static_cast<float>(static_cast<double>(E) * red[0]);
}

// ---- router backward --------------------------------------------------------------------------
// daux[e] = d_aux * E * f_e / (T F)  (0 when F == 0 or d_aux == 0).
__global__ void daux_kernel(const int* __restrict__ counts, int T, int E, float d_aux, float* __restrict__ daux) {
  __shared__ double Fs;
  if (threadIdx.x == 0) {
    double F = 0;
    for (int e = 0; e < E; ++e) F += counts[e];
    Fs = F;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    daux[e] = (d_aux != 0.0f && Fs > 0)
                  ? static_cast<float>(d_aux * static_cast<double>(E) * counts[e] / (static_cast<double>(T) * Fs))
                  : 0.0f;
}

constexpr int kBwdWarps = 4;

// One warp per token; shared per warp: row[E] (dq, then the output row) and dk[16].
__global__ void router_backward_kernel(const float* __restrict__ L, const int* __restrict__ toff,
                                       const int* __restrict__ pexp, const int* __restrict__ slot,
                                       const int* __restrict__ tids, const float* __restrict__ tsc,
                                       const float* __restrict__ ds, const float* __restrict__ daux, bool has_aux,
                                       int T, int E, int K, float* __restrict__ dl) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  float* row = smem + w * (E + 16);
  float* dk = row + E;
  for (int t = blockIdx.x * kBwdWarps + w; t < T; t += gridDim.x * kBwdWarps) {
    for (int e = lane; e < E; e += 32) row[e] = has_aux ? daux[e] : 0.0f;
    if (lane < 16) dk[lane] = 0.0f;
    __syncwarp();
    const int p0 = toff[t], p1 = toff[t + 1];
    int full = 0;
    for (int p = p0 + lane; p < p1; p += 32) {
      const int k = slot ? slot[p] : p - p0;
      if (k >= 0) {
        atomicAdd(&dk[k], ds[p]);  // one pair per slot: a plain add in effect
      } else {
        atomicAdd(&row[pexp[p]], ds[p]);  // one pair per (token, expert)
        full = 1;
      }
    }
    const bool any_full = has_aux || __any_sync(0xffffffffu, full);
    __syncwarp();
    const float* Lr = L + static_cast<std::int64_t>(t) * E;
    if (any_full) {
      float m = -INFINITY;
      for (int e = lane; e < E; e += 32) m = fmaxf(m, Lr[e]);
      m = warp_max(m);
      float s = 0.0f;
      for (int e = lane; e < E; e += 32) s += expf(Lr[e] - m);
      s = warp_sum(s);
      float qd = 0.0f;
      for (int e = lane; e < E; e += 32) qd += (expf(Lr[e] - m) / s) * row[e];
      qd = warp_sum(qd);
      for (int e = lane; e < E; e += 32) {
        const float q = expf(Lr[e] - m) / s;
        row[e] = q * (row[e] - qd);
      }
    } else {
      for (int e = lane; e < E; e += 32) row[e] = 0.0f;
    }
    __syncwarp();
    // K-way softmax part.
    const float sk = lane < K ? tsc[static_cast<std::int64_t>(t) * K + lane] : 0.0f;
    const float dkk = lane < K ? dk[lane] : 0.0f;
    const float dot = warp_sum(sk * dkk);
    if (lane < K) row[tids[static_cast<std::int64_t>(t) * K + lane]] += sk * (dkk - dot);
    __syncwarp();
    float* out = dl + static_cast<std::int64_t>(t) * E;
    for (int e = lane; e < E; e += 32) out[e] = row[e];
    __syncwarp();
  }
}

// dl2[t, 0:E] = bf16(dl), dl2[t, E:2E] = bf16(dl - bf16(dl)).
__global__ void split_bf16_kernel(const float* __restrict__ dl, std::int64_t T, int E,
                                  __nv_bfloat16* __restrict__ dl2) {
  const std::int64_t n = T * E;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E;
    const int e = static_cast<int>(i - t * E);
    const float v = dl[i];
    const __nv_bfloat16 hi = __float2bfloat16_rn(v);
    const __nv_bfloat16 lo = __float2bfloat16_rn(v - __bfloat162float(hi));
    dl2[t * 2 * E + e] = hi;
    dl2[t * 2 * E + E + e] = lo;
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, std::int64_t n, __nv_bfloat16* __restrict__ out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

Tensor workspace(const Context& ctx, std::int64_t n, DType dt) {
  return Tensor::empty({n < 1 ? 1 : n}, dt, ctx.device(), ctx.allocator, ctx.stream);
}

// The metadata's arrays, allocated (not filled) on ctx's stream.
RoutingMetadata empty_metadata(const Context& ctx, std::int64_t N, std::int64_t T, std::int64_t E) {
  const Device dev = ctx.device();
  RoutingMetadata m;
  m.num_tokens = T;
  m.num_experts = E;
  m.num_pairs = N;
  m.counts = Tensor::empty({E}, DType::i32, dev, ctx.allocator, ctx.stream);
  m.offsets = Tensor::empty({E + 1}, DType::i32, dev, ctx.allocator, ctx.stream);
  m.pair = Tensor::empty({N}, DType::i32, dev, ctx.allocator, ctx.stream);
  m.gather = Tensor::empty({N}, DType::i32, dev, ctx.allocator, ctx.stream);
  m.rev = Tensor::empty({N}, DType::i32, dev, ctx.allocator, ctx.stream);
  m.token_offsets = Tensor::empty({T + 1}, DType::i32, dev, ctx.allocator, ctx.stream);
  return m;
}

}  // namespace

void router_logits(const Context& ctx, const TensorView& x, const TensorView& router_weight,
                   const TensorView& logits) {
  const int T = static_cast<int>(x.shape[0]), H = static_cast<int>(x.shape[1]);
  const int E = static_cast<int>(router_weight.shape[0]);
  if (T == 0) return;
  const float alpha = 1.0f, beta = 0.0f;
  const cudaDataType_t ty = cuda_type(x.dtype);
  // Column-major: logits^T [E x T] = Wr^T (Wr is H x E col-major) * X^T (H x T col-major).
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(cublas_handle(ctx), CUBLAS_OP_T, CUBLAS_OP_N, E, T, H, &alpha,
                                     router_weight.data, ty, H, x.data, ty, H, &beta, logits.data, CUDA_R_32F, E,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void topk_softmax(const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts) {
  const int T = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
  SONICMOE_CHECK(E <= 32 * kMaxPerLane && k <= 32, "sonicmoe::topk_softmax (cuda): E <= 512, K <= 32");
  cudaStream_t s = stream_of(ctx);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(counts.data, 0, sizeof(int) * E, s));
  if (T == 0) return;
  constexpr int threads = 256;
  int dev_sms = 132;
  SONICMOE_CUDA_CHECK(cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, ctx.device_index));
  int blocks = (T + threads / 32 - 1) / (threads / 32);
  blocks = blocks < dev_sms * 32 ? blocks : dev_sms * 32;  // enough warps in flight to hide the row loads
  auto kernel = E <= 32    ? topk_softmax_kernel<1>
                : E <= 64  ? topk_softmax_kernel<2>
                : E <= 128 ? topk_softmax_kernel<4>
                : E <= 256 ? topk_softmax_kernel<8>
                           : topk_softmax_kernel<16>;
  kernel<<<blocks, threads, sizeof(int) * E, s>>>(logits.ptr<const float>(), T, E, static_cast<int>(k),
                                                  topk_expert.ptr<int>(), topk_score.ptr<float>(),
                                                  counts.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void topk_pair_token(const Context& ctx, std::int64_t k, const TensorView& pair_token) {
  const std::int64_t n = pair_token.numel();
  if (n == 0) return;
  pair_token_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(pair_token.ptr<int>(), n, static_cast<int>(k));
  SONICMOE_CUDA_CHECK_LAUNCH();
}

RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  SONICMOE_CHECK(E >= 1 && E <= 512, "sonicmoe::build_metadata (cuda): num_experts = ", E, ", expected 1..512");
  SONICMOE_CHECK(N < (std::int64_t{1} << 31) - 64, "sonicmoe::build_metadata (cuda): N = ", N, " pairs exceed int32");
  cudaStream_t s = stream_of(ctx);
  RoutingMetadata m = empty_metadata(ctx, N, T, E);
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  const int Ni = static_cast<int>(N), Ei = static_cast<int>(E);
  // Segments of at least 1024 pairs; at most 32768 / E of them, so that the [S][E] counts fit the scan's
  // shared memory (128 KB).
  const std::int64_t max_s = std::max<std::int64_t>(1, 32768 / E);
  const int seg = static_cast<int>(std::max<std::int64_t>(1024, (N + max_s - 1) / max_s));
  const int S = static_cast<int>((N + seg - 1) / seg);
  Tensor seg_prefix = workspace(ctx, static_cast<std::int64_t>(S) * E, DType::i32);
  const std::size_t e_smem = sizeof(int) * static_cast<std::size_t>(E);
  if (S > 0) {
    seg_count_kernel<<<S, 512, e_smem, s>>>(exp, Ni, Ei, seg, seg_prefix.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  const std::size_t scan_smem = sizeof(int) * (static_cast<std::size_t>(S) + 1) * E;
  if (scan_smem > 48 * 1024)
    SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(seg_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(scan_smem)));
  seg_scan_kernel<<<1, 1024, scan_smem, s>>>(seg_prefix.ptr<int>(), S, Ei, m.counts.ptr<int>(), m.offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  if (S > 0) {
    seg_scatter_kernel<<<(S + kScatterWarps - 1) / kScatterWarps, 32 * kScatterWarps, kScatterWarps * e_smem, s>>>(
        tok, exp, Ni, Ei, seg, S, seg_prefix.ptr<const int>(), m.offsets.ptr<const int>(), m.pair.ptr<int>(),
        m.gather.ptr<int>(), m.rev.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  token_offsets_kernel<<<blocks_for(T + 1, 256), 256, 0, s>>>(tok, N, static_cast<int>(T),
                                                              m.token_offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  return m;
}

RoutingMetadata build_metadata_radix_sort(const Context& ctx, const TensorView& pair_token,
                                          const TensorView& pair_expert, std::int64_t num_tokens,
                                          std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  cudaStream_t s = stream_of(ctx);
  RoutingMetadata m = empty_metadata(ctx, N, T, E);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.counts.data(), 0, sizeof(int) * static_cast<std::size_t>(E), s));
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  if (N > 0) {
    const std::size_t hist_smem = sizeof(int) * static_cast<std::size_t>(E);
    SONICMOE_CHECK(hist_smem <= 48 * 1024, "sonicmoe::build_metadata (cuda): E too large");
    histogram_kernel<<<blocks_for(N, 1024) < 264 ? blocks_for(N, 1024) : 264, 1024, hist_smem, s>>>(
        exp, N, static_cast<int>(E), m.counts.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  scan_kernel<<<1, 1024, 0, s>>>(m.counts.ptr<const int>(), static_cast<int>(E), m.offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  if (N > 0) {
    // Stable LSD radix sort of (expert, p) pairs: rows of one expert keep increasing p.
    Tensor iota = workspace(ctx, N, DType::i32);
    Tensor keys_out = workspace(ctx, N, DType::i32);
    iota_kernel<<<blocks_for(N, 256), 256, 0, s>>>(iota.ptr<int>(), N);
    SONICMOE_CUDA_CHECK_LAUNCH();
    int end_bit = 1;
    while ((std::int64_t{1} << end_bit) < E) ++end_bit;
    std::size_t temp_bytes = 0;
    SONICMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, exp, keys_out.ptr<int>(),
                                                        iota.ptr<const int>(), m.pair.ptr<int>(),
                                                        static_cast<int>(N), 0, end_bit, s));
    Tensor temp = workspace(ctx, static_cast<std::int64_t>((temp_bytes + 3) / 4), DType::i32);
    SONICMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, exp, keys_out.ptr<int>(),
                                                        iota.ptr<const int>(), m.pair.ptr<int>(),
                                                        static_cast<int>(N), 0, end_bit, s));
    finish_metadata_kernel<<<blocks_for(N, 256), 256, 0, s>>>(m.pair.ptr<const int>(), tok, N, m.gather.ptr<int>(),
                                                              m.rev.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  token_offsets_kernel<<<blocks_for(T + 1, 256), 256, 0, s>>>(tok, N, static_cast<int>(T),
                                                              m.token_offsets.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  return m;
}

void aux_loss(const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out) {
  const int T = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
  cudaStream_t s = stream_of(ctx);
  const int chunks = (T + kAuxChunk - 1) / kAuxChunk;
  Tensor stats = workspace(ctx, 2 * static_cast<std::int64_t>(T), DType::f32);
  Tensor partial = workspace(ctx, static_cast<std::int64_t>(chunks) * E, DType::f32);
  if (T > 0) {
    row_stats_kernel<<<blocks_for(T, 8), 256, 0, s>>>(logits.ptr<const float>(), T, E,
                                                      reinterpret_cast<float2*>(stats.data()));
    SONICMOE_CUDA_CHECK_LAUNCH();
    softmax_colsum_kernel<<<chunks, E < 256 ? 128 : 256, 0, s>>>(
        logits.ptr<const float>(), reinterpret_cast<const float2*>(stats.data()), T, E, partial.ptr<float>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  aux_finish_kernel<<<1, 1024, 0, s>>>(partial.ptr<const float>(), chunks, counts.ptr<const int>(), T, E,
                                       out.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void router_backward(const Context& ctx, const Routing& routing, const TensorView& dscore, float d_aux_loss,
                     const TensorView& dlogits) {
  const int T = static_cast<int>(routing.logits.size(0)), E = static_cast<int>(routing.logits.size(1));
  const int K = static_cast<int>(routing.top_k);
  SONICMOE_CHECK(K <= 16, "sonicmoe::router_backward (cuda): K <= 16");
  cudaStream_t s = stream_of(ctx);
  if (T == 0) return;
  Tensor daux = workspace(ctx, E, DType::f32);
  const bool has_aux = d_aux_loss != 0.0f;
  if (has_aux) {
    daux_kernel<<<1, 256, 0, s>>>(routing.meta.counts.ptr<const int>(), T, E, d_aux_loss, daux.ptr<float>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  const std::size_t smem = sizeof(float) * kBwdWarps * (E + 16);
  if (smem > 48 * 1024)
    SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(router_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
  const int* slot = routing.pair_slot.defined() ? routing.pair_slot.ptr<const int>() : nullptr;
  router_backward_kernel<<<blocks_for(T, kBwdWarps), 32 * kBwdWarps, smem, s>>>(
      routing.logits.ptr<const float>(), routing.meta.token_offsets.ptr<const int>(),
      routing.pair_expert.ptr<const int>(), slot, routing.topk_expert.ptr<const int>(),
      routing.topk_score.ptr<const float>(), dscore.ptr<const float>(), daux.ptr<const float>(), has_aux, T, E, K,
      dlogits.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

// dWr = dlogits^T X, dX += dlogits Wr.
// bf16 X / Wr: cuBLAS needs one input type, and rounding dlogits to bf16 alone loses ~3 significant digits
// before a long (T-term, cancelling) reduction. dlogits is therefore split exactly-enough into hi + lo
// bf16 parts (|dl - hi - lo| <= 2^-17 |dl|), which keeps the GEMM inputs bf16 (tensor cores) at
// fp32-level accuracy: dWr = hi^T X + lo^T X (two GEMMs into an f32 workspace, one rounding to bf16),
// dX = bf16(dX + [hi lo] [Wr; Wr]) (one GEMM with K = 2E and beta = 1: a single rounding of dX).
void router_weight_grad(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx) {
  const int T = static_cast<int>(x.shape[0]), H = static_cast<int>(x.shape[1]);
  const int E = static_cast<int>(router_weight.shape[0]);
  cudaStream_t s = stream_of(ctx);
  cublasHandle_t h = cublas_handle(ctx);
  const float one = 1.0f, zero = 0.0f;
  if (T == 0) {
    SONICMOE_CUDA_CHECK(cudaMemsetAsync(drouter.data, 0, drouter.nbytes(), s));
    return;
  }
  if (x.dtype == DType::f32) {
    SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, H, E, T, &one, x.data, CUDA_R_32F, H,
                                       dlogits.data, CUDA_R_32F, E, &zero, drouter.data, CUDA_R_32F, H,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, E, &one, router_weight.data, CUDA_R_32F,
                                       H, dlogits.data, CUDA_R_32F, E, &one, dx.data, CUDA_R_32F, H,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  Tensor dl2 = workspace(ctx, static_cast<std::int64_t>(T) * 2 * E, DType::bf16);
  split_bf16_kernel<<<blocks_for(static_cast<std::int64_t>(T) * E, 256), 256, 0, s>>>(
      dlogits.ptr<const float>(), T, E, dl2.ptr<__nv_bfloat16>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  // dWr (col-major H x E) = X^T (H x T) * dl (T x E); hi at column offset 0, lo at E, ld 2E.
  Tensor dw32 = workspace(ctx, static_cast<std::int64_t>(E) * H, DType::f32);
  const __nv_bfloat16* hi = dl2.ptr<const __nv_bfloat16>();
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, H, E, T, &one, x.data, CUDA_R_16BF, H, hi,
                                     CUDA_R_16BF, 2 * E, &zero, dw32.data(), CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, H, E, T, &one, x.data, CUDA_R_16BF, H, hi + E,
                                     CUDA_R_16BF, 2 * E, &one, dw32.data(), CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  f32_to_bf16_kernel<<<blocks_for(static_cast<std::int64_t>(E) * H, 256), 256, 0, s>>>(
      dw32.ptr<const float>(), static_cast<std::int64_t>(E) * H, drouter.ptr<__nv_bfloat16>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  // dX^T (H x T) += [Wr; Wr]^T (H x 2E) * dl2^T (2E x T).
  Tensor wr2 = workspace(ctx, static_cast<std::int64_t>(2) * E * H, DType::bf16);
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(wr2.data(), router_weight.data, router_weight.nbytes(),
                                      cudaMemcpyDeviceToDevice, s));
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(wr2.data()) + router_weight.nbytes(), router_weight.data,
                                      router_weight.nbytes(), cudaMemcpyDeviceToDevice, s));
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, 2 * E, &one, wr2.data(), CUDA_R_16BF, H,
                                     dl2.data(), CUDA_R_16BF, 2 * E, &one, dx.data, CUDA_R_16BF, H,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace sonicmoe::cuda

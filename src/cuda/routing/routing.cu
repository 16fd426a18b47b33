// GPU routing stages (issue 4): router logits (cuBLAS), fused top-K softmax + histogram, aux loss, router
// backward and router weight grads (metadata: metadata.cu; token rounding: token_rounding.cu).
// Everything is enqueued on ctx.stream; no host synchronisation (CUDA-graph capturable).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "core/cuda_check.h"
#include "core/exp_f32.h"
#include "core/router_math.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_limits.h"
#include "cuda/launch_util.h"
#include "cuda/routing/routing_detail.h"
#include "moe/router.h"
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

cudaDataType_t cuda_type(DType t) {
  return t == DType::bf16 ? CUDA_R_16BF : t == DType::f16 ? CUDA_R_16F : CUDA_R_32F;
}

// fp32 to the 16-bit storage type T (__nv_bfloat16 or __half) and back, rounded to nearest even.
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T round16(float v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else return __float2bfloat16_rn(v);
}

// ---- top-K softmax ----------------------------------------------------------------------------
// One warp per token; lane l holds experts l, l+32, ... (P per lane, E <= 32 P <= 512). A logit is mapped
// to an order-preserving uint32 (finite logits never map to 0) and each lane sorts its P (key, id) pairs
// (bitonic network: key descending, then id ascending). Each round the warp takes the max head key with
// redux.sync and, among equal keys, the lowest expert id (the reference's tie rule); the winning lane pops
// its head (a predicated shift: no divergence). The selected logit is decoded from the key, so a round is
// two warp reductions and a few selects.
constexpr int kMaxPerLane = 16;
static_assert(32 * kMaxPerLane >= kMaxExperts, "a warp holds every expert of a token (cuda_limits.h)");

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
// Softmax statistics of one row of E logits, over the warp (lane l reads e = l, l + 32, ...): (max, sum of
// exp(x - max)), the same in every lane.
__device__ __forceinline__ float2 warp_softmax_stats(const float* row, int E, int lane) {
  float m = -INFINITY;
  for (int e = lane; e < E; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  float s = 0.0f;
  for (int e = lane; e < E; e += 32) s += expf(row[e] - m);
  return make_float2(m, warp_sum(s));
}

__device__ __forceinline__ unsigned order_key(float v) {
  if (v == 0.0f) v = 0.0f;  // -0 == +0 in the reference's comparison
  const unsigned u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {  // inverse of order_key (-0 comes back as +0)
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <int P>
__device__ __forceinline__ void sort_lane(unsigned (&key)[P], int (&id)[P]) {
#pragma unroll
  for (int k = 2; k <= P; k <<= 1)
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1)
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const int l = i ^ j;
        if (l > i) {
          const bool rank_order = (i & k) == 0;  // this subsequence runs best-first
          const bool l_first = key[l] > key[i] || (key[l] == key[i] && id[l] < id[i]);
          if (l_first == rank_order) {
            const unsigned tk = key[i];
            key[i] = key[l];
            key[l] = tk;
            const int ti = id[i];
            id[i] = id[l];
            id[l] = ti;
          }
        }
      }
}

template <int P>
__device__ __forceinline__ void load_row(const float* __restrict__ logits, int t, int E, int lane, float (&v)[P]) {
  const float* row = logits + static_cast<std::int64_t>(t) * E;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? row[e] : 0.0f;
  }
}

// Router variants (detail::RouterArgs): the selection keys of one row, v = the lane's logits (experts lane + 32 i).
// s = softmax over all E (max, then the denominator in softmax_denominator's order: lane partials over i, then the
// xor butterfly: bitwise the reference) or sigmoid; key = s + bias; under group-limited selection the experts
// outside the topk_group best groups get key 0 (below every finite key). mx / den: the full softmax's statistics.
// wrow: this warp's E floats of shared memory (groups only).
template <int P>
__device__ __forceinline__ void router_keys(const float (&v)[P], int E, int lane, const detail::RouterArgs& ra,
                                            float* wrow, unsigned (&key)[P], float& mx, float& den) {
  float c[P];
  if (ra.score == RouterScore::topk_softmax) {
#pragma unroll
    for (int i = 0; i < P; ++i) c[i] = v[i];
  } else {
    if (ra.score == RouterScore::full_softmax) {
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (lane + 32 * i < E) m = fmaxf(m, v[i]);
      mx = warp_max(m);
      float part = 0.0f;
#pragma unroll
      for (int i = 0; i < P; ++i)
        if (lane + 32 * i < E) part += exp_f32(v[i] - mx);
      den = warp_sum(part);
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int e = lane + 32 * i;
      const float sc = ra.score == RouterScore::sigmoid ? sigmoid_f32(v[i]) : exp_f32(v[i] - mx) / den;
      c[i] = sc + (ra.bias && e < E ? ra.bias[e] : 0.0f);
    }
  }
  unsigned kept = 0xffffffffu;  // bit g: group g is kept
  int gs = E;
  if (ra.n_group > 1) {
    gs = E / ra.n_group;
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (lane + 32 * i < E) wrow[lane + 32 * i] = c[i];
    __syncwarp();
    float gsc = -INFINITY;
    if (lane < ra.n_group) {
      Top2 t2{-INFINITY, -INFINITY};
      for (int e = lane * gs; e < (lane + 1) * gs; ++e) t2.add(wrow[e]);
      gsc = t2.sum();
    }
    int rank = 0;
    for (int h = 0; h < ra.n_group; ++h) {
      const float o = __shfl_sync(0xffffffffu, gsc, h);
      rank += (o > gsc || (o == gsc && h < lane)) ? 1 : 0;
    }
    kept = __ballot_sync(0xffffffffu, lane < ra.n_group && rank < ra.topk_group);
    __syncwarp();  // wrow is rewritten by the next token
  }
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < E && ((kept >> (e / gs)) & 1u) ? order_key(c[i]) : 0u;
  }
}

// Warp g takes the contiguous tokens [g tpw, (g + 1) tpw) (TopkGrid), loading the next row while it selects from
// the current one. The block's expert histogram goes either to `counts` (atomics, once per block) or, with the
// pair outputs, whole to block_counts[blockIdx.x] (the metadata's per-block counts, no atomics).
// kRouter: a non-default router (ra): keys from router_keys, weights from its scores (the plain instance ignores ra).
template <int P, bool kRouter>
__global__ void __launch_bounds__(256)
    topk_softmax_kernel(const float* __restrict__ logits, int T, int E, int K, int tpw, int* __restrict__ ids,
                        float* __restrict__ scores, detail::TopkOutputs out, detail::RouterArgs ra) {
  extern __shared__ int hist[];  // [E] expert histogram, then (group-limited routers) 8 warps x E floats
  float* wrow = reinterpret_cast<float*>(hist + E) + (threadIdx.x >> 5) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int t0 = static_cast<int>(g * tpw < T ? g * tpw : T), t1 = min(T, t0 + tpw);
  float next[P];
  if (t0 < t1) load_row(logits, t0, E, lane, next);
  for (int t = t0; t < t1; ++t) {
    unsigned key[P];
    int id[P];
    float mx_s = 0.0f, den = 1.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      id[i] = lane + 32 * i;
      if constexpr (!kRouter) key[i] = id[i] < E ? order_key(next[i]) : 0u;
    }
    if constexpr (kRouter) router_keys(next, E, lane, ra, wrow, key, mx_s, den);
    if (t + 1 < t1) load_row(logits, t + 1, E, lane, next);
    sort_lane(key, id);
    unsigned sel_k = 0u, mx_k = 0u;
    int sel_i = 0;
    for (int j = 0; j < K; ++j) {
      const unsigned wk = __reduce_max_sync(0xffffffffu, key[0]);
      const unsigned wid = __reduce_min_sync(0xffffffffu, key[0] == wk ? static_cast<unsigned>(id[0]) : 0xffffffffu);
      if (id[0] == static_cast<int>(wid)) {  // the winner pops its head
#pragma unroll
        for (int i = 0; i + 1 < P; ++i) {
          key[i] = key[i + 1];
          id[i] = id[i + 1];
        }
        key[P - 1] = 0u;
        id[P - 1] = 0x7fffffff;
      }
      if (j == 0) mx_k = wk;
      if (lane == j) {
        sel_k = wk;
        sel_i = static_cast<int>(wid);
      }
    }
    // Softmax over the K selected, in the reference's order (max is the first selection).
    const float mx = key_value(mx_k);
    float ex = 0.0f;  // the pick's unnormalised weight
    if (lane < K) {
      if (!kRouter || ra.score == RouterScore::topk_softmax) {
        ex = exp_f32(key_value(sel_k) - mx);  // bitwise as the reference
      } else {  // the pick's score from its logit (the key holds score + bias)
        const float l = logits[static_cast<std::int64_t>(t) * E + sel_i];
        ex = ra.score == RouterScore::sigmoid ? sigmoid_f32(l) : exp_f32(l - mx_s) / den;
      }
    }
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, ex, j);  // sequential, like the reference
    float w = ex / sum;
    if constexpr (kRouter) {
      if (ra.score != RouterScore::topk_softmax)
        w = !ra.norm ? ex : ex / (ra.score == RouterScore::sigmoid ? sum + kSigmoidNormEps : sum);
      w *= ra.scale;
    }
    const std::int64_t p = static_cast<std::int64_t>(t) * K + lane;
    if (lane < K) {
      ids[p] = sel_i;
      scores[p] = w;
      atomicAdd(&hist[sel_i], 1);
      if (out.pair_token) out.pair_token[p] = t;
    }
    if (out.token_offsets && lane == 0) {
      out.token_offsets[t] = static_cast<int>(p);
      if (t == T - 1) out.token_offsets[T] = static_cast<int>(p + K);
    }
  }
  __syncthreads();
  if (out.block_counts) {
    int* bc = out.block_counts + static_cast<std::int64_t>(blockIdx.x) * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) bc[e] = hist[e];
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (hist[e]) atomicAdd(&out.counts[e], hist[e]);
  }
}

using TopkKernel = void (*)(const float*, int, int, int, int, int*, float*, detail::TopkOutputs, detail::RouterArgs);

// The instantiation for E experts (P = experts per lane) and its resident blocks of 256 threads per SM
// (computed once per instantiation, for the plain kernel: the grid of both instances).
template <int P>
std::pair<TopkKernel, int> topk_instance(bool router) {
  static const int per_sm = [] {
    int b = 0;
    SONICMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, topk_softmax_kernel<P, false>, 256,
                                                                      sizeof(int) * 32 * P));
    return b < 1 ? 1 : b;
  }();
  return {router ? topk_softmax_kernel<P, true> : topk_softmax_kernel<P, false>, per_sm};
}
std::pair<TopkKernel, int> topk_instance(std::int64_t E, bool router = false) {
  return E <= 32    ? topk_instance<1>(router)
         : E <= 64  ? topk_instance<2>(router)
         : E <= 128 ? topk_instance<4>(router)
         : E <= 256 ? topk_instance<8>(router)
                    : topk_instance<16>(router);
}

// ---- softmax row statistics (max, sum of exp) and aux loss -------------------------------------

constexpr int kAuxChunk = 64;  // tokens per partial column sum

// One block per chunk of kAuxChunk tokens: the warps first take the chunk's tokens' softmax statistics (max, sum of
// exp) into shared memory, then thread e sums column e: partial[c, e] = sum over the chunk's tokens of softmax[t, e],
// in token order (deterministic). The statistics were a kernel of their own (7 us and a launch at T = 32768, E = 64).
__global__ void softmax_colsum_kernel(const float* __restrict__ L, int T, int E, float* __restrict__ partial) {
  __shared__ float2 stats[kAuxChunk];
  const int c = blockIdx.x;
  const int t0 = c * kAuxChunk, t1 = min(T, t0 + kAuxChunk);
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int t = t0 + (threadIdx.x >> 5); t < t1; t += warps) {
    const float2 st = warp_softmax_stats(L + static_cast<std::int64_t>(t) * E, E, lane);
    if (lane == 0) stats[t - t0] = st;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float acc = 0.0f;
    for (int t = t0; t < t1; ++t) {
      const float2 st = stats[t - t0];
      acc += expf(L[static_cast<std::int64_t>(t) * E + e] - st.x) / st.y;
    }
    partial[static_cast<std::int64_t>(c) * E + e] = acc;
  }
}

// One block: P_e = sum of partials (double), loss = E * sum_e (P_e/T)(f_e/F). Each expert's column of partials is
// summed by G consecutive lanes (G = the largest power of two <= 32 with E * G <= blockDim.x; lane j takes chunks
// j, j + G, ...) and the G sums are combined by a fixed butterfly: deterministic, and the chunk loop is G times
// shorter than one thread per expert (it was 42 us at T = 32768, E = 128 on an H200, a latency-bound serial loop).
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
  int G = 32;
  while (G > 1 && E * G > static_cast<int>(blockDim.x)) G >>= 1;
  const int j = threadIdx.x % G;
  double loss = 0.0;
  // Every lane of a warp runs the same number of passes (the shuffles need them all).
  const int passes = (E * G + blockDim.x - 1) / blockDim.x;
  for (int pass = 0; pass < passes; ++pass) {
    const int e = (pass * blockDim.x + threadIdx.x) / G;
    double P = 0.0;
    if (e < E && F > 0) {
#pragma unroll 4
      for (int c = j; c < chunks; c += G) P += partial[static_cast<std::int64_t>(c) * E + e];
    }
    for (int o = G / 2; o > 0; o >>= 1) P += __shfl_xor_sync(0xffffffffu, P, o);
    if (j == 0 && e < E && F > 0) loss += (P / T) * (counts[e] / F);
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
// daux[e] = d_aux * E * f_e / (T F)  (0 when F == 0 or d_aux == 0); d_aux read from d_aux_device when given.
__global__ void daux_kernel(const int* __restrict__ counts, int T, int E, float d_aux_host,
                            const float* __restrict__ d_aux_device, float* __restrict__ daux) {
  const float d_aux = d_aux_device ? *d_aux_device : d_aux_host;
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
                                       int T, int E, int K, detail::RouterArgs ra, float* __restrict__ dl) {
  // w_k = c q_{e_k} (full softmax, not renormalised): the slots' gradients join dq and go through the full softmax.
  const bool via_full = ra.score == RouterScore::full_softmax && !ra.norm;
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
    __syncwarp();
    const int kid = lane < K ? tids[static_cast<std::int64_t>(t) * K + lane] : 0;
    const float dkk = lane < K ? dk[lane] : 0.0f;
    if (via_full && lane < K) row[kid] += ra.scale * dkk;  // distinct experts: one lane each
    const bool any_full = via_full || has_aux || __any_sync(0xffffffffu, full);
    __syncwarp();
    const float* Lr = L + static_cast<std::int64_t>(t) * E;
    if (any_full) {
      const float2 st = warp_softmax_stats(Lr, E, lane);
      const float m = st.x, s = st.y;
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
    if (ra.score == RouterScore::sigmoid) {
      // w_k = c u_k / (sum u + eps) (norm) or c u_k, u = sigmoid(logit): dl = du u (1 - u).
      const float u = lane < K ? sigmoid_f32(Lr[kid]) : 0.0f;
      const float S = warp_sum(u) + kSigmoidNormEps, dot = warp_sum(dkk * u);
      const float du = ra.norm ? (ra.scale / S) * (dkk - dot / S) : ra.scale * dkk;
      if (lane < K) row[kid] += du * u * (1.0f - u);
    } else if (!via_full) {
      // K-way softmax part (softmax over the K picks, or the renormalised full softmax: the same function),
      // p_k = w_k / c (exact for c = 1: the default's bits).
      const float sk = lane < K ? tsc[static_cast<std::int64_t>(t) * K + lane] / ra.scale : 0.0f;
      const float dks = dkk * ra.scale;
      const float dot = warp_sum(sk * dks);
      if (lane < K) row[kid] += sk * (dks - dot);
    }
    __syncwarp();
    float* out = dl + static_cast<std::int64_t>(t) * E;
    for (int e = lane; e < E; e += 32) out[e] = row[e];
    __syncwarp();
  }
}

// dl2[t, 0:E] = T(dl), dl2[t, E:2E] = T(dl - T(dl)) (T = bf16 or f16).
template <class T16>
__global__ void split_hi_lo_kernel(const float* __restrict__ dl, std::int64_t T, int E, T16* __restrict__ dl2) {
  const std::int64_t n = T * E;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / E;
    const int e = static_cast<int>(i - t * E);
    const float v = dl[i];
    const T16 hi = round16<T16>(v);
    const T16 lo = round16<T16>(v - to_f32(hi));
    dl2[t * 2 * E + e] = hi;
    dl2[t * 2 * E + E + e] = lo;
  }
}

// out[i] = Out(in[i] + in[n + i]): the hi and lo halves of dWr summed in fp32, rounded once to the 16-bit Out; or,
// Out = float (GradWrite::accumulate), out[i] += in[i] + in[n + i].
template <class Out>
__global__ void sum_halves_kernel(const float* __restrict__ in, std::int64_t n, Out* __restrict__ out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = in[i] + in[n + i];
    if constexpr (std::is_same_v<Out, float>) out[i] += v;
    else out[i] = round16<Out>(v);
  }
}

// The 16-bit router weight gradient of router_weight_grad below, in the storage type T16.
template <class T16>
void router_weight_grad_16(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                           const TensorView& router_weight, const TensorView& drouter, const TensorView& dx,
                           GradWrite dw_write) {
  const int T = static_cast<int>(x.shape[0]), H = static_cast<int>(x.shape[1]);
  const int E = static_cast<int>(router_weight.shape[0]);
  cudaStream_t s = stream_of(ctx);
  cublasHandle_t h = cublas_handle(ctx);
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t ty = cuda_type(x.dtype);
  Tensor dl2 = workspace(ctx, static_cast<std::int64_t>(T) * 2 * E, x.dtype);
  split_hi_lo_kernel<T16><<<blocks_for(static_cast<std::int64_t>(T) * E, 256), 256, 0, s>>>(
      dlogits.ptr<const float>(), T, E, dl2.ptr<T16>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  // [dWr_hi dWr_lo] (col-major H x 2E) = X^T (H x T) * [hi lo] (T x 2E): one GEMM reads X once; the halves are
  // summed in fp32 and rounded once.
  const std::int64_t EH = static_cast<std::int64_t>(E) * H;
  Tensor dw32 = workspace(ctx, 2 * EH, DType::f32);
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, H, 2 * E, T, &one, x.data, ty, H, dl2.data(), ty,
                                     2 * E, &zero, dw32.data(), CUDA_R_32F, H, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  if (dw_write == GradWrite::accumulate)
    sum_halves_kernel<float><<<blocks_for(EH, 256), 256, 0, s>>>(dw32.ptr<const float>(), EH, drouter.ptr<float>());
  else
    sum_halves_kernel<T16><<<blocks_for(EH, 256), 256, 0, s>>>(dw32.ptr<const float>(), EH, drouter.ptr<T16>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  // dX^T (H x T) += [Wr; Wr]^T (H x 2E) * dl2^T (2E x T).
  Tensor wr2 = workspace(ctx, static_cast<std::int64_t>(2) * E * H, x.dtype);
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(wr2.data(), router_weight.data, router_weight.nbytes(),
                                      cudaMemcpyDeviceToDevice, s));
  SONICMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(wr2.data()) + router_weight.nbytes(), router_weight.data,
                                      router_weight.nbytes(), cudaMemcpyDeviceToDevice, s));
  SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, 2 * E, &one, wr2.data(), ty, H, dl2.data(),
                                     ty, 2 * E, &one, dx.data, ty, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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

namespace detail {

TopkGrid topk_grid(const Context& ctx, std::int64_t T, std::int64_t E) {
  int sms = 132;
  SONICMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx.device_index));
  const std::int64_t cap = std::min<std::int64_t>(TopkGrid::kMaxBlocks, std::int64_t{sms} * topk_instance(E).second);
  const std::int64_t warps = std::max<std::int64_t>(1, cap * TopkGrid::kWarps);
  TopkGrid g;
  g.tokens_per_warp = static_cast<int>(std::max<std::int64_t>(1, (T + warps - 1) / warps));
  const std::int64_t per_block = std::int64_t{g.tokens_per_warp} * TopkGrid::kWarps;
  g.blocks = static_cast<int>(std::max<std::int64_t>(1, (T + per_block - 1) / per_block));
  return g;
}

RouterArgs router_args(const RouterSpec& r) {
  RouterArgs a;
  a.score = router_score_of(r);
  a.norm = r.norm_topk_probs;
  a.n_group = static_cast<int>(r.n_group);
  a.topk_group = static_cast<int>(r.topk_group);
  a.scale = r.routed_scaling_factor;
  a.bias = r.e_score_correction_bias.given() ? r.e_score_correction_bias.ptr<const float>() : nullptr;
  return a;
}

void launch_topk(const Context& ctx, const TensorView& logits, int k, const TopkGrid& grid, int* ids, float* scores,
                 const TopkOutputs& out, const RouterSpec& router) {
  const int T = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
  cudaStream_t s = stream_of(ctx);
  if (out.counts) SONICMOE_CUDA_CHECK(cudaMemsetAsync(out.counts, 0, sizeof(int) * E, s));
  if (T == 0) return;
  const bool variant = !router.scores_default();  // the capacity is the metadata's (topk_routing)
  const RouterArgs ra = router_args(router);
  const std::size_t smem = sizeof(int) * E + (ra.n_group > 1 ? sizeof(float) * TopkGrid::kWarps * E : 0);
  topk_instance(E, variant).first<<<grid.blocks, 32 * TopkGrid::kWarps, smem, s>>>(
      logits.ptr<const float>(), T, E, k, grid.tokens_per_warp, ids, scores, out, ra);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace detail

void topk_softmax(const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts, const RouterSpec& router) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  detail::TopkOutputs out;
  out.counts = counts.ptr<int>();
  detail::launch_topk(ctx, logits, static_cast<int>(k), detail::topk_grid(ctx, T, E), topk_expert.ptr<int>(),
                      topk_score.ptr<float>(), out, router);
}

void aux_loss(const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out) {
  const int T = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
  cudaStream_t s = stream_of(ctx);
  const int chunks = (T + kAuxChunk - 1) / kAuxChunk;
  Tensor partial = workspace(ctx, static_cast<std::int64_t>(chunks) * E, DType::f32);
  if (T > 0) {
    softmax_colsum_kernel<<<chunks, E < 256 ? 128 : 256, 0, s>>>(logits.ptr<const float>(), T, E, partial.ptr<float>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  aux_finish_kernel<<<1, 1024, 0, s>>>(partial.ptr<const float>(), chunks, counts.ptr<const int>(), T, E,
                                       out.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

void router_backward(const Context& ctx, const Routing& routing, const TensorView& dscore,
                     const AuxLossGrad& d_aux_grad, const TensorView& dlogits) {
  const float d_aux_loss = d_aux_grad.value;
  const float* d_aux_device = d_aux_grad.tensor.given() ? d_aux_grad.tensor.ptr<const float>() : nullptr;
  const int T = static_cast<int>(routing.logits.size(0)), E = static_cast<int>(routing.logits.size(1));
  const int K = static_cast<int>(routing.top_k);
  cudaStream_t s = stream_of(ctx);
  if (T == 0) return;
  Tensor daux = workspace(ctx, E, DType::f32);
  const bool has_aux = d_aux_device != nullptr || d_aux_loss != 0.0f;
  if (has_aux) {
    const Tensor& f = routing.meta.demand.defined() ? routing.meta.demand : routing.meta.counts;  // before capacity
    daux_kernel<<<1, 256, 0, s>>>(f.ptr<const int>(), T, E, d_aux_loss, d_aux_device,
                                  daux.ptr<float>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  const std::size_t smem = sizeof(float) * kBwdWarps * (E + 16);
  allow_dynamic_smem(reinterpret_cast<const void*>(router_backward_kernel), smem);
  const int* slot = routing.pair_slot.defined() ? routing.pair_slot.ptr<const int>() : nullptr;
  router_backward_kernel<<<blocks_for(T, kBwdWarps), 32 * kBwdWarps, smem, s>>>(
      routing.logits.ptr<const float>(), routing.meta.token_offsets.ptr<const int>(),
      routing.pair_expert.ptr<const int>(), slot, routing.topk_expert.ptr<const int>(),
      routing.topk_score.ptr<const float>(), dscore.ptr<const float>(), daux.ptr<const float>(), has_aux, T, E, K,
      detail::router_args(routing.router), dlogits.ptr<float>());
  SONICMOE_CUDA_CHECK_LAUNCH();
}

// dWr = dlogits^T X, dX += dlogits Wr.
// bf16 (or f16) X / Wr: cuBLAS needs one input type, and rounding dlogits to bf16 alone loses ~3 significant digits
// before a long (T-term, cancelling) reduction. dlogits is therefore split exactly-enough into hi + lo
// bf16 parts (|dl - hi - lo| <= 2^-17 |dl|), which keeps the GEMM inputs bf16 (tensor cores) at
// fp32-level accuracy: dWr = hi^T X + lo^T X (one GEMM with 2E columns into an f32 workspace, the two halves
// summed, one rounding to bf16), dX = bf16(dX + [hi lo] [Wr; Wr]) (one GEMM with K = 2E and beta = 1: a single
// rounding of dX). f16 splits the same way (|dl - hi - lo| <= 2^-22 |dl| within f16's range; values below 2^-14
// keep f16's subnormal spacing 2^-24, as PyTorch's f16 backward would, whose loss scaling keeps them in range).
void router_weight_grad(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx,
                        GradWrite dw_write) {
  const int T = static_cast<int>(x.shape[0]), H = static_cast<int>(x.shape[1]);
  const int E = static_cast<int>(router_weight.shape[0]);
  cudaStream_t s = stream_of(ctx);
  cublasHandle_t h = cublas_handle(ctx);
  const bool accumulate = dw_write == GradWrite::accumulate;  // drouter f32 (checked by the stage), added into
  const float one = 1.0f, zero = 0.0f;
  if (T == 0) {
    if (!accumulate) SONICMOE_CUDA_CHECK(cudaMemsetAsync(drouter.data, 0, drouter.nbytes(), s));
    return;
  }
  if (x.dtype == DType::f32) {
    SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, H, E, T, &one, x.data, CUDA_R_32F, H,
                                       dlogits.data, CUDA_R_32F, E, accumulate ? &one : &zero, drouter.data,
                                       CUDA_R_32F, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    SONICMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, H, T, E, &one, router_weight.data, CUDA_R_32F,
                                       H, dlogits.data, CUDA_R_32F, E, &one, dx.data, CUDA_R_32F, H,
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  if (x.dtype == DType::f16) router_weight_grad_16<__half>(ctx, dlogits, x, router_weight, drouter, dx, dw_write);
  else router_weight_grad_16<__nv_bfloat16>(ctx, dlogits, x, router_weight, drouter, dx, dw_write);
}

}  // namespace sonicmoe::cuda

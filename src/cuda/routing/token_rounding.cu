// GPU token rounding (DESIGN.md section 4), bitwise equal to ref::token_rounding on the same logits.
//
// Every (expert e, token t) gets one 64-bit rank key:
//   bit 63      1 if t picked e in its top-K (pickers rank first)
//   bits 62-32  the float bits of the pair's score: the renormalised top-K score for a picker, the full
//               softmax probability otherwise (both >= 0, so their bit patterns order like the values)
//   bits 31-0   ~t (ties go to the lower token id)
// Keys are unique per expert, so "the c best tokens of expert e" is exactly the set of keys >= the c-th
// largest key, which one block per expert finds by an 8-pass radix select. The candidates' order never
// matters, so the result is deterministic, and the probabilities use exp_f32 (core/exp_f32.h) and the
// reference's summation order, so they match the CPU bit for bit.
//
// Pipeline: topk_softmax -> rank keys [E, T] (one warp per token) -> radix select (one block per
// expert) -> kept pairs per token -> scan -> pairs in (token, expert) order -> build_metadata.
// The pair count N is read back to the host once (one stream synchronisation): the Routing's tensors are
// sized [N]. Token-rounding routing is therefore not CUDA-graph capturable; top-K and general are.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_scan.cuh>

#include "core/cuda_check.h"
#include "core/exp_f32.h"
#include "cuda/cuda_backend.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

constexpr unsigned kPickedBit = 0x80000000u;
constexpr int kSelectThreads = 1024;

cudaStream_t stream_of(const Context& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

int blocks_for(std::int64_t n, int threads) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

// The rows expert e keeps from its top-K count f (the reference's rounded_count).
__device__ __forceinline__ int rounded_count(int f, int tile, int mode, int T) {
  const int down = f / tile * tile;
  const int up = (f + tile - 1) / tile * tile;
  int c = down;
  if (mode == static_cast<int>(RoutingMode::round_up)) c = up;
  if (mode == static_cast<int>(RoutingMode::round_nearest)) c = 2 * (f - down) >= tile ? up : down;
  return c < T ? c : T;
}

// key_hi[e * T + t] = picked flag | score bits. One warp per token: lane l owns experts l, l+32, ...; the
// softmax denominator is summed in the reference's order (ref::softmax_denominator: per-lane partial sums,
// then an xor butterfly), so the probabilities match the CPU bit for bit. A block handles kRankTokens
// tokens and stages their keys in shared memory as [E][kRankTokens] so that the global writes of the
// expert-major key array are contiguous runs instead of 4-byte scatters.
constexpr int kRankWarps = 4, kRankTokens = 16;

__global__ void __launch_bounds__(32 * kRankWarps)
    rank_keys_kernel(const float* __restrict__ L, const int* __restrict__ ids, const float* __restrict__ ts, int T,
                     int E, int K, unsigned* __restrict__ key_hi) {
  extern __shared__ unsigned tile[];  // [E][kRankTokens + 1]
  __shared__ int s_ids[kRankWarps][16];
  __shared__ float s_ts[kRankWarps][16];
  constexpr int kLd = kRankTokens + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.x * kRankTokens;
  for (int j = warp; j < kRankTokens; j += kRankWarps) {
    const int t = t0 + j;
    if (t >= T) break;
    const float* row = L + static_cast<std::int64_t>(t) * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, row[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) sum += exp_f32(row[e] - mx);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum = sum + __shfl_xor_sync(0xffffffffu, sum, o);
    // The token's K choices, through shared memory (K <= 16).
    __syncwarp();
    if (lane < K) {
      s_ids[warp][lane] = ids[static_cast<std::int64_t>(t) * K + lane];
      s_ts[warp][lane] = ts[static_cast<std::int64_t>(t) * K + lane];
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) {
      float v = 0.0f;
      bool picked = false;
      for (int k = 0; k < K; ++k)
        if (s_ids[warp][k] == e) {
          picked = true;
          v = s_ts[warp][k];
        }
      if (!picked) v = exp_f32(row[e] - mx) / sum;
      tile[e * kLd + j] = (picked ? kPickedBit : 0u) | __float_as_uint(v);
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

// One block per expert: keep[e * T + t] = 1 for the c best tokens of expert e. The expert's T keys are
// first copied into shared memory when they fit (`staged`), so the up-to-8 radix passes read no global
// memory.
__global__ void __launch_bounds__(kSelectThreads) select_kernel(const unsigned* __restrict__ key_hi,
                                                                 const int* __restrict__ topk_counts, int T, int tile,
                                                                 int mode, bool staged,
                                                                 unsigned char* __restrict__ keep) {
  extern __shared__ unsigned s_keys[];
  __shared__ int hist[256];
  __shared__ unsigned long long s_prefix;
  __shared__ int s_need, s_done;
  const int e = blockIdx.x;
  const unsigned* keys = key_hi + static_cast<std::int64_t>(e) * T;
  if (staged) {
    for (int t = threadIdx.x; t < T; t += blockDim.x) s_keys[t] = keys[t];
    __syncthreads();
    keys = s_keys;
  }
  unsigned char* out = keep + static_cast<std::int64_t>(e) * T;
  const int c = rounded_count(topk_counts[e], tile, mode, T);
  unsigned long long thr = 0;  // keep keys >= thr (all of them when c == T; none when c == 0, below)
  if (c > 0 && c < T) {
    if (threadIdx.x == 0) {
      s_prefix = 0;
      s_need = c;
      s_done = 0;
    }
    unsigned long long mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      const unsigned long long prefix = s_prefix;
      for (int base = 0; base < T; base += blockDim.x) {  // whole warps iterate together
        const int t = base + static_cast<int>(threadIdx.x);
        const unsigned long long k = t < T ? rank_key(keys, t) : 0ull;
        const bool match = t < T && (k & mask) == prefix;
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
      if (threadIdx.x == 0) {
        int need = s_need, above = 0, d = 255;
        for (; d > 0; --d) {
          if (above + hist[d] >= need) break;
          above += hist[d];
        }
        s_prefix = prefix | (static_cast<unsigned long long>(d) << shift);
        s_need = need - above;
        s_done = hist[d] == need - above;  // every key of this bin is kept: the threshold is the bin's floor
      }
      __syncthreads();
      mask |= 0xffull << shift;
      if (s_done) break;
    }
    thr = s_prefix;
  }
  for (int t = threadIdx.x; t < T; t += blockDim.x) out[t] = c > 0 && rank_key(keys, t) >= thr;
}

__global__ void kept_per_token_kernel(const unsigned char* __restrict__ keep, int T, int E, int* __restrict__ cnt) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  int n = 0;
  for (int e = 0; e < E; ++e) n += keep[static_cast<std::int64_t>(e) * T + t];
  cnt[t] = n;
}

// Pairs in token order, then expert id (the reference's order). tok_end[t] = end of token t's pairs.
__global__ void write_pairs_kernel(const unsigned char* __restrict__ keep, const unsigned* __restrict__ key_hi,
                                   const int* __restrict__ ids, const int* __restrict__ cnt,
                                   const int* __restrict__ tok_end, int T, int E, int K, int* __restrict__ ptok,
                                   int* __restrict__ pexp, float* __restrict__ pscore, int* __restrict__ pslot) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  int p = tok_end[t] - cnt[t];
  const int* my_ids = ids + static_cast<std::int64_t>(t) * K;
  for (int e = 0; e < E; ++e) {
    const std::int64_t i = static_cast<std::int64_t>(e) * T + t;
    if (!keep[i]) continue;
    const unsigned k = key_hi[i];
    int slot = -1;
    if (k & kPickedBit)
      for (int j = 0; j < K; ++j)
        if (my_ids[j] == e) slot = j;
    ptok[p] = t;
    pexp[p] = e;
    pscore[p] = __uint_as_float(k & ~kPickedBit);
    pslot[p] = slot;
    ++p;
  }
}

// Dynamic shared memory above the default 48 KB needs an opt-in per kernel.
constexpr std::size_t kMaxStagedKeyBytes = 128 * 1024;  // T <= 32768 tokens staged per expert block
void opt_in_smem(const void* kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    SONICMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  SONICMOE_CHECK(T < (std::int64_t{1} << 31) / (E > 0 ? E : 1), "sonicmoe::token_rounding (cuda): T * E = ", T * E,
                 " exceeds the int32 index range");
  SONICMOE_CHECK(tile < (std::int64_t{1} << 30), "sonicmoe::token_rounding (cuda): tile = ", tile, " is too large");
  const Device dev = ctx.device();
  cudaStream_t s = stream_of(ctx);
  auto alloc = [&](std::int64_t n, DType dt) {
    return Tensor::empty({n}, dt, dev, ctx.allocator, ctx.stream);
  };
  Routing r;
  r.mode = mode;
  r.top_k = k;
  r.topk_expert = Tensor::empty({T, k}, DType::i32, dev, ctx.allocator, ctx.stream);
  r.topk_score = Tensor::empty({T, k}, DType::f32, dev, ctx.allocator, ctx.stream);
  Tensor topk_counts = alloc(E, DType::i32);
  cuda::topk_softmax(ctx, logits, k, r.topk_expert, r.topk_score, topk_counts);

  const int Ti = static_cast<int>(T), Ei = static_cast<int>(E), Ki = static_cast<int>(k);
  Tensor key_hi = alloc(std::max<std::int64_t>(T * E, 1), DType::i32);
  Tensor keep = alloc(std::max<std::int64_t>((T * E + 3) / 4, 1), DType::i32);  // bytes
  Tensor cnt = alloc(std::max<std::int64_t>(T, 1), DType::i32);
  Tensor tok_end = alloc(std::max<std::int64_t>(T, 1), DType::i32);
  std::int32_t n_pairs = 0;
  if (T > 0) {
    const std::size_t rank_smem = sizeof(unsigned) * static_cast<std::size_t>(E) * (kRankTokens + 1);
    opt_in_smem(reinterpret_cast<const void*>(rank_keys_kernel), rank_smem);
    rank_keys_kernel<<<static_cast<unsigned>((T + kRankTokens - 1) / kRankTokens), 32 * kRankWarps, rank_smem, s>>>(
        logits.ptr<const float>(), r.topk_expert.ptr<const int>(), r.topk_score.ptr<const float>(), Ti, Ei, Ki,
        key_hi.ptr<unsigned>());
    SONICMOE_CUDA_CHECK_LAUNCH();
    const std::size_t key_bytes = sizeof(unsigned) * static_cast<std::size_t>(T);
    const bool staged = key_bytes <= kMaxStagedKeyBytes;
    if (staged) opt_in_smem(reinterpret_cast<const void*>(select_kernel), key_bytes);
    select_kernel<<<Ei, kSelectThreads, staged ? key_bytes : 0, s>>>(
        key_hi.ptr<const unsigned>(), topk_counts.ptr<const int>(), Ti, static_cast<int>(tile), static_cast<int>(mode),
        staged, keep.ptr<unsigned char>());
    SONICMOE_CUDA_CHECK_LAUNCH();
    kept_per_token_kernel<<<blocks_for(T, 256), 256, 0, s>>>(keep.ptr<const unsigned char>(), Ti, Ei,
                                                              cnt.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
    std::size_t temp_bytes = 0;
    SONICMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, cnt.ptr<const int>(), tok_end.ptr<int>(),
                                                      Ti, s));
    Tensor temp = alloc(static_cast<std::int64_t>((temp_bytes + 3) / 4) + 1, DType::i32);
    SONICMOE_CUDA_CHECK(cub::DeviceScan::InclusiveSum(temp.data(), temp_bytes, cnt.ptr<const int>(),
                                                      tok_end.ptr<int>(), Ti, s));
    // The one host synchronisation: N sizes the Routing's pair tensors.
    SONICMOE_CUDA_CHECK(cudaMemcpyAsync(&n_pairs, tok_end.ptr<int>() + (T - 1), sizeof(n_pairs),
                                        cudaMemcpyDeviceToHost, s));
    SONICMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  const std::int64_t N = n_pairs;
  r.pair_token = alloc(N, DType::i32);
  r.pair_expert = alloc(N, DType::i32);
  r.pair_score = alloc(N, DType::f32);
  r.pair_slot = alloc(N, DType::i32);
  if (N > 0) {
    write_pairs_kernel<<<blocks_for(T, 128), 128, 0, s>>>(
        keep.ptr<const unsigned char>(), key_hi.ptr<const unsigned>(), r.topk_expert.ptr<const int>(),
        cnt.ptr<const int>(), tok_end.ptr<const int>(), Ti, Ei, Ki, r.pair_token.ptr<int>(), r.pair_expert.ptr<int>(),
        r.pair_score.ptr<float>(), r.pair_slot.ptr<int>());
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  r.meta = cuda::build_metadata(ctx, r.pair_token, r.pair_expert, T, E);
  return r;
}

}  // namespace sonicmoe::cuda

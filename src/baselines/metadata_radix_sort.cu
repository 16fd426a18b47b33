// Baseline (not in the library; target sonicmoe_baselines): the routing metadata of build_metadata (DESIGN.md
// step 3) by a CUB radix sort: histogram, offsets, a stable LSD sort of (expert, p), then gather / rev /
// token_offsets. The same arrays as the library's counting sort (src/cuda/routing/metadata.cu), which the benchmark
// compares it with and the routing tests check it against.
#include "baselines/metadata_radix_sort.h"

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda_check.h"
#include "cuda/cuda_limits.h"
#include "cuda/launch_util.h"
#include "cuda/routing/routing_detail.h"
#include "sonicmoe/error.h"

namespace sonicmoe::baselines {
namespace {

using cuda::blocks_for;
using cuda::stream_of;
using cuda::workspace;
constexpr int kMaxExperts = static_cast<int>(cuda::kMaxExperts);

// Writes token_offsets[t] = p for every token t that starts at pair p (prev < t <= tok[p], prev the token of
// pair p-1), and N for the tokens after the last pair.
__device__ __forceinline__ void token_boundary(int t, int prev, int p, int N, int T, int* __restrict__ toff) {
  for (int u = prev + 1; u <= t; ++u) toff[u] = p;
  if (p == N - 1)
    for (int u = t + 1; u <= T; ++u) toff[u] = N;
}

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

// offsets[e] = exclusive scan of counts (E <= kMaxExperts, one thread each), offsets[E] = the total.
__global__ void __launch_bounds__(kMaxExperts) offsets_kernel(const int* __restrict__ counts, int E,
                                                             int* __restrict__ offsets) {
  using Scan = cub::BlockScan<int, kMaxExperts>;
  __shared__ typename Scan::TempStorage tmp;
  const int v = static_cast<int>(threadIdx.x) < E ? counts[threadIdx.x] : 0;
  int ex = 0, total = 0;
  Scan(tmp).ExclusiveSum(v, ex, total);
  if (static_cast<int>(threadIdx.x) < E) offsets[threadIdx.x] = ex;
  if (threadIdx.x == 0) offsets[E] = total;
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

}  // namespace

RoutingMetadata build_metadata_radix_sort(const Context& ctx, const TensorView& pair_token,
                                          const TensorView& pair_expert, std::int64_t num_tokens,
                                          std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  SONICMOE_CHECK(E >= 1 && E <= kMaxExperts && N < cuda::kMaxRows && T < cuda::kMaxRows,
                 "sonicmoe::baselines::build_metadata_radix_sort: E = ", E, ", N = ", N, ", T = ", T,
                 " beyond the cuda backend's limits (src/cuda/cuda_limits.h)");
  if (N == 0) return cuda::detail::zero_metadata(ctx, T, E);
  cudaStream_t s = stream_of(ctx);
  RoutingMetadata m = cuda::detail::empty_metadata(ctx, N, T, E);
  const int* tok = pair_token.ptr<const int>();
  const int* exp = pair_expert.ptr<const int>();
  const std::size_t e_bytes = sizeof(int) * static_cast<std::size_t>(E);
  SONICMOE_CUDA_CHECK(cudaMemsetAsync(m.counts.data(), 0, e_bytes, s));
  histogram_kernel<<<blocks_for(N, 1024, 264), 1024, e_bytes, s>>>(exp, N, static_cast<int>(E), m.counts.ptr<int>());
  SONICMOE_CUDA_CHECK_LAUNCH();
  offsets_kernel<<<1, kMaxExperts, 0, s>>>(m.counts.ptr<const int>(), static_cast<int>(E), m.offsets.ptr<int>());
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

}  // namespace sonicmoe::baselines

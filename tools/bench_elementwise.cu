// sonicmoe-bench-elementwise: GB/s of the standalone memory-bound MoE kernels (src/cuda/elementwise) at the
// readme-default shape (T=32768, K=8, E=128, H=4096, I=1024), against a device-to-device copy in the same run.
// Random non-zero bf16 data, uniform random top-K routing, CUDA events, median of warm iterations.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "bench_cuda.cuh"
#include "baselines/unfused_elementwise.h"
#include "cuda/elementwise/expert_bias_grad.h"


int main(int argc, char** argv) {
  const std::int64_t T = 32768, K = 8, H = 4096, I = 1024;
  const int E = 128;
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  const std::int64_t N = T * K;
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));

  // Routing: each token picks K distinct experts uniformly; rows grouped by expert, stable by pair.
  std::mt19937 rng(1);
  std::vector<int> pe(N);
  std::vector<std::int32_t> counts(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<int> ex(E);
    for (int e = 0; e < E; ++e) ex[e] = e;
    for (int k = 0; k < K; ++k) {
      std::swap(ex[k], ex[k + rng() % (E - k)]);
      pe[t * K + k] = ex[k];
      counts[ex[k]]++;
    }
  }
  std::vector<std::int32_t> offsets(E + 1, 0), pair(N), gather(N);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  std::vector<std::int32_t> cur(offsets.begin(), offsets.end() - 1);
  for (std::int64_t p = 0; p < N; ++p) {
    const std::int32_t r = cur[pe[p]]++;
    pair[r] = static_cast<std::int32_t>(p);
    gather[r] = static_cast<std::int32_t>(p / K);
  }
  std::vector<float> score(N);
  std::uniform_real_distribution<float> ds(0.05f, 0.3f);
  for (auto& s : score) s = ds(rng);

  auto alloc_bf16 = [&](std::int64_t n, std::uint32_t seed) {
    __nv_bfloat16* p;
    CK(cudaMalloc(&p, n * 2));
    sonicmoe::bench::fill(p, n, seed, 2.0f);
    return p;
  };
  __nv_bfloat16 *x = alloc_bf16(T * H, 1), *z = alloc_bf16(N * 2 * I, 2), *g = alloc_bf16(N * I, 3),
                *dO = alloc_bf16(T * H, 4), *b2 = alloc_bf16(E * H, 5), *a = alloc_bf16(N * I, 6),
                *dz = alloc_bf16(N * 2 * I, 7), *as = alloc_bf16(N * I, 8), *xg = alloc_bf16(N * H, 9),
                *db1 = alloc_bf16(E * 2 * I, 10), *db2 = alloc_bf16(E * H, 11), *cpy = alloc_bf16(N * H, 12);
  std::int32_t *d_off, *d_pair, *d_gather;
  float *d_score, *d_ds;
  CK(cudaMalloc(&d_off, (E + 1) * 4));
  CK(cudaMalloc(&d_pair, N * 4));
  CK(cudaMalloc(&d_gather, N * 4));
  CK(cudaMalloc(&d_score, N * 4));
  CK(cudaMalloc(&d_ds, N * 4));
  CK(cudaMemcpy(d_off, offsets.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_pair, pair.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_gather, gather.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_score, score.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());

  const double b = 2.0;  // bytes per bf16
  std::vector<sonicmoe::bench::BandwidthRow> rows = {
      {"d2d copy [N,H] (read+write)", 2.0 * N * H * b,
       [&] { CK(cudaMemcpyAsync(cpy, xg, N * H * b, cudaMemcpyDeviceToDevice)); }},
      {"activation_forward swiglu", N * (2 * I + I) * b,
       [&] { sonicmoe::baselines::activation_forward(sonicmoe::Activation::swiglu, z, a, N, I, d_off, E, nullptr); }},
      {"activation_forward gelu", N * (I + I) * b,
       [&] { sonicmoe::baselines::activation_forward(sonicmoe::Activation::gelu, z, a, N, I, d_off, E, nullptr); }},
      {"dgated swiglu (no b2)", N * (I + 2 * I + 2 * I + I) * b + N * 12.0,
       [&] {
         sonicmoe::baselines::dgated_elementwise(sonicmoe::Activation::swiglu, g, z, d_score, d_pair, nullptr, nullptr,
                                            nullptr, dz, as, d_ds, N, H, I, d_off, E, nullptr);
       }},
      {"dgated swiglu (+ <dO,b2>)", N * (I + 2 * I + 2 * I + I + H) * b + N * 16.0,
       [&] {
         sonicmoe::baselines::dgated_elementwise(sonicmoe::Activation::swiglu, g, z, d_score, d_pair, dO, d_gather, b2,
                                            dz, as, d_ds, N, H, I, d_off, E, nullptr);
       }},
      {"expert_bias_grad db1 (dZ [N,2I])", N * 2 * I * b,
       [&] { sonicmoe::cuda::expert_bias_grad(dz, nullptr, nullptr, nullptr, N, 2 * I, d_off, E, db1, nullptr); }},
      {"expert_bias_grad db2 (s*dO[gather])", N * H * b + N * 12.0,
       [&] { sonicmoe::cuda::expert_bias_grad(dO, d_gather, d_score, d_pair, N, H, d_off, E, db2, nullptr); }},
      {"gather_rows X -> [N,H]", 2.0 * N * H * b + N * 4.0,
       [&] { sonicmoe::baselines::gather_rows(x, d_gather, xg, N, H, d_off + E, nullptr); }},
  };
  std::printf("GPU: %s (%d SMs), T=%lld K=%lld E=%d N=%lld H=%lld I=%lld, median of %d\n", prop.name,
              prop.multiProcessorCount, (long long)T, (long long)K, E, (long long)N, (long long)H, (long long)I, iters);
  sonicmoe::bench::print_bandwidth_table(rows, iters);
  std::printf("(db2 reads dO rows through gather: the same [T,H] rows K times, partly from L2.)\n");
  return 0;
}

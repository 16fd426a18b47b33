// sonicmoe-bench-quant: GB/s of the FP8 quantisers (include/sonicmoe/quant.h, src/cuda/quant) at the readme-default
// shape (T=32768, K=8, E=128, H=4096, I=1024; swiglu, so W1 is [E, 2I, H]), against a device-to-device copy in the
// same run. Bytes moved = input read + codes written + scales written (gathered rows count every row read, though
// repeated tokens partly come from L2). Random non-zero bf16 data; CUDA events, median of warm iterations.
// Usage: sonicmoe-bench-quant [iterations] [T H I E K]
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
#include "sonicmoe/quant.h"

using namespace sonicmoe;

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  std::int64_t T = 32768, H = 4096, I = 1024, E = 128, K = 8;
  if (argc == 7) T = std::atoll(argv[2]), H = std::atoll(argv[3]), I = std::atoll(argv[4]), E = std::atoll(argv[5]),
                 K = std::atoll(argv[6]);
  else if (argc != 1 && argc != 2) {
    std::fprintf(stderr, "usage: sonicmoe-bench-quant [iterations] [T H I E K]\n");
    return 2;
  }
  const std::int64_t N = T * K, Z = 2 * I;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  Context ctx;
  ctx.backend = Backend::cuda;

  auto bf16_tensor = [](std::vector<std::int64_t> shape, std::uint32_t seed) {
    Tensor t = Tensor::empty(shape, DType::bf16, Device::cuda());
    bench::fill(t.ptr<__nv_bfloat16>(), t.numel(), seed, 2.0f);
    return t;
  };
  auto fp8 = [](std::vector<std::int64_t> shape) { return Tensor::empty(shape, DType::f8e4m3, Device::cuda()); };
  auto f32 = [](std::vector<std::int64_t> shape) { return Tensor::empty(shape, DType::f32, Device::cuda()); };

  Tensor x = bf16_tensor({T, H}, 1), a = bf16_tensor({N, I}, 2), w1 = bf16_tensor({E, Z, H}, 3);
  Tensor copy_dst = Tensor::empty({T, H}, DType::bf16, Device::cuda());
  // Gathered rows as the grouped GEMMs read them: N random tokens, increasing within each expert's run of N / E.
  std::vector<std::int32_t> gather(N);
  std::mt19937 rng(1);
  for (auto& g : gather) g = static_cast<std::int32_t>(rng() % T);
  for (std::int64_t e = 0; e < E; ++e) std::sort(gather.begin() + e * N / E, gather.begin() + (e + 1) * N / E);
  Tensor rows_host = Tensor::empty({N}, DType::i32);
  std::copy(gather.begin(), gather.end(), rows_host.ptr<std::int32_t>());
  Tensor rows = rows_host.to(Device::cuda());

  Tensor qx = fp8({T, H}), sx = f32({T, fp8_num_blocks(H)});
  Tensor qg = fp8({N, H}), sg = f32({N, fp8_num_blocks(H)});
  Tensor qat = fp8({I, N}), sat = f32({I, fp8_num_blocks(N)});
  Tensor qw = fp8({E, Z, H}), qwt = fp8({E, H, Z}), sw = f32({E, fp8_num_blocks(Z), fp8_num_blocks(H)});

  const double xb = 2.0;  // bytes per bf16 input element; codes are 1 byte, scales 4 per 128 elements
  auto moved = [&](double elems, double scales) { return elems * (xb + 1.0) + scales * 4.0; };
  std::vector<sonicmoe::bench::BandwidthRow> table = {
      {"d2d copy X [T,H] (read+write)", 2.0 * T * H * xb,
       [&] { CK(cudaMemcpyAsync(copy_dst.data(), x.data(), T * H * xb, cudaMemcpyDeviceToDevice)); }},
      {"rows 1x128 X [T,H]", moved(double(T) * H, double(sx.numel())),
       [&] { fp8_quantize_rows(ctx, x, {}, qx, sx); }},
      {"rows 1x128 gathered X[gather] [N,H]", moved(double(N) * H, double(sg.numel())) + N * 4.0,
       [&] { fp8_quantize_rows(ctx, x, rows, qg, sg); }},
      {"cols 128x1 A [N,I] -> A^T [I,N]", moved(double(N) * I, double(sat.numel())),
       [&] { fp8_quantize_cols_transposed(ctx, a, qat, sat); }},
      {"blocks 128x128 W1 [E,2I,H]", moved(double(E) * Z * H, double(sw.numel())),
       [&] { fp8_quantize_blocks(ctx, w1, qw, {}, sw); }},
      {"blocks 128x128 W1 + W1^T", moved(double(E) * Z * H, double(sw.numel())) + double(E) * Z * H,
       [&] { fp8_quantize_blocks(ctx, w1, qw, qwt, sw); }},
  };
  std::printf("GPU: %s (%d SMs), T=%lld H=%lld I=%lld E=%lld K=%lld (N=%lld), bf16 in, median of %d\n", prop.name,
              prop.multiProcessorCount, (long long)T, (long long)H, (long long)I, (long long)E, (long long)K,
              (long long)N, iters);
  sonicmoe::bench::print_bandwidth_table(table, iters);
  CK(cudaDeviceSynchronize());
  return 0;
}

// sonicmoe-bench-routing: the routing and memory-bound CUDA stages at the bench_configs.json shapes.
// CUDA events, warm-up, median of 20 runs; GB/s against a device-to-device copy measured in the same run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_cuda.cuh"
#include "baselines/metadata_radix_sort.h"
#include "cuda/cuda_backend.h"
#include "routing_util.h"

using namespace sonicmoe;

namespace {

void fill(const Tensor& t, unsigned seed, float scale) {  // values in [-scale/2, scale/2)
  if (t.dtype() == DType::bf16) sonicmoe::bench::fill(t.ptr<__nv_bfloat16>(), t.numel(), seed, 0.5f * scale);
  else sonicmoe::bench::fill(t.ptr<float>(), t.numel(), seed, 0.5f * scale);
}

double median_us(const std::function<void()>& fn, int reps = 20) { return 1e3 * sonicmoe::bench::median_ms(fn, reps); }

struct Cfg {
  const char* name;
  std::int64_t T, H, E, K;
};

}  // namespace

int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;  // optional: one config by name
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  Context ctx;
  ctx.backend = Backend::cuda;
  const Device dev = Device::cuda(0);
  // Copy bandwidth: 1 GiB device-to-device (read + write counted).
  const std::size_t cb = std::size_t(1) << 30;
  Tensor c0 = Tensor::empty({std::int64_t(cb / 4)}, DType::f32, dev), c1 = Tensor::empty({std::int64_t(cb / 4)}, DType::f32, dev);
  fill(c0, 1, 1.0f);
  const double copy_us = median_us([&] { cudaMemcpyAsync(c1.data(), c0.data(), cb, cudaMemcpyDeviceToDevice, 0); });
  const double copy_gbs = 2.0 * cb / copy_us / 1e3;
  c0 = Tensor();
  c1 = Tensor();
  std::printf("GPU: %s   device-to-device copy: %.0f GB/s (1 GiB, read+write)\n\n", prop.name, copy_gbs);
  std::printf("%-18s %-22s %10s %10s %8s\n", "config", "stage", "us", "GB/s", "%copy");
  const Cfg cfgs[] = {{"readme-default", 32768, 4096, 128, 8}, {"fine-grained-256", 16384, 4096, 256, 8},
                      {"olmoe-like", 32768, 2048, 64, 8},      {"coarse-8x8", 8192, 3072, 8, 8},
                      {"sparse-16of256", 8192, 4096, 256, 16}, {"mid-128x8", 8192, 4096, 128, 8},
                      {"small-k2", 8192, 1536, 32, 2}};
  for (const Cfg& c : cfgs) {
    if (only && std::string(only) != c.name) continue;
    const std::int64_t T = c.T, H = c.H, E = c.E, K = c.K, N = T * K;
    Tensor X = Tensor::empty({T, H}, DType::bf16, dev), W = Tensor::empty({E, H}, DType::bf16, dev);
    fill(X, 2, 2.0f);
    fill(W, 3, 0.1f);
    Tensor L = Tensor::empty({T, E}, DType::f32, dev);
    Tensor ids = Tensor::empty({T, K}, DType::i32, dev), sc = Tensor::empty({T, K}, DType::f32, dev);
    Tensor cnt = Tensor::empty({E}, DType::i32, dev), pt = Tensor::empty({N}, DType::i32, dev);
    cuda::router_logits(ctx, X, W, L);
    auto row = [&](const char* st, double us, double bytes) {
      std::printf("%-18s %-22s %10.1f %10.0f %7.0f%%\n", c.name, st, us, bytes / us / 1e3, 100.0 * bytes / us / 1e3 / copy_gbs);
    };
    row("router_logits", median_us([&] { cuda::router_logits(ctx, X, W, L); }), 2.0 * T * H + 2.0 * E * H + 4.0 * T * E);
    const double tk = median_us([&] { cuda::topk_softmax(ctx, L, K, ids, sc, cnt, RouterSpec{}); });
    row("topk_softmax", tk, 4.0 * T * E + 8.0 * N);
    // The layer's top-K path: top-K softmax, pair_token and the metadata in one call (three launches). Bytes:
    // logits read, ids/scores/pair_token written, ids and pair_token read again, pair/gather/rev written.
    RoutingMetadata meta;
    const double fused = median_us([&] { meta = cuda::topk_routing(ctx, L, K, ids, sc, pt, RouterSpec{}); });
    row("topk_routing (fused)", fused, 4.0 * T * E + 4.0 * N * 8 + 4.0 * (T + 1));
    // The router variants (RouterSpec) on the same logits: the kernel's router instance, then its backward.
    Tensor bias = Tensor::empty({E}, DType::f32, dev);
    fill(bias, 7, 0.2f);
    Tensor vids = Tensor::empty({T, K}, DType::i32, dev), vsc = Tensor::empty({T, K}, DType::f32, dev);
    Tensor vpt = Tensor::empty({N}, DType::i32, dev);
    for (int v = 0; v < 2; ++v) {
      // Qwen3 / OLMoE, or DeepSeek-V3 (8 groups, 4 kept, where E allows)
      const bool grouped = E % 8 == 0 && E / 8 >= 2 && K <= 4 * (E / 8);
      RouterSpec rs = v == 0 ? testing_util::qwen3_router()
                             : testing_util::deepseek_v3_router(grouped ? 8 : 1, grouped ? 4 : 1);
      if (v == 1) rs.e_score_correction_bias = bias;
      const std::string name = std::string(v == 0 ? "qwen3" : rs.n_group > 1 ? "deepseek-v3" : "sigmoid+bias");
      RoutingMetadata vm;
      row((name + " routing").c_str(), median_us([&] { vm = cuda::topk_routing(ctx, L, K, vids, vsc, vpt, rs); }),
          4.0 * T * E + 4.0 * N * 8 + 4.0 * (T + 1));
      const Routing vr = testing_util::topk_routing_state(L, K, vids, vsc, vpt, vm, rs);
      Tensor vds = Tensor::empty({N}, DType::f32, dev), vdl = Tensor::empty({T, E}, DType::f32, dev);
      fill(vds, 5, 1.0f);
      row((name + " router_bwd").c_str(), median_us([&] { cuda::router_backward(ctx, vr, vds, 0.5f, vdl); }),
          8.0 * T * E + 8.0 * N);
    }
    // The same in a CUDA graph (no host launch cost): what a captured training step pays.
    {
      cudaStream_t gs;
      cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking);
      Context gctx = ctx;
      gctx.stream = gs;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal);
      { RoutingMetadata gm = cuda::topk_routing(gctx, L, K, ids, sc, pt, RouterSpec{}); }
      cudaStreamEndCapture(gs, &graph);
      cudaGraphInstantiate(&exec, graph, 0);
      row("topk_routing (graph)", 1e3 * sonicmoe::bench::median_ms([&] { cudaGraphLaunch(exec, gs); }, 20, gs),
          4.0 * T * E + 4.0 * N * 8 + 4.0 * (T + 1));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(gs);
    }
    const Tensor pe = ids.reshape({N});
    const double md = median_us([&] { RoutingMetadata m2 = cuda::build_metadata(ctx, pt, pe, T, E); });
    row("build_metadata", md, 4.0 * N * 6 + 4.0 * (T + 1));
    {
      RoutingMetadata m2;
      row("build_metadata (CUB sort)", median_us([&] { m2 = baselines::build_metadata_radix_sort(ctx, pt, pe, T, E); }),
          4.0 * N * 6 + 4.0 * (T + 1));
    }
    std::printf("%-18s %-22s %10.1f\n", c.name, "topk + build_metadata", tk + md);
    {  // Token rounding (nearest, tile 128): top-K, rank keys, per-expert radix select, pairs, metadata.
      const double us = median_us([&] { Routing tr = cuda::token_rounding(ctx, L, K, 128, RoutingMode::round_nearest); });
      row("token_rounding", us, 4.0 * T * E * 3 + 4.0 * N * 8);
    }
    Tensor aux = Tensor::empty({1}, DType::f32, dev);
    row("aux_loss", median_us([&] { cuda::aux_loss(ctx, L, cnt, aux); }), 4.0 * T * E);
    {
      Tensor Y = Tensor::empty({N, H}, DType::bf16, dev), O = Tensor::empty({T, H}, DType::bf16, dev);
      fill(Y, 4, 1.0f);
      const Tensor s = sc.reshape({N});
      row("aggregate (bf16)", median_us([&] { cuda::aggregate(ctx, Y, s, meta, O); }),
          2.0 * N * H + 2.0 * T * H + 8.0 * N);
    }
    const Routing r = testing_util::topk_routing_state(L, K, ids, sc, pt, meta);
    Tensor ds = Tensor::empty({N}, DType::f32, dev), dl = Tensor::empty({T, E}, DType::f32, dev);
    fill(ds, 5, 1.0f);
    row("router_backward", median_us([&] { cuda::router_backward(ctx, r, ds, 0.5f, dl); }), 8.0 * T * E + 8.0 * N);
    Tensor dW = Tensor::empty({E, H}, DType::bf16, dev), dX = Tensor::empty({T, H}, DType::bf16, dev);
    fill(dX, 6, 1.0f);
    row("router_weight_grad", median_us([&] { cuda::router_weight_grad(ctx, dl, X, W, dW, dX, GradWrite::store); }),
        2.0 * T * H * 3 + 4.0 * T * E);
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {
      std::printf("CUDA error: %s\n", cudaGetErrorString(err));
      return 1;
    }
  }
  return 0;
}

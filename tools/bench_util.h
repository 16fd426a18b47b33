// Helpers shared by the CLI and the example: random tensors, a peak-tracking allocator, timers, errors.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "sonicmoe/detail/host_util.h"  // checked_mul, devops, SONICMOE_CUDA_CHECK
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#ifdef SONICMOE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sonicmoe::tools {

// Wraps the default allocator and records the bytes live at any time and their peak.
class PeakAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Device d, void* s) override {
    void* p = default_allocator()->allocate(bytes, d, s);
    std::lock_guard<std::mutex> g(mu_);
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    return p;
  }
  void deallocate(void* p, std::size_t bytes, Device d, void* s) override {
    default_allocator()->deallocate(p, bytes, d, s);
    std::lock_guard<std::mutex> g(mu_);
    live_ -= bytes;
  }
  std::size_t live() const { return live_; }
  std::size_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_; }

 private:
  std::mutex mu_;
  std::size_t live_ = 0, peak_ = 0;
};

// A host tensor of normal(0, stddev) values (never zeros), converted to dtype.
inline Tensor random_tensor(const std::vector<std::int64_t>& shape, DType dt, float stddev, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dt, Device::cpu());
  std::normal_distribution<float> nd(0.0f, stddev);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    float v = nd(rng);
    if (dt == DType::bf16) t.ptr<bf16>()[i] = float_to_bf16(v);
    else if (dt == DType::f16) t.ptr<f16>()[i] = float_to_f16(v);
    else t.ptr<float>()[i] = v;
  }
  return t;
}

// A random tensor on `dev`: fully random up to 4M elements; larger ones are filled from a 4M-element random
// pool, each 1M-element chunk starting at a pseudo-random pool offset (non-zero, unstructured data at a
// fraction of the cost of drawing billions of normals on one host thread).
inline Tensor random_tensor_on(Device dev, const std::vector<std::int64_t>& shape, DType dt, float stddev,
                               std::mt19937& rng) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n = checked_mul(n, d, "random_tensor_on: elements");
  constexpr std::int64_t kPool = std::int64_t{1} << 22, kChunk = std::int64_t{1} << 20;
  if (n <= kPool) return random_tensor(shape, dt, stddev, rng).to(dev);
  Tensor pool = random_tensor({kPool + kChunk}, dt, stddev, rng);
  Tensor t = Tensor::empty(shape, dt, dev);
  const std::size_t es = dtype_size(dt);
  std::uniform_int_distribution<std::int64_t> off(0, kPool);
  for (std::int64_t i = 0; i < n; i += kChunk) {
    const std::int64_t len = std::min(kChunk, n - i);
    char* dst = static_cast<char*>(t.data()) + i * es;
    const char* src = static_cast<const char*>(pool.data()) + off(rng) * es;
    if (dev.is_cuda()) devops::cuda_memcpy(dst, src, static_cast<std::size_t>(len) * es);
    else std::memcpy(dst, src, static_cast<std::size_t>(len) * es);
  }
  return t;
}

inline double to_double(const Tensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::bf16: return bf16_to_float(t.ptr<const bf16>()[i]);
    case DType::f16: return f16_to_float(t.ptr<const f16>()[i]);
    case DType::i32: return t.ptr<const std::int32_t>()[i];
    default: return t.ptr<const float>()[i];
  }
}

// ||a - b|| / ||b|| over host tensors of equal size (any float dtypes).
inline double rel_error(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    const double x = to_double(a, i), y = to_double(b, i);
    num += (x - y) * (x - y);
    den += y * y;
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline void synchronize(const Context& ctx) {
#ifdef SONICMOE_WITH_CUDA
  if (ctx.backend == Backend::cuda) SONICMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(ctx.stream)));
#else
  (void)ctx;
#endif
}

// Milliseconds of fn(), median over `iters` runs after `warmup` runs (CUDA events on the GPU).
template <typename Fn>
double time_ms(const Context& ctx, int warmup, int iters, Fn&& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  synchronize(ctx);
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
#ifdef SONICMOE_WITH_CUDA
    if (ctx.backend == Backend::cuda) {
      cudaEvent_t a, b;
      cudaEventCreate(&a);
      cudaEventCreate(&b);
      cudaEventRecord(a, static_cast<cudaStream_t>(ctx.stream));
      fn();
      cudaEventRecord(b, static_cast<cudaStream_t>(ctx.stream));
      cudaEventSynchronize(b);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      ms.push_back(t);
      continue;
    }
#endif
    auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

#ifdef SONICMOE_WITH_CUDA
// Like time_ms, but fn() is captured once into a CUDA graph on ctx's (non-default) stream and the replays are
// timed: what a captured training step pays, with no host work between the kernels.
template <typename Fn>
double time_graph_ms(const Context& ctx, int warmup, int iters, Fn&& fn) {
  auto s = static_cast<cudaStream_t>(ctx.stream);
  if (ctx.backend != Backend::cuda || s == nullptr) throw Error("time_graph_ms: needs the cuda backend on a created stream");
  cudaGraph_t graph = nullptr;
  SONICMOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    fn();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  SONICMOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  SONICMOE_CUDA_CHECK(inst);
  double ms = 0;
  try {
    ms = time_ms(ctx, warmup, iters, [&] { SONICMOE_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  SONICMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraphExecDestroy(exec);
  return ms;
}
#endif

}  // namespace sonicmoe::tools

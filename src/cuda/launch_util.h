// Small host helpers shared by the cuda backend's translation units: the context's stream, grid sizes,
// stream-ordered scratch, and several device arrays carved from one allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::cuda {

inline cudaStream_t stream_of(const Context& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// Blocks of `threads` covering n items, at least 1, at most `cap` (grid-stride loops do the rest).
inline int blocks_for(std::int64_t n, int threads, std::int64_t cap = 65535 * 16) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 1 ? 1 : (b > cap ? cap : b));
}

// n elements of dt on ctx's device and stream, at least one (freed stream-ordered with the Tensor).
inline Tensor workspace(const Context& ctx, std::int64_t n, DType dt) {
  return Tensor::empty({n < 1 ? 1 : n}, dt, ctx.device(), ctx.allocator, ctx.stream);
}

// Lets `kernel` launch with `bytes` of dynamic shared memory. A kernel's static shared memory counts against the
// same 48 KB default limit, so the limit is raised whenever static + dynamic exceed it (not only when the dynamic
// part alone does: a launch in between fails with "invalid argument").
inline void allow_dynamic_smem(const void* kernel, std::size_t bytes) {
  cudaFuncAttributes a{};
  SONICMOE_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
  if (a.sharedSizeBytes + bytes > 48 * 1024)
    SONICMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Arrays of known shapes laid out in one allocation (each 256-byte aligned): one allocator call instead of
// one per array. add() returns the array's index into allocate()'s result; add(dst, ...) also has allocate() store
// the array in *dst.
class ArrayPack {
 public:
  int add(Tensor* dst, std::vector<std::int64_t> shape, DType dt) {
    const int i = add(std::move(shape), dt);
    dst_.resize(offsets_.size(), nullptr);
    dst_[i] = dst;
    return i;
  }
  int add(std::vector<std::int64_t> shape, DType dt) {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    offsets_.push_back(bytes_);
    shapes_.push_back(std::move(shape));
    dtypes_.push_back(dt);
    bytes_ += (static_cast<std::size_t>(n) * dtype_size(dt) + 255) / 256 * 256;
    return static_cast<int>(offsets_.size()) - 1;
  }
  std::size_t bytes() const { return bytes_; }
  std::vector<Tensor> allocate(const Context& ctx) const {
    const Tensor block = workspace(ctx, static_cast<std::int64_t>(bytes_ / 4), DType::i32);
    std::vector<Tensor> out;
    out.reserve(offsets_.size());
    for (std::size_t i = 0; i < offsets_.size(); ++i) out.push_back(block.carve(offsets_[i], shapes_[i], dtypes_[i]));
    for (std::size_t i = 0; i < dst_.size(); ++i)
      if (dst_[i]) *dst_[i] = out[i];
    return out;
  }

 private:
  std::vector<std::size_t> offsets_;
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<DType> dtypes_;
  std::vector<Tensor*> dst_;
  std::size_t bytes_ = 0;
};

}  // namespace sonicmoe::cuda

// Host copies of small device arrays (index plans, counts) for the dispatched-token entries and the expert-parallel
// layer. On a CUDA tensor: synchronises ctx's stream, then copies (a host read, counted in their docs).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/device_ops.h"
#include "sonicmoe/moe.h"

namespace sonicmoe::hostcopy {

template <typename T>
std::vector<T> read(const Context& ctx, const TensorView& v) {
  const std::int64_t n = v.numel();
  std::vector<T> out(static_cast<std::size_t>(n));
  if (n == 0) return out;
  if (v.device.is_cuda()) {
    devops::cuda_stream_synchronize(v.device.index, ctx.stream);
    devops::cuda_memcpy(out.data(), v.data, static_cast<std::size_t>(n) * sizeof(T));
  } else {
    std::memcpy(out.data(), v.data, static_cast<std::size_t>(n) * sizeof(T));
  }
  return out;
}

// A new tensor on `dev` holding `values` with `shape` (ordered on ctx's stream when dev is a GPU).
template <typename T>
Tensor upload(const Context& ctx, const std::vector<T>& values, const std::vector<std::int64_t>& shape, DType dt,
              Device dev) {
  Tensor t = Tensor::empty(shape, dt, dev, ctx.allocator, ctx.stream);
  if (values.empty()) return t;
  if (dev.is_cuda())
    devops::cuda_memcpy_async(t.data(), values.data(), values.size() * sizeof(T), ctx.stream);
  else
    std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
  return t;
}

}  // namespace sonicmoe::hostcopy

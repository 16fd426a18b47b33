// Helpers of the dispatched-token entries and the expert-parallel layer (src/moe/dispatched.cpp, ep*.cpp): scratch on
// the context, the bytes of a row, and host copies of small device arrays (index plans, counts). hostcopy::read on
// a CUDA tensor synchronises ctx's stream, then copies (a host read, counted in their docs).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/context_alloc.h"
#include "core/device_ops.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

// Bytes of one row along dim 0 (the product of the other dims).
inline std::size_t row_bytes(const TensorView& t) {
  std::int64_t per_row = 1;
  for (int d = 1; d < t.ndim; ++d) per_row *= t.shape[d];
  return static_cast<std::size_t>(per_row) * dtype_size(t.dtype);
}

}  // namespace sonicmoe

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

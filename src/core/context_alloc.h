// Scratch tensors on a context: `shape` of `dt` on ctx's device, from its allocator, on its stream (the layer,
// the FP8 weights and layer, the dispatched-token and expert-parallel entries).
#pragma once

#include <cstdint>
#include <vector>

#include "sonicmoe/moe.h"

namespace sonicmoe {

inline Tensor alloc_on(const Context& ctx, const std::vector<std::int64_t>& shape, DType dt) {
  return Tensor::empty(shape, dt, ctx.device(), ctx.allocator, ctx.stream);
}

// The same, filled with zeros.
inline Tensor alloc_zeros_on(const Context& ctx, const std::vector<std::int64_t>& shape, DType dt) {
  return Tensor::zeros(shape, dt, ctx.device(), ctx.allocator, ctx.stream);
}

}  // namespace sonicmoe

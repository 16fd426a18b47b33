// W1 layouts in tests: a host tensor [E, 2I, ...] (W1, b1, dW1, db1) with its interleaved gate/up rows moved to the
// concatenated order (row 2j + p -> p * I + j, MoEConfig::w1_layout), or to the separate one ([2, E, I, ...]: row
// 2j + p of expert e -> part p, expert e, row j), any dtype.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "sonicmoe/tensor.h"

namespace sonicmoe::testing_util {

inline Tensor w1_rows_to_concat(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  std::vector<std::int64_t> shape(h.view().shape.begin(), h.view().shape.begin() + h.view().ndim);
  const std::int64_t E = shape[0], ZW = shape[1], I = ZW / 2;
  const std::size_t row = h.nbytes() / static_cast<std::size_t>(E * ZW);  // bytes of one row (the trailing dims)
  Tensor out = Tensor::empty(shape, h.dtype());
  const char* src = static_cast<const char*>(h.data());
  char* dst = static_cast<char*>(out.data());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t n = 0; n < ZW; ++n)
      std::memcpy(dst + (e * ZW + (n % 2) * I + n / 2) * row, src + (e * ZW + n) * row, row);
  return out;
}

inline Tensor w1_rows_to_separate(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  std::vector<std::int64_t> shape(h.view().shape.begin(), h.view().shape.begin() + h.view().ndim);
  const std::int64_t E = shape[0], ZW = shape[1], I = ZW / 2;
  const std::size_t row = h.nbytes() / static_cast<std::size_t>(E * ZW);
  std::vector<std::int64_t> out_shape{2, E, I};
  out_shape.insert(out_shape.end(), shape.begin() + 2, shape.end());
  Tensor out = Tensor::empty(out_shape, h.dtype());
  const char* src = static_cast<const char*>(h.data());
  char* dst = static_cast<char*>(out.data());
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t n = 0; n < ZW; ++n)
      std::memcpy(dst + (((n % 2) * E + e) * I + n / 2) * row, src + (e * ZW + n) * row, row);
  return out;
}

}  // namespace sonicmoe::testing_util

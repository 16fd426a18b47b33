// Inputs for the FP8 quantiser tests (CPU and GPU): non-zero values over most of the fp32 exponent range.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "sonicmoe/tensor.h"
#include "sonicmoe/types.h"

namespace sonicmoe::testing_util {

// Host tensor of `shape` (bf16 or f32): runs of 37 elements (crossing the 128-element blocks in both directions)
// share a magnitude 2^b, b uniform in [-140, 120] (fp32 / bf16 subnormals to near FLT_MAX); each element is
// +-2^b * 2^u * (1 + v), u in [-30, 0], v in [0, 1): blocks mix values that keep every bit with values that
// underflow to zero. Never zero, never non-finite.
inline Tensor fp8_test_input(const std::vector<std::int64_t>& shape, DType dt, std::uint32_t seed) {
  Tensor t = Tensor::empty(shape, dt);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> base(-140, 120), spread(-30, 0);
  std::uniform_real_distribution<float> frac(0.0f, 1.0f);
  int b = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    if (i % 37 == 0) b = base(rng);
    float v = std::ldexp(1.0f + frac(rng), b + spread(rng));
    if (v == 0.0f || std::isinf(v)) v = std::ldexp(1.0f, b);  // keep it finite and non-zero
    if (rng() & 1) v = -v;
    if (dt == DType::bf16) {
      bf16 h = float_to_bf16(v);
      if ((h.bits & 0x7fffu) == 0 || (h.bits & 0x7f80u) == 0x7f80u) h.bits = (h.bits & 0x8000u) | 0x0001u;  // rounded to 0 / inf
      t.ptr<bf16>()[i] = h;
    } else {
      t.ptr<float>()[i] = v;
    }
  }
  return t;
}

// Writes v into element i of a bf16 or f32 host tensor.
inline void set_value(const Tensor& t, std::int64_t i, float v) {
  if (t.dtype() == DType::bf16) t.ptr<bf16>()[i] = float_to_bf16(v);
  else t.ptr<float>()[i] = v;
}

}  // namespace sonicmoe::testing_util

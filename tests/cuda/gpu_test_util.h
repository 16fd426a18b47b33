// Shared by the CUDA suites: skip without a device, random host tensors, error norms.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "sonicmoe/moe.h"

namespace sonicmoe::testing {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SONICMOE_REQUIRE_GPU() \
  if (!::sonicmoe::testing::have_gpu()) GTEST_SKIP() << "no CUDA device visible"

// n values uniform in [lo, hi), an exact zero replaced by 0.25, each converted by to_bf16 (to sonicmoe's bf16 or to
// CUDA's __nv_bfloat16).
template <class Bf, class ToBf>
std::vector<Bf> random_nonzero_bf16(std::size_t n, std::mt19937& rng, float lo, float hi, ToBf to_bf16) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<Bf> v(n);
  for (auto& x : v) {
    float f = d(rng);
    if (f == 0.0f) f = 0.25f;
    x = to_bf16(f);
  }
  return v;
}

inline Tensor host_randn(const std::vector<std::int64_t>& shape, DType dt, float stddev, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dt);
  std::normal_distribution<float> nd(0.0f, stddev);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const float v = nd(rng);
    if (dt == DType::bf16) t.ptr<bf16>()[i] = float_to_bf16(v);
    else if (dt == DType::f16) t.ptr<f16>()[i] = float_to_f16(v);
    else t.ptr<float>()[i] = v;
  }
  return t;
}

inline double value(const Tensor& t, std::int64_t i) {
  if (t.dtype() == DType::bf16) return bf16_to_float(t.ptr<const bf16>()[i]);
  if (t.dtype() == DType::f16) return f16_to_float(t.ptr<const f16>()[i]);
  if (t.dtype() == DType::i32) return t.ptr<const std::int32_t>()[i];
  return t.ptr<const float>()[i];
}

// ||a - b|| / ||b||; NaN anywhere gives +inf.
inline double rel_err(const Tensor& a_any, const Tensor& b_any) {
  Tensor a = a_any.to(Device::cpu()), b = b_any.to(Device::cpu());
  EXPECT_EQ(a.numel(), b.numel());
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    const double x = value(a, i), y = value(b, i);
    if (!std::isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline bool bitwise_equal(const Tensor& a_any, const Tensor& b_any) {
  Tensor a = a_any.to(Device::cpu()), b = b_any.to(Device::cpu());
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace sonicmoe::testing

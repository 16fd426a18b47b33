// Small helpers of the dispatched-token and expert-parallel tests (test_dispatched.cpp, test_ep.cpp): host f32 /
// int32 tensors from vectors and back, seeded random data, and a relative closeness check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "sonicmoe/moe.h"

namespace eptest {

using sonicmoe::DType;
using sonicmoe::Tensor;

inline Tensor f32(const std::vector<float>& v, const std::vector<std::int64_t>& shape) {
  Tensor t = Tensor::empty(shape, DType::f32);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  return t;
}
inline Tensor i32(const std::vector<std::int32_t>& v, const std::vector<std::int64_t>& shape) {
  Tensor t = Tensor::empty(shape, DType::i32);
  if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * sizeof(std::int32_t));
  return t;
}
inline std::vector<float> vec(const Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * sizeof(float));
  return v;
}
inline std::vector<float> uniform(std::size_t n, float lo, float hi, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// The config of E local experts (general routing: top_k 1) of hidden size H and intermediate size I.
inline sonicmoe::MoEConfig expert_config(std::int64_t E, std::int64_t H, std::int64_t I, sonicmoe::Activation act,
                                         bool bias) {
  sonicmoe::MoEConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = 1;
  cfg.hidden_size = H;
  cfg.intermediate_size = I;
  cfg.activation = act;
  cfg.add_bias = bias;
  return cfg;
}

// max |a - b| <= tol * max(1, max |b|)
template <typename A, typename B>
void expect_close(const A& a, const B& b, double tol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double scale = 1.0, err = 0.0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  for (std::size_t i = 0; i < b.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!(d <= err)) { err = d; at = i; }
  }
  EXPECT_LE(err, tol * scale) << what << ": worst element " << at << " of " << b.size();
}

}  // namespace eptest

// The parameter of the GPU layer suites (bf16: test_layer.cpp, FP8: test_fp8_layer_cuda.cpp), its gtest name, and
// its bf16 inputs: N(0, 1) X and dO, router and weights N(0, 1/fan_in), biases N(0, 0.1) where the case has them,
// and the skew (a shared input feature that only expert 0's router row reads: almost every token picks it).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>

#include "cuda/gpu_test_util.h"

namespace sonicmoe::testing_util {

struct LayerCase {
  std::int64_t T, H, I, E, K;
  Activation act;
  bool bias;
  RoutingMode mode;
  std::int64_t tile;
  bool skew;  // route most tokens to expert 0 by biasing the router
};

inline std::string layer_case_name(const ::testing::TestParamInfo<LayerCase>& info) {
  const LayerCase& c = info.param;
  std::string n = "T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_I" + std::to_string(c.I) + "_E" +
                  std::to_string(c.E) + "_K" + std::to_string(c.K) + "_" + activation_name(c.act) +
                  (c.bias ? "_bias" : "") + "_" + routing_mode_name(c.mode) + (c.skew ? "_skew" : "");
  for (char& ch : n)
    if (ch == '-') ch = '_';
  return n;
}

// A context on the cuda backend (device 0), on the given stream (nullptr: the default stream).
inline Context gpu_ctx(void* stream = nullptr) {
  Context ctx;
  ctx.backend = Backend::cuda;
  ctx.stream = stream;
  return ctx;
}

struct LayerInputs {
  Tensor x, router, w1, b1, w2, b2, d_out;
  MoEWeights weights() const { return {router, w1, b1, w2, b2}; }
  LayerInputs to(Device d) const {
    auto mv = [&](const Tensor& t) { return t.defined() ? t.to(d) : Tensor(); };
    return {mv(x), mv(router), mv(w1), mv(b1), mv(w2), mv(b2), mv(d_out)};
  }
};

// Host bf16 (or dt: f16) tensors, drawn from rng in this order: X, router, W1, W2, b1, b2 (with bias), dO; a caller
// that draws more (general routing's triples) goes on from rng. z_width: W1's rows (MoEConfig::z_width()).
inline LayerInputs make_layer_inputs(const LayerCase& c, std::int64_t z_width, std::mt19937& rng,
                                     DType dt = DType::bf16) {
  LayerInputs in;
  in.x = testing::host_randn({c.T, c.H}, dt, 1.0f, rng);
  in.router = testing::host_randn({c.E, c.H}, dt, 1.0f / std::sqrt(float(c.H)), rng);
  if (c.skew) {  // 3.0 is exact in bf16 and f16
    const std::uint16_t three = dt == DType::f16 ? float_to_f16(3.0f).bits : float_to_bf16(3.0f).bits;
    for (std::int64_t t = 0; t < c.T; ++t) static_cast<std::uint16_t*>(in.x.data())[t * c.H] = three;
    static_cast<std::uint16_t*>(in.router.data())[0] = three;
  }
  in.w1 = testing::host_randn({c.E, z_width, c.H}, dt, 1.0f / std::sqrt(float(c.H)), rng);
  in.w2 = testing::host_randn({c.E, c.H, c.I}, dt, 1.0f / std::sqrt(float(c.I)), rng);
  if (c.bias) {
    in.b1 = testing::host_randn({c.E, z_width}, dt, 0.1f, rng);
    in.b2 = testing::host_randn({c.E, c.H}, dt, 0.1f, rng);
  }
  in.d_out = testing::host_randn({c.T, c.H}, dt, 1.0f, rng);
  return in;
}

}  // namespace sonicmoe::testing_util

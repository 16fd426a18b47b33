// A random MoE problem for the FP8 layer tests (test_fp8_layer_stages.cpp, test_fp8_layer.cpp): X, dO, the weights
// and optional general-routing triples as library tensors of one storage dtype, from tests/naive_moe.h's data.
#pragma once

#include <random>
#include <vector>

#include "naive_moe.h"
#include "sonicmoe/moe.h"

namespace fp8_test {

using namespace sonicmoe;

struct Shape {
  int T, H, I, E, K;
};

struct Problem {
  MoEConfig cfg;
  Tensor x, d_out, router, w1, b1, w2, b2;
  Tensor gtok, gex, gsc;  // general routing triples (every 7th token gets no expert, so experts may be empty)
  MoEWeights weights() const {
    MoEWeights w;
    w.router = router;
    w.w1 = w1;
    w.w2 = w2;
    if (b1.defined()) w.b1 = b1;
    if (b2.defined()) w.b2 = b2;
    return w;
  }
  RoutingSpec spec(RoutingMode mode) const {
    RoutingSpec s;
    s.mode = mode;
    if (mode == RoutingMode::general) {
      s.token = gtok;
      s.expert = gex;
      s.score = gsc;
    }
    return s;
  }
  MoEWeights weights_for(RoutingMode mode) const {
    MoEWeights w = weights();
    if (mode == RoutingMode::general) w.router = TensorView();
    return w;
  }
};

// The same values (rounded to bf16 once) in the storage dtype dt, so a bf16 and an f32 problem of one seed hold
// equal numbers.
inline Problem make_problem(const Shape& s, Activation act, bool bias, DType dt, unsigned seed) {
  std::mt19937 rng(seed);
  naive::Config c{s.T, s.H, s.I, s.E, s.K, act, bias};
  const naive::Weights w = naive::random_weights(rng, c, 1.0);
  const naive::Vec x = naive::randn(rng, static_cast<size_t>(s.T) * s.H, 1.0);
  const naive::Vec dO = naive::randn(rng, static_cast<size_t>(s.T) * s.H, 1.0);
  auto t = [&](const naive::Vec& v, std::vector<std::int64_t> shape) {
    return naive::to_tensor(naive::stored(v, DType::bf16), shape, dt);
  };
  Problem p;
  p.cfg = naive::to_config(c);
  p.x = t(x, {s.T, s.H});
  p.d_out = t(dO, {s.T, s.H});
  p.router = t(w.router, {s.E, s.H});
  p.w1 = t(w.w1, {s.E, c.zw(), s.H});
  p.w2 = t(w.w2, {s.E, s.H, s.I});
  if (bias) {
    p.b1 = t(w.b1, {s.E, c.zw()});
    p.b2 = t(w.b2, {s.E, s.H});
  }
  naive::IVec tok, ex;
  naive::Vec sc;
  std::uniform_real_distribution<double> u(0.05, 1.0);
  for (int tk = 0; tk < s.T; ++tk)
    for (int k = 0; k < s.K && tk % 7 != 0; ++k) {
      tok.push_back(tk);
      ex.push_back((tk * 5 + k * 3) % s.E);  // distinct per token while 3 * (K - 1) < E
      sc.push_back(naive::stored(u(rng), DType::f32));
    }
  const std::int64_t N = static_cast<std::int64_t>(tok.size());
  p.gtok = naive::to_itensor(tok, {N});
  p.gex = naive::to_itensor(ex, {N});
  p.gsc = naive::to_tensor(sc, {N}, DType::f32);
  return p;
}

}  // namespace fp8_test

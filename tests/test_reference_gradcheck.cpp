// Central finite differences of L = <dO, O> + c * aux through moe_forward (CPU reference, f32 storage),
// against moe_backward, on tiny shapes. A perturbation is only used when it leaves the routing (the chosen
// pairs) unchanged and, for ReLU kinds, the sign pattern of Z unchanged (no kink crossed).
#include <gtest/gtest.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <functional>
#include <random>
#include <sstream>
#include <string>

#include "naive_moe.h"
#include "routing_util.h"
#include "sonicmoe/moe.h"

namespace {

using namespace sonicmoe;
using naive::IVec;
using naive::Vec;

constexpr double kEps = 1e-2;

// The checks run thousands of tiny forwards: one OpenMP thread each, so that ctest's parallel jobs do not
// make spinning OpenMP teams fight over the cores (tens of seconds per test otherwise). Restored after.
// (Without OpenMP, SONICMOE_OPENMP=OFF, there is nothing to restrict.)
class SingleThread {
#ifdef _OPENMP
 public:
  SingleThread() : prev_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThread() { omp_set_num_threads(prev_); }

 private:
  int prev_;
#endif
};
constexpr double kRelTol = 2e-3;

struct GCProblem {
  naive::Config c;
  RoutingMode mode = RoutingMode::topk;
  int tile = 2;
  Vec x, dO;
  naive::Weights w;
  IVec gtok, gex;
  Vec gsc;
  double caux = 0.0;
  RouterSpec router;  // top-K only; its bias comes from router_bias when that is not empty
  Vec router_bias;
};

struct Tensors {
  Tensor x, router, w1, b1, w2, b2, dO, gtok, gex, gsc, router_bias;
};

Tensors tensors_of(const GCProblem& p) {
  const auto& c = p.c;
  Tensors t;
  t.x = naive::to_tensor(p.x, {c.T, c.H});
  t.dO = naive::to_tensor(p.dO, {c.T, c.H});
  t.router = naive::to_tensor(p.w.router, {c.E, c.H});
  t.w1 = naive::to_tensor(p.w.w1, {c.E, c.zw(), c.H});
  t.w2 = naive::to_tensor(p.w.w2, {c.E, c.H, c.I});
  if (c.bias) {
    t.b1 = naive::to_tensor(p.w.b1, {c.E, c.zw()});
    t.b2 = naive::to_tensor(p.w.b2, {c.E, c.H});
  }
  const std::int64_t N = static_cast<std::int64_t>(p.gtok.size());
  t.gtok = naive::to_itensor(p.gtok, {N});
  t.gex = naive::to_itensor(p.gex, {N});
  t.gsc = naive::to_tensor(p.gsc, {N});
  if (!p.router_bias.empty()) t.router_bias = naive::to_tensor(p.router_bias, {c.E});
  return t;
}

MoEWeights weights_of(const GCProblem& p, const Tensors& t) {
  MoEWeights w;
  if (p.mode != RoutingMode::general) w.router = t.router;
  w.w1 = t.w1;
  w.w2 = t.w2;
  if (p.c.bias) {
    w.b1 = t.b1;
    w.b2 = t.b2;
  }
  return w;
}

RoutingSpec spec_of(const GCProblem& p, const Tensors& t) {
  RoutingSpec s;
  s.mode = p.mode;
  s.tile = p.tile;
  s.router = p.router;
  if (t.router_bias.defined()) s.router.e_score_correction_bias = t.router_bias;
  if (p.mode == RoutingMode::general) {
    s.token = t.gtok;
    s.expert = t.gex;
    s.score = t.gsc;
  }
  return s;
}

// What must not change under a perturbation: the pairs, and the signs of Z (ReLU kinks).
struct Signature {
  IVec pair_token, pair_expert;
  std::vector<int> z_sign;
  bool operator==(const Signature& o) const {
    return pair_token == o.pair_token && pair_expert == o.pair_expert && z_sign == o.z_sign;
  }
};

double loss(const GCProblem& p, Signature* sig) {
  Tensors t = tensors_of(p);
  ForwardResult f = moe_forward(Context{}, naive::to_config(p.c), t.x, weights_of(p, t), spec_of(p, t));
  Vec o = naive::from_tensor(f.output);
  double L = 0;
  for (size_t i = 0; i < o.size(); ++i) L += p.dO[i] * o[i];
  L += p.caux * naive::from_tensor(f.aux_loss).at(0);
  if (sig) {
    sig->pair_token = naive::ifrom_tensor(f.saved.routing.pair_token);
    sig->pair_expert = naive::ifrom_tensor(f.saved.routing.pair_expert);
    sig->z_sign.clear();
    const bool kinked = p.c.act == Activation::relu || p.c.act == Activation::reglu ||
                        p.c.act == Activation::relu_sq;
    if (kinked)
      for (double z : naive::from_tensor(f.saved.z)) sig->z_sign.push_back(z > 0 ? 1 : 0);
  }
  return L;
}

// The layer's forward and backward on the CPU reference for p (the analytic gradients), and the signature of the
// unperturbed problem that every finite-difference step must keep.
struct Analytic {
  ForwardResult f;
  Gradients g;
  Signature base;
};
Analytic run_layer(const GCProblem& p) {
  Tensors t = tensors_of(p);
  Context ctx;
  Analytic a;
  a.f = moe_forward(ctx, naive::to_config(p.c), t.x, weights_of(p, t), spec_of(p, t));
  a.g = moe_backward(ctx, t.x, weights_of(p, t), a.f.saved, t.dO, static_cast<float>(p.caux));
  loss(p, &a.base);
  return a;
}

// Random x, weights (router scale 3: well separated logits; biases when p.c.bias) and dO for p.c, stored as f32.
void fill_random(GCProblem& p, std::mt19937& rng) {
  p.x = naive::stored(naive::randn(rng, p.c.T * p.c.H, 1.0), DType::f32);
  p.w = naive::random_weights(rng, p.c, 3.0);
  p.w.router = naive::stored(p.w.router, DType::f32);
  p.w.w1 = naive::stored(p.w.w1, DType::f32);
  p.w.w2 = naive::stored(p.w.w2, DType::f32);
  if (p.c.bias) {
    p.w.b1 = naive::stored(p.w.b1, DType::f32);
    p.w.b2 = naive::stored(p.w.b2, DType::f32);
  }
  p.dO = naive::stored(naive::randn(rng, p.c.T * p.c.H, 1.0), DType::f32);
}

// FD-checks the gradient `analytic` of the parameter `param` (a member of p, modified in place and restored).
void check_param(GCProblem& p, Vec& param, const Vec& analytic, const char* name, const Signature& base) {
  SCOPED_TRACE(name);
  ASSERT_EQ(param.size(), analytic.size()) << name << ": gradient size";
  Vec fd_used, an_used;
  size_t skipped = 0;
  double amax = 0;
  for (double a : analytic) amax = std::max(amax, std::abs(a));
  for (size_t i = 0; i < param.size(); ++i) {
    const double orig = param[i];
    // Perturb the stored (f32) value; divide by the actual stored difference.
    const double hi = naive::stored(orig + kEps, DType::f32), lo = naive::stored(orig - kEps, DType::f32);
    Signature sp, sm;
    param[i] = hi;
    double Lp = loss(p, &sp);
    param[i] = lo;
    double Lm = loss(p, &sm);
    param[i] = orig;
    if (!(sp == base) || !(sm == base)) {
      ++skipped;
      continue;
    }
    double fd = (Lp - Lm) / (hi - lo);
    fd_used.push_back(fd);
    an_used.push_back(analytic[i]);
    EXPECT_NEAR(analytic[i], fd, kRelTol * std::abs(fd) + 2e-3 * amax + 1e-4)
        << name << "[" << i << "]: analytic " << analytic[i] << " vs finite difference " << fd;
  }
  EXPECT_LE(skipped, param.size() / 2) << name << ": too many perturbations changed the routing";
  ASSERT_FALSE(fd_used.empty());
  double err = naive::rel_err(an_used, fd_used);
  EXPECT_LE(err, kRelTol) << name << ": relative error of the gradient vs finite differences (" << fd_used.size()
                          << " of " << param.size() << " elements checked)";
}

struct GCCase {
  Activation act;
  RoutingMode mode;
  bool bias;
  unsigned seed = 0;  // data seed offset (chosen so that no rounding decision sits on a near-tie)
};

std::string gc_name(const testing::TestParamInfo<GCCase>& i) {
  std::string m = routing_mode_name(i.param.mode);
  for (auto& ch : m)
    if (ch == '-') ch = '_';
  return std::string(activation_name(i.param.act)) + "_" + m + (i.param.bias ? "_bias" : "_nobias");
}

class GradCheck : public testing::TestWithParam<GCCase> {};

TEST_P(GradCheck, FiniteDifferences) {
  SingleThread one_thread;
  const GCCase gc = GetParam();
  GCProblem p;
  p.c = {5, 8, 6, 4, 2, gc.act, gc.bias};
  p.mode = gc.mode;
  p.tile = 2;
  std::mt19937 rng(1234 + 17 * static_cast<unsigned>(gc.act) + 3 * static_cast<unsigned>(gc.mode) + 1000 * gc.seed);
  fill_random(p, rng);
  if (gc.mode == RoutingMode::general) {
    // Variable experts per token, token 2 with none.
    const int counts[5] = {2, 1, 0, 3, 4};
    std::uniform_real_distribution<double> u(0.1, 1.0);
    for (int t = 0; t < 5; ++t)
      for (int j = 0; j < counts[t]; ++j) {
        p.gtok.push_back(t);
        p.gex.push_back((t + j) % 4);
        p.gsc.push_back(naive::stored(u(rng), DType::f32));
      }
  } else {
    p.caux = 0.7;
  }

  const auto [f, g, base] = run_layer(p);
  if (gc.mode == RoutingMode::round_up) {
    // The test is only meaningful if some pairs come from outside the top-K (slot -1, full-softmax score).
    IVec slots = naive::ifrom_tensor(f.saved.routing.pair_slot);
    EXPECT_NE(std::count(slots.begin(), slots.end(), -1), 0) << "round-up added no pair outside the top-K";
  }

  check_param(p, p.x, naive::from_tensor(g.dx), "dx", base);
  check_param(p, p.w.w1, naive::from_tensor(g.dw1), "dw1", base);
  check_param(p, p.w.w2, naive::from_tensor(g.dw2), "dw2", base);
  if (gc.bias) {
    check_param(p, p.w.b1, naive::from_tensor(g.db1), "db1", base);
    check_param(p, p.w.b2, naive::from_tensor(g.db2), "db2", base);
  }
  if (gc.mode == RoutingMode::general) {
    EXPECT_FALSE(g.drouter.defined()) << "general routing has no router gradient";
    check_param(p, p.gsc, naive::from_tensor(g.dscore), "dscore", base);
  } else {
    ASSERT_TRUE(g.drouter.defined());
    check_param(p, p.w.router, naive::from_tensor(g.drouter), "drouter", base);
  }
}

const GCCase kCases[] = {
    {Activation::swiglu, RoutingMode::topk, false},
    {Activation::swiglu, RoutingMode::topk, true},
    {Activation::geglu, RoutingMode::topk, true},
    {Activation::gelu, RoutingMode::topk, false},
    {Activation::silu, RoutingMode::topk, true},
    {Activation::relu, RoutingMode::topk, true},
    {Activation::reglu, RoutingMode::topk, false},
    {Activation::relu_sq, RoutingMode::topk, true},
    {Activation::swiglu, RoutingMode::general, true},
    {Activation::geglu, RoutingMode::general, false},
    {Activation::gelu, RoutingMode::general, true},
    {Activation::silu, RoutingMode::general, false},
    {Activation::relu_sq, RoutingMode::general, true},
    {Activation::swiglu, RoutingMode::round_up, true},
    {Activation::gelu, RoutingMode::round_up, false},
    {Activation::silu, RoutingMode::round_down, true, 1},
    {Activation::geglu, RoutingMode::round_nearest, true},
};

INSTANTIATE_TEST_SUITE_P(Tiny, GradCheck, testing::ValuesIn(kCases), gc_name);

// Router variants (RouterSpec) through the whole layer: dx and drouter against finite differences of the loss, with
// the aux term. E = 8 experts, K = 2; groups of 2 experts where n_group = 4.
struct RouterGC {
  const char* name;
  ScoreFunction score;
  bool softmax_over_topk, norm;
  int n_group, topk_group;
  float scale;
  bool bias;
};

class GradCheckRouter : public testing::TestWithParam<RouterGC> {};

TEST_P(GradCheckRouter, FiniteDifferences) {
  SingleThread one_thread;
  const RouterGC rc = GetParam();
  GCProblem p;
  p.c = {5, 8, 6, 8, 2, Activation::swiglu, false};
  std::mt19937 rng(777);
  fill_random(p, rng);
  p.caux = 0.7;
  p.router = testing_util::router_spec(rc.score, rc.softmax_over_topk, rc.norm, rc.n_group, rc.topk_group, rc.scale);
  if (rc.bias) p.router_bias = naive::stored(naive::randn(rng, p.c.E, 0.3), DType::f32);
  const auto [f, g, base] = run_layer(p);
  check_param(p, p.x, naive::from_tensor(g.dx), "dx", base);
  ASSERT_TRUE(g.drouter.defined());
  check_param(p, p.w.router, naive::from_tensor(g.drouter), "drouter", base);
}

const RouterGC kRouterCases[] = {
    {"softmax_norm", ScoreFunction::softmax, false, true, 1, 1, 1.0f, false},
    {"softmax_full_scaled", ScoreFunction::softmax, false, false, 1, 1, 2.5f, false},
    {"softmax_topk_scaled", ScoreFunction::softmax, true, false, 1, 1, 0.5f, false},
    {"sigmoid", ScoreFunction::sigmoid, true, false, 1, 1, 1.0f, false},
    {"sigmoid_norm_bias_groups_scaled", ScoreFunction::sigmoid, true, true, 4, 2, 2.5f, true},
    {"softmax_full_bias_groups", ScoreFunction::softmax, false, true, 4, 3, 1.0f, true},
};

INSTANTIATE_TEST_SUITE_P(Tiny, GradCheckRouter, testing::ValuesIn(kRouterCases),
                         [](const testing::TestParamInfo<RouterGC>& i) { return std::string(i.param.name); });

// The aux-loss gradient alone: zero expert output (dO = 0), so L = c * aux and only the router moves.
TEST(GradCheckAux, AuxLossOnly) {
  SingleThread one_thread;
  GCProblem p;
  p.c = {6, 8, 6, 5, 2, Activation::swiglu, false};
  p.mode = RoutingMode::topk;
  std::mt19937 rng(99);
  fill_random(p, rng);
  p.dO.assign(p.c.T * p.c.H, 0.0);
  p.caux = 1.3;
  const auto [f, g, base] = run_layer(p);
  for (double v : naive::from_tensor(g.dw1)) EXPECT_EQ(v, 0.0);
  Vec dr = naive::from_tensor(g.drouter);
  double n = 0;
  for (double v : dr) n += v * v;
  EXPECT_GT(n, 0.0) << "the aux loss must reach the router";
  check_param(p, p.w.router, dr, "drouter (aux only)", base);
  check_param(p, p.x, naive::from_tensor(g.dx), "dx (aux only)", base);
}

}  // namespace

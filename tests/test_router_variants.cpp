// Router variants (RouterSpec) of the CPU reference: selection and weights against a naive, Hugging-Face-style
// formula (sorts and masks, weights in double), the router backward against central finite differences of the
// double-precision weight formula, and the validation messages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/router_math.h"
#include "error_of.h"
#include "reference/reference.h"
#include "reference/softmax.h"
#include "routing_util.h"
#include "sonicmoe/stages.h"

namespace sonicmoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing_util::error_of;

struct Variant {
  const char* name;
  ScoreFunction score;
  bool softmax_over_topk, norm;
  std::int64_t n_group, topk_group;
  float scale;
  bool bias;
  std::int64_t E, K;
};

const Variant kVariants[] = {
    {"softmax_norm", ScoreFunction::softmax, false, true, 1, 1, 1.0f, false, 60, 4},
    {"softmax_full_scaled", ScoreFunction::softmax, false, false, 1, 1, 2.5f, false, 37, 3},
    {"softmax_topk_scaled", ScoreFunction::softmax, true, false, 1, 1, 0.5f, false, 20, 2},
    {"sigmoid_k1", ScoreFunction::sigmoid, true, false, 1, 1, 1.0f, false, 7, 1},
    {"deepseek_v3", ScoreFunction::sigmoid, true, true, 8, 4, 2.5f, true, 256, 8},
    {"sigmoid_groups_e60", ScoreFunction::sigmoid, true, true, 4, 2, 1.0f, true, 60, 6},
    {"softmax_groups_bias", ScoreFunction::softmax, false, true, 6, 2, 1.0f, true, 48, 5},
};

RouterSpec spec_of(const Variant& v, const Tensor& bias) {
  RouterSpec r = testing_util::router_spec(v.score, v.softmax_over_topk, v.norm, v.n_group, v.topk_group, v.scale);
  if (v.bias) r.e_score_correction_bias = bias;
  return r;
}

// Logits on a coarse grid when `ties` (many exact ties in scores, keys and group sums), else normal.
std::vector<float> random_logits(std::int64_t T, std::int64_t E, bool ties, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> L(T * E);
  for (float& v : L) v = ties ? std::round(nd(rng) * 2.0f) * 0.5f : nd(rng);
  return L;
}

// The naive router of one row: float selection keys from the library's scalar functions, picks by sorting (stable:
// ties to the lower id) after masking the groups Hugging Face's way; weights in double.
void naive_row(const Variant& v, const float* row, const float* bias, std::vector<int>& ids, std::vector<double>& w) {
  const std::int64_t E = v.E, K = v.K;
  std::vector<float> s(E), key(E);
  const bool by_logit = v.score == ScoreFunction::softmax && v.softmax_over_topk;
  if (v.score == ScoreFunction::sigmoid)
    for (std::int64_t e = 0; e < E; ++e) s[e] = sigmoid_f32(row[e]);
  else
    ref::softmax_row(row, E, s.data());
  for (std::int64_t e = 0; e < E; ++e) key[e] = by_logit ? row[e] : s[e] + (bias ? bias[e] : 0.0f);
  std::vector<bool> allowed(E, true);
  if (v.n_group > 1) {
    const std::int64_t gs = E / v.n_group;
    std::vector<float> gscore(v.n_group);
    for (std::int64_t g = 0; g < v.n_group; ++g) {
      std::vector<float> grp(key.begin() + g * gs, key.begin() + (g + 1) * gs);
      std::sort(grp.begin(), grp.end(), std::greater<float>());
      gscore[g] = grp[0] + grp[1];
    }
    std::vector<int> order(v.n_group);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gscore[a] > gscore[b]; });
    for (std::int64_t j = v.topk_group; j < v.n_group; ++j)
      for (std::int64_t e = order[j] * gs; e < (order[j] + 1) * gs; ++e) allowed[e] = false;
  }
  std::vector<int> order;
  for (std::int64_t e = 0; e < E; ++e)
    if (allowed[e]) order.push_back(static_cast<int>(e));
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] > key[b]; });
  ids.assign(order.begin(), order.begin() + K);
  // Weights in double.
  w.assign(K, 0.0);
  double sum = 0.0;
  if (by_logit) {
    const double mx = row[ids[0]];
    for (std::int64_t k = 0; k < K; ++k) sum += w[k] = std::exp(row[ids[k]] - mx);
    for (double& x : w) x /= sum;
  } else {
    std::vector<double> sd(E);
    double den = 0.0, mx = *std::max_element(row, row + E);
    for (std::int64_t e = 0; e < E; ++e)
      sd[e] = v.score == ScoreFunction::sigmoid ? 1.0 / (1.0 + std::exp(-double(row[e]))) : std::exp(row[e] - mx);
    if (v.score == ScoreFunction::softmax)
      for (std::int64_t e = 0; e < E; ++e) den += sd[e];
    for (std::int64_t k = 0; k < K; ++k) sum += w[k] = v.score == ScoreFunction::softmax ? sd[ids[k]] / den : sd[ids[k]];
    if (v.norm)
      for (double& x : w) x /= sum + (v.score == ScoreFunction::sigmoid ? 1e-20 : 0.0);
  }
  for (double& x : w) x *= v.scale;
}

// The K weights of one row with the picks `ids` held fixed, in double (the function the backward differentiates).
std::vector<double> weights_fixed(const Variant& v, const std::vector<double>& row, const int* ids) {
  const std::int64_t E = v.E, K = v.K;
  std::vector<double> w(K);
  const bool topk = v.score == ScoreFunction::softmax && v.softmax_over_topk;
  double den = 0.0, sum = 0.0;
  if (v.score == ScoreFunction::softmax && !topk)
    for (std::int64_t e = 0; e < E; ++e) den += std::exp(row[e]);
  for (std::int64_t k = 0; k < K; ++k) {
    const double l = row[ids[k]];
    w[k] = topk ? std::exp(l) : v.score == ScoreFunction::sigmoid ? 1.0 / (1.0 + std::exp(-l)) : std::exp(l) / den;
    sum += w[k];
  }
  if (topk || v.norm)
    for (double& x : w) x /= sum + (v.score == ScoreFunction::sigmoid ? 1e-20 : 0.0);
  for (double& x : w) x *= v.scale;
  return w;
}

class RouterVariant : public ::testing::TestWithParam<Variant> {};

TEST_P(RouterVariant, MatchesNaiveRouter) {
  const Variant v = GetParam();
  std::mt19937 rng(99 + static_cast<unsigned>(v.E));
  for (bool ties : {false, true}) {
    SCOPED_TRACE(ties ? "ties" : "normal");
    const std::int64_t T = 64, E = v.E, K = v.K;
    const std::vector<float> L = random_logits(T, E, ties, rng);
    Tensor logits = Tensor::empty({T, E}, DType::f32), bias = Tensor::empty({E}, DType::f32);
    std::copy(L.begin(), L.end(), logits.ptr<float>());
    std::normal_distribution<float> nd(0.0f, 0.2f);
    for (std::int64_t e = 0; e < E; ++e) bias.ptr<float>()[e] = ties ? static_cast<float>(e % 3) * 0.125f : nd(rng);
    Tensor ids = Tensor::empty({T, K}, DType::i32), w = Tensor::empty({T, K}, DType::f32);
    Tensor cnt = Tensor::empty({E}, DType::i32);
    topk_softmax(Context{}, logits, K, ids, w, cnt, spec_of(v, bias));
    std::vector<int> want_cnt(E, 0);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<int> nid;
      std::vector<double> nw;
      naive_row(v, L.data() + t * E, v.bias ? bias.ptr<const float>() : nullptr, nid, nw);
      for (std::int64_t k = 0; k < K; ++k) {
        ASSERT_EQ(ids.ptr<const std::int32_t>()[t * K + k], nid[k]) << "token " << t << " slot " << k;
        EXPECT_NEAR(w.ptr<const float>()[t * K + k], nw[k], 2e-6 * std::max(1.0, std::fabs(nw[k])))
            << "token " << t << " slot " << k;
        ++want_cnt[nid[k]];
      }
    }
    for (std::int64_t e = 0; e < E; ++e) EXPECT_EQ(cnt.ptr<const std::int32_t>()[e], want_cnt[e]) << "counts " << e;
  }
}

// d(sum g w)/d(logits) of the reference router backward against central differences of weights_fixed.
TEST_P(RouterVariant, BackwardMatchesFiniteDifferences) {
  const Variant v = GetParam();
  std::mt19937 rng(7 + static_cast<unsigned>(v.E));
  const std::int64_t T = 6, E = v.E, K = v.K, N = T * K;
  const std::vector<float> L = random_logits(T, E, false, rng);
  Tensor logits = Tensor::empty({T, E}, DType::f32), bias = Tensor::empty({E}, DType::f32);
  std::copy(L.begin(), L.end(), logits.ptr<float>());
  for (std::int64_t e = 0; e < E; ++e) bias.ptr<float>()[e] = 0.1f * static_cast<float>(e % 5);
  Tensor ids = Tensor::empty({T, K}, DType::i32), sc = Tensor::empty({T, K}, DType::f32);
  Tensor pt = Tensor::empty({N}, DType::i32);
  const RouterSpec spec = spec_of(v, bias);
  const RoutingMetadata meta = topk_routing(Context{}, logits, K, ids, sc, pt, spec);
  const Routing r = testing_util::topk_routing_state(logits, K, ids, sc, pt, meta, spec);
  Tensor ds = Tensor::empty({N}, DType::f32), dl = Tensor::empty({T, E}, DType::f32);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t i = 0; i < N; ++i) ds.ptr<float>()[i] = nd(rng);
  router_backward(Context{}, r, ds, 0.0f, dl);
  const int* picks = ids.ptr<const int>();
  double amax = 0.0;
  for (std::int64_t i = 0; i < T * E; ++i) amax = std::max(amax, std::fabs(double(dl.ptr<const float>()[i])));
  ASSERT_GT(amax, 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> row(L.begin() + t * E, L.begin() + (t + 1) * E);
    for (std::int64_t e = 0; e < E; ++e) {
      const double h = 1e-5, orig = row[e];
      row[e] = orig + h;
      const std::vector<double> wp = weights_fixed(v, row, picks + t * K);
      row[e] = orig - h;
      const std::vector<double> wm = weights_fixed(v, row, picks + t * K);
      row[e] = orig;
      double fd = 0.0;
      for (std::int64_t k = 0; k < K; ++k) fd += ds.ptr<const float>()[t * K + k] * (wp[k] - wm[k]) / (2 * h);
      EXPECT_NEAR(dl.ptr<const float>()[t * E + e], fd, 1e-5 * amax + 1e-4 * std::fabs(fd))
          << "token " << t << " expert " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, RouterVariant, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.name); });

// norm_topk_probs under softmax over the top-K is a no-op: the default router, bit for bit.
TEST(RouterVariantDefault, NormUnderSoftmaxOverTopkIsTheDefault) {
  std::mt19937 rng(5);
  const std::vector<float> L = random_logits(50, 24, true, rng);
  Tensor logits = Tensor::empty({50, 24}, DType::f32);
  std::copy(L.begin(), L.end(), logits.ptr<float>());
  Tensor i0 = Tensor::empty({50, 3}, DType::i32), w0 = Tensor::empty({50, 3}, DType::f32);
  Tensor i1 = Tensor::empty({50, 3}, DType::i32), w1 = Tensor::empty({50, 3}, DType::f32);
  Tensor c0 = Tensor::empty({24}, DType::i32), c1 = Tensor::empty({24}, DType::i32);
  RouterSpec r;
  r.norm_topk_probs = true;
  EXPECT_TRUE(r.is_default());
  topk_softmax(Context{}, logits, 3, i0, w0, c0);
  topk_softmax(Context{}, logits, 3, i1, w1, c1, r);
  EXPECT_EQ(std::memcmp(i0.data(), i1.data(), i0.nbytes()), 0);
  EXPECT_EQ(std::memcmp(w0.data(), w1.data(), w0.nbytes()), 0);
}

// Every bad router argument is an Error naming it.
TEST(RouterVariantValidation, MessagesNameTheArgument) {
  constexpr std::int64_t T = 4, E = 16, K = 2;
  Tensor logits = Tensor::zeros({T, E}, DType::f32), ids = Tensor::empty({T, K}, DType::i32);
  Tensor w = Tensor::empty({T, K}, DType::f32), cnt = Tensor::empty({E}, DType::i32);
  auto msg = [&](const RouterSpec& r, std::int64_t k = 2) {  // 2 = K
    Tensor i2 = Tensor::empty({T, k}, DType::i32), w2 = Tensor::empty({T, k}, DType::f32);
    return error_of([&] { topk_softmax(Context{}, logits, k, i2, w2, cnt, r); });
  };
  RouterSpec sig;
  sig.score_function = ScoreFunction::sigmoid;
  RouterSpec r = sig;
  r.n_group = 3;
  EXPECT_THAT(msg(r), AllOf(HasSubstr("topk_softmax"), HasSubstr("router.n_group = 3"), HasSubstr("divide")));
  r = sig;
  r.n_group = 4;
  r.topk_group = 5;
  EXPECT_THAT(msg(r), HasSubstr("router.topk_group = 5"));
  r.topk_group = 0;
  EXPECT_THAT(msg(r), HasSubstr("router.topk_group = 0"));
  r.topk_group = 1;  // 1 group of 4 experts kept: K = 5 cannot be picked
  EXPECT_THAT(msg(r, 5), AllOf(HasSubstr("top_k = 5"), HasSubstr("topk_group")));
  r = sig;
  r.n_group = 16;  // groups of one expert
  r.topk_group = 2;
  EXPECT_THAT(msg(r), AllOf(HasSubstr("router.n_group = 16"), HasSubstr("groups of 1")));
  r = sig;
  r.n_group = 0;
  EXPECT_THAT(msg(r), HasSubstr("router.n_group = 0"));
  r = sig;
  r.routed_scaling_factor = 0.0f;
  EXPECT_THAT(msg(r), HasSubstr("router.routed_scaling_factor"));
  r.routed_scaling_factor = NAN;
  EXPECT_THAT(msg(r), HasSubstr("router.routed_scaling_factor"));
  r = sig;
  r.score_function = static_cast<ScoreFunction>(7);
  EXPECT_THAT(msg(r), HasSubstr("router.score_function = 7"));
  RouterSpec topk;  // softmax over the top-K selects by logit: no groups, no bias
  topk.n_group = 4;
  topk.topk_group = 2;
  EXPECT_THAT(msg(topk), AllOf(HasSubstr("router.n_group"), HasSubstr("softmax_over_topk")));
  Tensor bias = Tensor::zeros({E}, DType::f32);
  topk = RouterSpec{};
  topk.e_score_correction_bias = bias;
  EXPECT_THAT(msg(topk), AllOf(HasSubstr("e_score_correction_bias"), HasSubstr("softmax_over_topk")));
  r = sig;
  Tensor bad_shape = Tensor::zeros({E + 1}, DType::f32), bad_dtype = Tensor::zeros({E}, DType::i32);
  r.e_score_correction_bias = bad_shape;
  EXPECT_THAT(msg(r), AllOf(HasSubstr("router.e_score_correction_bias"), HasSubstr("[E]")));
  r.e_score_correction_bias = bad_dtype;
  EXPECT_THAT(msg(r), HasSubstr("router.e_score_correction_bias"));
}

// The layer refuses a non-default router with token rounding and general routing.
TEST(RouterVariantValidation, OnlyTopkRoutingTakesARouter) {
  MoEConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.hidden_size = 8;
  cfg.intermediate_size = 8;
  Tensor x = Tensor::zeros({4, 8}, DType::f32), wr = Tensor::zeros({8, 8}, DType::f32);
  RoutingSpec spec;
  spec.mode = RoutingMode::round_up;
  spec.router.score_function = ScoreFunction::sigmoid;
  EXPECT_THAT(error_of([&] { route(Context{}, cfg, x, wr, spec); }),
              AllOf(HasSubstr("spec.router"), HasSubstr("round-up")));
}

// ---- Capacity (RouterSpec::capacity_factor) ----------------------------------------------------------------------

// C = ceil(T*K / E * capacity_factor), capped at T (Megatron-LM's get_capacity of T*K tokens).
TEST(RouterCapacity, CapacityRule) {
  RouterSpec r;
  r.capacity_factor = 1.0;
  EXPECT_EQ(r.expert_capacity(64, 2, 8), 16);
  r.capacity_factor = 1.25;
  EXPECT_EQ(r.expert_capacity(64, 2, 8), 20);
  EXPECT_EQ(r.expert_capacity(10, 3, 7), 6);  // 30 / 7 * 1.25 = 5.36 -> 6
  r.capacity_factor = 0.01;
  EXPECT_EQ(r.expert_capacity(10, 1, 7), 1);  // never 0 while a pair exists
  r.capacity_factor = 100.0;
  EXPECT_EQ(r.expert_capacity(10, 2, 4), 10);  // capped at T
  EXPECT_FALSE(r.is_default());
  EXPECT_TRUE(r.scores_default());
}

struct CapacityCase {
  const char* name;
  std::int64_t T, E, K;
  double factor;
  bool sigmoid;
};

const CapacityCase kCapacityCases[] = {
    {"e8_k2_half", 96, 8, 2, 0.5, false},     {"e37_k3_tight", 200, 37, 3, 0.8, false},
    {"e7_k1", 50, 7, 1, 1.0, true},           {"e60_k4_generous", 64, 60, 4, 1.5, true},
    {"e16_k2_no_drop", 40, 16, 2, 8.0, false}, {"e256_k8", 130, 256, 8, 1.0, true},
};

class RouterCapacity : public ::testing::TestWithParam<CapacityCase> {};

// Metadata under a capacity against a naive drop: per expert, its pairs in pair order, the first C kept.
TEST_P(RouterCapacity, MetadataKeepsTheFirstCPairsOfEachExpert) {
  const CapacityCase c = GetParam();
  const std::int64_t T = c.T, E = c.E, K = c.K, N = T * K;
  std::mt19937 rng(11 + static_cast<unsigned>(E));
  const std::vector<float> L = random_logits(T, E, /*ties=*/true, rng);  // skewed towards low ids on ties
  Tensor logits = Tensor::empty({T, E}, DType::f32);
  std::copy(L.begin(), L.end(), logits.ptr<float>());
  RouterSpec r;
  if (c.sigmoid) r = testing_util::router_spec(ScoreFunction::sigmoid, true, true, 1, 1, 1.0f);
  r.capacity_factor = c.factor;
  const std::int64_t C = r.expert_capacity(T, K, E);
  Tensor ids = Tensor::empty({T, K}, DType::i32), sc = Tensor::empty({T, K}, DType::f32);
  Tensor pt = Tensor::empty({N}, DType::i32);
  const RoutingMetadata m = topk_routing(Context{}, logits, K, ids, sc, pt, r);
  ASSERT_TRUE(m.demand.defined() && m.dropped.defined());
  const std::int32_t* ex = ids.ptr<const std::int32_t>();
  std::vector<std::vector<int>> of(E);
  for (std::int64_t p = 0; p < N; ++p) of[ex[p]].push_back(static_cast<int>(p));
  std::vector<int> rev(N, -1), pair, gather, counts(E), offsets(E + 1, 0), demand(E);
  int dropped = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    demand[e] = static_cast<int>(of[e].size());
    counts[e] = static_cast<int>(std::min<std::int64_t>(of[e].size(), C));
    dropped += demand[e] - counts[e];
    offsets[e + 1] = offsets[e] + counts[e];
    for (int i = 0; i < counts[e]; ++i) {
      rev[of[e][i]] = static_cast<int>(pair.size());
      pair.push_back(of[e][i]);
      gather.push_back(static_cast<int>(of[e][i] / K));
    }
  }
  auto vec = [](const Tensor& t, std::int64_t n) {
    return std::vector<int>(t.ptr<const std::int32_t>(), t.ptr<const std::int32_t>() + n);
  };
  const std::int64_t rows = offsets[E];
  EXPECT_EQ(vec(m.counts, E), counts);
  EXPECT_EQ(vec(m.offsets, E + 1), offsets);
  EXPECT_EQ(vec(m.demand, E), demand);
  EXPECT_EQ(m.dropped.ptr<const std::int32_t>()[0], dropped);
  EXPECT_EQ(vec(m.pair, rows), pair);
  EXPECT_EQ(vec(m.gather, rows), gather);
  EXPECT_EQ(vec(m.rev, N), rev);
  EXPECT_EQ(m.num_pairs, N);  // the pair arrays keep all T*K pairs (top-K's p = t*K + k)
  if (std::string(c.name) == "e16_k2_no_drop") EXPECT_EQ(dropped, 0);
  else EXPECT_GT(dropped, 0) << "the case is meant to drop";
}

// The layer under a capacity equals the layer under general routing over the kept (token, expert, weight) triples,
// bit for bit (same rows in the same order, same sums): output, dX but the router's part, dW1, dW2 (and biases), the
// kept pairs' dscore; the dropped pairs' dscore is zero and the aux loss counts the router's choices (as without
// capacity).
TEST_P(RouterCapacity, LayerEqualsGeneralRoutingOverTheKeptPairs) {
  const CapacityCase c = GetParam();
  const std::int64_t T = std::min<std::int64_t>(c.T, 64), E = c.E, K = c.K, H = 24, I = 16;
  std::mt19937 rng(3 + static_cast<unsigned>(E));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randn = [&](std::vector<std::int64_t> shape, float sd) {
    Tensor t = Tensor::empty(shape, DType::f32);
    for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = round_to_bf16(sd * nd(rng));
    return t;
  };
  const MoEConfig cfg{E, K, H, I, Activation::swiglu, true};
  Tensor x = randn({T, H}, 1.0f), wr = randn({E, H}, 0.5f), dout = randn({T, H}, 1.0f);
  for (std::int64_t i = 0; i < T; ++i) x.ptr<float>()[i * H] += 2.0f;  // skew the router: more drops
  for (std::int64_t e = 0; e < E; ++e) wr.ptr<float>()[e * H] += 0.05f * static_cast<float>(E - e);
  const Tensor w1 = randn({E, 2 * I, H}, 0.2f), b1 = randn({E, 2 * I}, 0.1f), w2 = randn({E, H, I}, 0.2f),
               b2 = randn({E, H}, 0.1f);
  const MoEWeights w{wr, w1, b1, w2, b2};  // views: the tensors above own the data
  RoutingSpec spec;
  if (c.sigmoid) spec.router = testing_util::router_spec(ScoreFunction::sigmoid, true, true, 1, 1, 1.0f);
  spec.router.capacity_factor = c.factor;
  ForwardResult f = moe_forward(Context{}, cfg, x, w, spec);
  const Routing& R = f.saved.routing;
  validate_saved_state(Context{}, f.saved, T);
  RoutingSpec nocap = spec;
  nocap.router.capacity_factor = 0.0;
  const ForwardResult f0 = moe_forward(Context{}, cfg, x, w, nocap);
  EXPECT_EQ(f.aux_loss.ptr<const float>()[0], f0.aux_loss.ptr<const float>()[0]) << "aux loss over the choices";
  const std::int32_t* rev = R.meta.rev.ptr<const std::int32_t>();
  std::vector<std::int32_t> gt, ge;
  std::vector<float> gs;
  for (std::int64_t p = 0; p < T * K; ++p)
    if (rev[p] >= 0) {
      gt.push_back(static_cast<std::int32_t>(p / K));
      ge.push_back(R.topk_expert.ptr<const std::int32_t>()[p]);
      gs.push_back(R.topk_score.ptr<const float>()[p]);
    }
  const std::int64_t Nk = static_cast<std::int64_t>(gt.size());
  EXPECT_EQ(T * K - Nk, R.meta.dropped.ptr<const std::int32_t>()[0]);
  if (std::string(c.name) != "e16_k2_no_drop") EXPECT_LT(Nk, T * K) << "the case is meant to drop";
  RoutingSpec gen;
  gen.mode = RoutingMode::general;
  Tensor tt = Tensor::empty({Nk}, DType::i32), te = Tensor::empty({Nk}, DType::i32), ts = Tensor::empty({Nk}, DType::f32);
  std::copy(gt.begin(), gt.end(), tt.ptr<std::int32_t>());
  std::copy(ge.begin(), ge.end(), te.ptr<std::int32_t>());
  std::copy(gs.begin(), gs.end(), ts.ptr<float>());
  gen.token = tt;
  gen.expert = te;
  gen.score = ts;
  MoEConfig gcfg = cfg;
  gcfg.top_k = 1;
  MoEWeights gw = w;
  gw.router = TensorView();
  const ForwardResult fg = moe_forward(Context{}, gcfg, x, gw, gen);
  auto same = [](const Tensor& a, const Tensor& b, const char* what) {
    ASSERT_EQ(a.numel(), b.numel()) << what;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << what << " differs";
  };
  same(f.output, fg.output, "output");
  const Gradients g = moe_backward(Context{}, x, w, f.saved, dout, 0.0f);
  const Gradients gg = moe_backward(Context{}, x, gw, fg.saved, dout, 0.0f);
  same(g.dw1, gg.dw1, "dw1");
  same(g.db1, gg.db1, "db1");
  same(g.dw2, gg.dw2, "dw2");
  same(g.db2, gg.db2, "db2");
  std::int64_t q = 0;
  for (std::int64_t p = 0; p < T * K; ++p) {
    const float d = g.dscore.ptr<const float>()[p];
    if (rev[p] < 0) {
      EXPECT_EQ(d, 0.0f) << "dropped pair " << p;
    } else {
      EXPECT_EQ(d, gg.dscore.ptr<const float>()[q++]) << "kept pair " << p;
    }
  }
  // dX = the experts' part (general routing's dX) + dlogits Wr: the router's part from the same dscore.
  Tensor dl = Tensor::empty({T, E}, DType::f32);
  router_backward(Context{}, R, g.dscore, 0.0f, dl);
  Tensor dr = Tensor::empty({E, H}, DType::f32), dx = Tensor::empty({T, H}, DType::f32);
  std::memcpy(dx.data(), gg.dx.data(), dx.nbytes());
  router_weight_grad(Context{}, dl, x, wr, dr, dx);
  same(g.dx, dx, "dx");
  same(g.drouter, dr, "drouter");
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterCapacity, ::testing::ValuesIn(kCapacityCases),
                         [](const ::testing::TestParamInfo<CapacityCase>& i) { return std::string(i.param.name); });

// Capacity validation: a negative or non-finite factor; token rounding and general routing refuse it.
TEST(RouterCapacityValidation, Messages) {
  constexpr std::int64_t T = 4, E = 8, K = 2;
  Tensor logits = Tensor::zeros({T, E}, DType::f32), ids = Tensor::empty({T, K}, DType::i32);
  Tensor w = Tensor::empty({T, K}, DType::f32), cnt = Tensor::empty({E}, DType::i32);
  RouterSpec r;
  r.capacity_factor = -1.0;
  EXPECT_THAT(error_of([&] { topk_softmax(Context{}, logits, K, ids, w, cnt, r); }),
              HasSubstr("router.capacity_factor = -1"));
  r.capacity_factor = INFINITY;
  EXPECT_THAT(error_of([&] { topk_softmax(Context{}, logits, K, ids, w, cnt, r); }),
              HasSubstr("router.capacity_factor"));
  MoEConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = K;
  cfg.hidden_size = 8;
  cfg.intermediate_size = 8;
  Tensor x = Tensor::zeros({T, 8}, DType::f32), wr = Tensor::zeros({E, 8}, DType::f32);
  RoutingSpec spec;
  spec.mode = RoutingMode::round_up;
  spec.router.capacity_factor = 1.0;
  EXPECT_THAT(error_of([&] { route(Context{}, cfg, x, wr, spec); }), HasSubstr("spec.router"));
}

}  // namespace
}  // namespace sonicmoe

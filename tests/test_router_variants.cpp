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

}  // namespace
}  // namespace sonicmoe

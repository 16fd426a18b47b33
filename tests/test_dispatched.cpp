// The dispatched-token entries (include/sonicmoe/dispatched.h) on the cpu backend: against the float64 loops of
// naive_moe.h (output and every gradient), against the layer's general routing (bitwise: the same path), the
// two-part backward against the whole one (bitwise), the contract errors, and N = 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "ep_test_util.h"
#include "naive_moe.h"
#include "sonicmoe/dispatched.h"
#include "sonicmoe/error.h"

namespace {

using namespace sonicmoe;

using eptest::expect_close;
using eptest::f32;
using eptest::i32;
using eptest::vec;

// The two-part backward (with dW2 in part 2, then in part 1) gives bitwise `whole`'s gradients.
void expect_split_equals_whole(const Context& ctx, const TensorView& x, const MoEWeights& w,
                               const DispatchedForward& f, const TensorView& d_out, const DispatchedGradients& whole) {
  for (bool dw2_first : {false, true}) {
    WeightGradOperands keep;
    const DispatchedGradients p1 = moe_backward_dispatched_activations(ctx, x, w, f, d_out, keep, dw2_first);
    const ExpertWeightGradients p2 = moe_backward_dispatched_weights(ctx, x, w, f, d_out, keep);
    EXPECT_EQ(keep.as.defined(), !dw2_first);
    EXPECT_FALSE(p1.dw1.defined());
    EXPECT_EQ(p1.dw2.defined(), dw2_first);
    EXPECT_EQ(p2.dw2.defined(), !dw2_first);
    const ExpertWeightGradients& w2src = dw2_first ? static_cast<const ExpertWeightGradients&>(p1) : p2;
    EXPECT_EQ(vec(p1.dx), vec(whole.dx)) << "dx, dw2_first " << dw2_first;
    EXPECT_EQ(vec(p1.dweights), vec(whole.dweights)) << "dweights";
    EXPECT_EQ(vec(p2.dw1), vec(whole.dw1)) << "dw1";
    EXPECT_EQ(vec(w2src.dw2), vec(whole.dw2)) << "dw2";
    if (whole.db1.defined()) {
      EXPECT_EQ(vec(p2.db1), vec(whole.db1)) << "db1";
      EXPECT_EQ(vec(w2src.db2), vec(whole.db2)) << "db2";
    }
  }
}

// E local experts of one config and their weights, as library tensors and as naive float64 vectors.
struct Experts {
  MoEConfig cfg;
  Tensor w1, b1, w2, b2;
  naive::Config nc;
  naive::Weights nw;
  MoEWeights w() const { return {TensorView(), w1, cfg.add_bias ? b1.view() : TensorView(), w2,
                                 cfg.add_bias ? b2.view() : TensorView()}; }
};

Experts make_experts(std::int64_t E, std::int64_t H, std::int64_t I, Activation act, bool bias, std::uint32_t seed) {
  Experts x;
  x.cfg = eptest::expert_config(E, H, I, act, bias);
  const std::int64_t ZW = x.cfg.z_width();
  auto w1 = eptest::uniform(E * ZW * H, -0.3f, 0.3f, seed);
  auto b1 = eptest::uniform(E * ZW, -0.1f, 0.1f, seed + 1);
  auto w2 = eptest::uniform(E * H * I, -0.3f, 0.3f, seed + 2);
  auto b2 = eptest::uniform(E * H, -0.1f, 0.1f, seed + 3);
  x.w1 = f32(w1, {E, ZW, H});
  x.b1 = f32(b1, {E, ZW});
  x.w2 = f32(w2, {E, H, I});
  x.b2 = f32(b2, {E, H});
  x.nc.H = static_cast<int>(H);
  x.nc.I = static_cast<int>(I);
  x.nc.E = static_cast<int>(E);
  x.nc.K = 1;
  x.nc.act = act;
  x.nc.bias = bias;
  x.nw.w1.assign(w1.begin(), w1.end());
  x.nw.b1.assign(b1.begin(), b1.end());
  x.nw.w2.assign(w2.begin(), w2.end());
  x.nw.b2.assign(b2.begin(), b2.end());
  return x;
}

// The naive model over pairs (token, expert, score), N tokens.
struct NaiveRun {
  naive::Forward f;
  naive::Grads g;
};
NaiveRun run_naive(Experts& ex, int N, const std::vector<float>& x, const naive::IVec& tok, const naive::IVec& exp,
                   const naive::Vec& sc, const std::vector<float>& dout) {
  ex.nc.T = N;
  naive::Vec xd(x.begin(), x.end()), dd(dout.begin(), dout.end());
  const naive::Routing r = naive::route_general(tok, exp, sc, ex.nc.E);
  return {naive::forward(ex.nc, xd, ex.nw, r), naive::backward(ex.nc, xd, ex.nw, r, dd, 0.0)};
}

// DeepEP ids: -1 where `keep` fails; row 2 entirely -1; expert E-1 never used.
std::vector<std::int32_t> deepep_ids(int N, int K, int E, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<std::int32_t> idx(static_cast<std::size_t>(N * K));
  for (int n = 0; n < N; ++n) {
    std::vector<int> perm(E - 1);
    for (int e = 0; e < E - 1; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), g);
    for (int k = 0; k < K; ++k) idx[n * K + k] = (n == 2 || g() % 3 == 0) ? -1 : perm[k];
  }
  return idx;
}

class DeepEP : public ::testing::TestWithParam<std::tuple<Activation, bool>> {};

TEST_P(DeepEP, MatchesNaiveAndGeneralRouting) {
  const auto [act, bias] = GetParam();
  const int N = 9, K = 3, E = 5, H = 16, I = 8;
  Context ctx;
  Experts ex = make_experts(E, H, I, act, bias, 11);
  const auto x = eptest::uniform(N * H, -1.0f, 1.0f, 21);
  const auto wts = eptest::uniform(N * K, 0.1f, 1.0f, 22);
  const auto dout = eptest::uniform(N * H, -1.0f, 1.0f, 23);
  const auto idx = deepep_ids(N, K, E, 24);
  Tensor tx = f32(x, {N, H}), tidx = i32(idx, {N, K}), tw = f32(wts, {N, K}), td = f32(dout, {N, H});

  const DispatchedForward f = moe_forward_deepep(ctx, ex.cfg, tx, tidx, tw, ex.w());
  const DispatchedGradients g = moe_backward_dispatched(ctx, tx, ex.w(), f, td);
  expect_split_equals_whole(ctx, tx, ex.w(), f, td, g);

  naive::IVec tok, exp;
  naive::Vec sc;
  std::vector<int> slot;
  for (int s = 0; s < N * K; ++s)
    if (idx[s] >= 0) {
      tok.push_back(s / K);
      exp.push_back(idx[s]);
      sc.push_back(wts[s]);
      slot.push_back(s);
    }
  const NaiveRun nv = run_naive(ex, N, x, tok, exp, sc, dout);
  naive::Vec dweights(N * K, 0.0);
  for (std::size_t p = 0; p < slot.size(); ++p) dweights[slot[p]] = nv.g.dscore[p];

  const double tol = 2e-5;
  expect_close(vec(f.output), nv.f.out, tol, "out");
  expect_close(vec(g.dx), nv.g.dx, tol, "dx");
  expect_close(vec(g.dw1), nv.g.dw1, tol, "dw1");
  expect_close(vec(g.dw2), nv.g.dw2, tol, "dw2");
  if (bias) {
    expect_close(vec(g.db1), nv.g.db1, tol, "db1");
    expect_close(vec(g.db2), nv.g.db2, tol, "db2");
  }
  expect_close(vec(g.dweights), dweights, tol, "dweights");
  for (int s = 0; s < N * K; ++s)
    if (idx[s] < 0) EXPECT_EQ(vec(g.dweights)[s], 0.0f) << "slot " << s;

  // The same pairs through moe_forward's general routing: bitwise equal.
  std::vector<std::int32_t> t32(tok.begin(), tok.end()), e32(exp.begin(), exp.end());
  std::vector<float> s32(sc.begin(), sc.end());
  const std::int64_t P = static_cast<std::int64_t>(t32.size());
  RoutingSpec spec;
  spec.mode = RoutingMode::general;
  Tensor pt = i32(t32, {P}), pe = i32(e32, {P}), ps = f32(s32, {P});
  spec.token = pt;
  spec.expert = pe;
  spec.score = ps;
  const ForwardResult ref = moe_forward(ctx, ex.cfg, tx, ex.w(), spec);
  const Gradients rg = moe_backward(ctx, tx, ex.w(), ref.saved, td);
  EXPECT_EQ(vec(f.output), vec(ref.output));
  EXPECT_EQ(vec(g.dx), vec(rg.dx));
  EXPECT_EQ(vec(g.dw1), vec(rg.dw1));
  EXPECT_EQ(vec(g.dw2), vec(rg.dw2));

  // num_pairs given (the count a dispatcher reports): the same result.
  DispatchedOptions opt;
  opt.num_pairs = P;
  EXPECT_EQ(vec(moe_forward_deepep(ctx, ex.cfg, tx, tidx, tw, ex.w(), opt).output), vec(f.output));
}

INSTANTIATE_TEST_SUITE_P(Activations, DeepEP,
                         ::testing::Values(std::make_tuple(Activation::swiglu, true),
                                           std::make_tuple(Activation::gelu, false),
                                           std::make_tuple(Activation::relu_sq, true)));

TEST(Permuted, CountsAndOffsetsMatchNaive) {
  const int E = 4, H = 16, I = 8;
  const std::vector<std::int32_t> counts = {3, 0, 5, 2};  // expert 1 gets no rows
  const int N = 10;
  Context ctx;
  Experts ex = make_experts(E, H, I, Activation::swiglu, true, 31);
  const auto x = eptest::uniform(N * H, -1.0f, 1.0f, 41);
  const auto probs = eptest::uniform(N, 0.1f, 1.0f, 42);
  const auto dout = eptest::uniform(N * H, -1.0f, 1.0f, 43);
  Tensor tx = f32(x, {N, H}), tp = f32(probs, {N}), td = f32(dout, {N, H});

  naive::IVec tok, exp;
  naive::Vec sc(probs.begin(), probs.end());
  for (int e = 0, r = 0; e < E; ++e)
    for (int i = 0; i < counts[e]; ++i, ++r) {
      tok.push_back(r);
      exp.push_back(e);
    }
  const NaiveRun nv = run_naive(ex, N, x, tok, exp, sc, dout);

  std::vector<std::int32_t> offsets = {0};
  for (int e = 0; e < E; ++e) offsets.push_back(offsets.back() + counts[e]);
  for (const Tensor& tpe : {i32(counts, {E}), i32(offsets, {E + 1})}) {
    const DispatchedForward f = moe_forward_permuted(ctx, ex.cfg, tx, tpe, tp, ex.w());
    const DispatchedGradients g = moe_backward_dispatched(ctx, tx, ex.w(), f, td);
    expect_split_equals_whole(ctx, tx, ex.w(), f, td, g);
    const double tol = 2e-5;
    expect_close(vec(f.output), nv.f.out, tol, "out");
    expect_close(vec(g.dx), nv.g.dx, tol, "dx");
    expect_close(vec(g.dw1), nv.g.dw1, tol, "dw1");
    expect_close(vec(g.db1), nv.g.db1, tol, "db1");
    expect_close(vec(g.dw2), nv.g.dw2, tol, "dw2");
    expect_close(vec(g.db2), nv.g.db2, tol, "db2");
    expect_close(vec(g.dweights), nv.g.dscore, tol, "dprobs");
  }
}

TEST(Dispatched, NoRows) {
  Context ctx;
  Experts ex = make_experts(3, 8, 8, Activation::swiglu, true, 51);
  Tensor x = Tensor::empty({0, 8}, DType::f32), idx = Tensor::empty({0, 2}, DType::i32);
  Tensor w = Tensor::empty({0, 2}, DType::f32);
  const DispatchedForward f = moe_forward_deepep(ctx, ex.cfg, x, idx, w, ex.w());
  EXPECT_EQ(f.output.size(0), 0);
  const DispatchedGradients g = moe_backward_dispatched(ctx, x, ex.w(), f, x);
  EXPECT_EQ(g.dx.size(0), 0);
  EXPECT_EQ(g.dweights.size(0), 0);
  for (float v : vec(g.dw1)) ASSERT_EQ(v, 0.0f);
  for (float v : vec(g.db2)) ASSERT_EQ(v, 0.0f);
  expect_split_equals_whole(ctx, x, ex.w(), f, x, g);
  Tensor tpe = i32({0, 0, 0}, {3}), probs = Tensor::empty({0}, DType::f32);
  EXPECT_EQ(moe_forward_permuted(ctx, ex.cfg, x, tpe, probs, ex.w()).output.size(0), 0);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Dispatched, ContractErrorsNameTheArgument) {
  using ::testing::HasSubstr;
  Context ctx;
  const int N = 4, K = 2, E = 3, H = 8;
  Experts ex = make_experts(E, H, 8, Activation::swiglu, false, 61);
  Tensor x = f32(eptest::uniform(N * H, -1, 1, 62), {N, H});
  Tensor w = f32(eptest::uniform(N * K, 0, 1, 63), {N, K});
  auto deepep = [&](const std::vector<std::int32_t>& ids, const TensorView& wts, std::int64_t np = -1) {
    return error_of([&] {
      DispatchedOptions o;
      o.num_pairs = np;
      moe_forward_deepep(ctx, ex.cfg, x, i32(ids, {N, K}), wts, ex.w(), o);
    });
  };
  const std::vector<std::int32_t> good = {0, -1, 1, 2, -1, -1, 2, 0};
  EXPECT_THAT(deepep({0, -1, 1, 3, -1, -1, 2, 0}, w), HasSubstr("'recv_topk_idx'[1, 1] = 3 is out of range"));
  EXPECT_THAT(deepep({0, -2, 1, 2, -1, -1, 2, 0}, w), HasSubstr("'recv_topk_idx'[0, 1] = -2"));
  EXPECT_THAT(deepep(good, f32(std::vector<float>(N * 3), {N, 3})), HasSubstr("argument 'recv_topk_weights'"));
  EXPECT_THAT(deepep(good, i32(std::vector<std::int32_t>(N * K), {N, K})), HasSubstr("'recv_topk_weights' has dtype"));
  EXPECT_THAT(deepep(good, w, 4), HasSubstr("'opt.num_pairs' = 4, but recv_topk_idx has 5 ids"));
  EXPECT_THAT(deepep(good, w, 9), HasSubstr("'opt.num_pairs' = 9, expected -1"));
  EXPECT_EQ(deepep(good, w, 5), "(no error)");
  EXPECT_THAT(error_of([&] { moe_forward_deepep(ctx, ex.cfg, x, i32(good, {N * K}), w, ex.w()); }),
              HasSubstr("'recv_topk_idx' has 1 dimensions"));

  Tensor probs = f32(std::vector<float>(N, 0.5f), {N});
  auto permuted = [&](const TensorView& tpe, const TensorView& p) {
    return error_of([&] { moe_forward_permuted(ctx, ex.cfg, x, tpe, p, ex.w()); });
  };
  EXPECT_EQ(permuted(i32({1, 0, 3}, {3}), probs), "(no error)");
  EXPECT_THAT(permuted(i32({1, 0, 2}, {3}), probs), HasSubstr("'tokens_per_expert' sums to 3, expected N = 4"));
  EXPECT_THAT(permuted(i32({5, -1, 0}, {3}), probs), HasSubstr("'tokens_per_expert'[1] = -1 is negative"));
  EXPECT_THAT(permuted(i32({1, 3}, {2}), probs), HasSubstr("expected [E_local] = [3] (counts) or [E_local + 1]"));
  EXPECT_THAT(permuted(i32({1, 1, 3, 4}, {4}), probs), HasSubstr("(offsets) starts at 1"));
  EXPECT_THAT(permuted(i32({0, 3, 2, 4}, {4}), probs), HasSubstr("(offsets) decreases at 2"));
  EXPECT_THAT(permuted(i32({0, 1, 2, 3}, {4}), probs), HasSubstr("(offsets) ends at 3, expected N = 4"));
  EXPECT_THAT(permuted(i32({1, 0, 3}, {3}), f32({0.5f, 0.5f}, {2})), HasSubstr("argument 'probs' has shape [2]"));
  EXPECT_THAT(error_of([&] { moe_forward_permuted(ctx, ex.cfg, f32(std::vector<float>(N * 4), {N, 4}),
                                                  i32({1, 0, 3}, {3}), probs, ex.w()); }),
              HasSubstr("argument 'x_perm' has shape [4, 4]"));
}

}  // namespace

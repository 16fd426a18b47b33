// The expert-parallel layer (include/sonicmoe/ep.h) with R ranks as R threads (run_in_process, cpu backend) against
// the single-process moe_forward / moe_backward on the concatenated batch with the same weights: output, aux loss,
// dx, the experts' gradients and the router gradient summed over the ranks; bitwise repeatable.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include <mutex>
#include <numeric>

#include "ep_test_util.h"
#include "sonicmoe/ep.h"
#include "sonicmoe/error.h"

namespace {

using namespace sonicmoe;
using eptest::expect_close;
using eptest::f32;
using eptest::vec;

// A layer config of the error tests: E experts, top-K, H = I = 8.
MoEConfig small_config(int E, int K) {
  MoEConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = K;
  cfg.hidden_size = 8;
  cfg.intermediate_size = 8;
  return cfg;
}

struct Case {
  const char* name;
  int R;
  std::vector<int> tokens;  // per rank
  int E, K, H, I;
  Activation act;
  bool bias;
  std::vector<int> starved;  // experts made to receive no token (their router row pushes their logits down)
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Everything one run of the EP layer produces, per rank.
struct RankOut {
  std::vector<float> out, aux, dx, dw1, db1, dw2, db2, drouter;
  bool operator==(const RankOut& o) const {
    return out == o.out && aux == o.aux && dx == o.dx && dw1 == o.dw1 && db1 == o.db1 && dw2 == o.dw2 &&
           db2 == o.db2 && drouter == o.drouter;
  }
};

struct Problem {
  MoEConfig cfg;
  int T = 0;
  std::vector<float> x, dout, router, w1, b1, w2, b2;
  float d_aux = 0.37f;
};

Problem make_problem(const Case& c) {
  Problem p;
  p.cfg.num_experts = c.E;
  p.cfg.top_k = c.K;
  p.cfg.hidden_size = c.H;
  p.cfg.intermediate_size = c.I;
  p.cfg.activation = c.act;
  p.cfg.add_bias = c.bias;
  p.T = std::accumulate(c.tokens.begin(), c.tokens.end(), 0);
  const int ZW = static_cast<int>(p.cfg.z_width());
  p.x = eptest::uniform(static_cast<std::size_t>(p.T * c.H), 0.1f, 1.0f, 101);  // positive: see `starved`
  p.dout = eptest::uniform(static_cast<std::size_t>(p.T * c.H), -1.0f, 1.0f, 102);
  p.router = eptest::uniform(static_cast<std::size_t>(c.E * c.H), -0.5f, 0.5f, 103);
  for (int e : c.starved)
    for (int h = 0; h < c.H; ++h) p.router[static_cast<std::size_t>(e * c.H + h)] = -1.0f;
  p.w1 = eptest::uniform(static_cast<std::size_t>(c.E * ZW * c.H), -0.3f, 0.3f, 104);
  p.b1 = eptest::uniform(static_cast<std::size_t>(c.E * ZW), -0.1f, 0.1f, 105);
  p.w2 = eptest::uniform(static_cast<std::size_t>(c.E * c.H * c.I), -0.3f, 0.3f, 106);
  p.b2 = eptest::uniform(static_cast<std::size_t>(c.E * c.H), -0.1f, 0.1f, 107);
  return p;
}

// A view of rows [r0, r0 + n) of a row-major host buffer with `row` elements per row.
TensorView rows_of(std::vector<float>& v, std::int64_t r0, std::int64_t n, std::vector<std::int64_t> inner) {
  std::int64_t row = 1;
  for (auto d : inner) row *= d;
  std::vector<std::int64_t> shape = {n};
  shape.insert(shape.end(), inner.begin(), inner.end());
  return TensorView(v.data() + r0 * row, DType::f32, shape);
}

std::vector<RankOut> run_ep(const Case& c, Problem& p) {
  std::vector<RankOut> outs(static_cast<std::size_t>(c.R));
  const std::int64_t El = c.E / c.R, H = c.H, I = c.I, ZW = p.cfg.z_width();
  run_in_process(c.R, [&](Communicator& comm) {
    const int r = comm.rank();
    std::int64_t t0 = 0;
    for (int q = 0; q < r; ++q) t0 += c.tokens[static_cast<std::size_t>(q)];
    const std::int64_t T = c.tokens[static_cast<std::size_t>(r)];
    Context ctx;
    MoEWeights w;
    w.router = TensorView(p.router.data(), DType::f32, {c.E, H});
    w.w1 = rows_of(p.w1, r * El, El, {ZW, H});
    w.w2 = rows_of(p.w2, r * El, El, {H, I});
    if (c.bias) {
      w.b1 = rows_of(p.b1, r * El, El, {ZW});
      w.b2 = rows_of(p.b2, r * El, El, {H});
    }
    const TensorView x = rows_of(p.x, t0, T, {H}), dout = rows_of(p.dout, t0, T, {H});
    EPForwardResult f = ep_moe_forward(ctx, comm, p.cfg, x, w);
    EPGradients g = ep_moe_backward(ctx, comm, x, w, f.saved, dout, p.d_aux);
    RankOut& o = outs[static_cast<std::size_t>(r)];
    o.out = vec(f.output);
    o.aux = vec(f.aux_loss);
    o.dx = vec(g.dx);
    o.dw1 = vec(g.dw1);
    o.dw2 = vec(g.dw2);
    if (c.bias) {
      o.db1 = vec(g.db1);
      o.db2 = vec(g.db2);
    }
    o.drouter = vec(g.drouter);
  });
  return outs;
}

class EP : public ::testing::TestWithParam<Case> {};

TEST_P(EP, MatchesSingleProcessLayer) {
  const Case& c = GetParam();
  Problem p = make_problem(c);
  Context ctx;
  // The single-process layer on the whole batch.
  const std::int64_t H = c.H, ZW = p.cfg.z_width();
  MoEWeights w;
  w.router = TensorView(p.router.data(), DType::f32, {c.E, H});
  w.w1 = TensorView(p.w1.data(), DType::f32, {c.E, ZW, H});
  w.w2 = TensorView(p.w2.data(), DType::f32, {c.E, H, c.I});
  if (c.bias) {
    w.b1 = TensorView(p.b1.data(), DType::f32, {c.E, ZW});
    w.b2 = TensorView(p.b2.data(), DType::f32, {c.E, H});
  }
  const TensorView x(p.x.data(), DType::f32, {p.T, H}), dout(p.dout.data(), DType::f32, {p.T, H});
  const ForwardResult f = moe_forward(ctx, p.cfg, x, w);
  const Gradients g = moe_backward(ctx, x, w, f.saved, dout, p.d_aux);
  const std::vector<std::int32_t> counts(f.saved.routing.meta.counts.ptr<std::int32_t>(),
                                         f.saved.routing.meta.counts.ptr<std::int32_t>() + c.E);
  for (int e : c.starved) ASSERT_EQ(counts[static_cast<std::size_t>(e)], 0) << "expert " << e << " was to starve";

  const std::vector<RankOut> ep = run_ep(c, p);
  // Per-token results concatenated over the ranks; expert results concatenated; the router summed.
  std::vector<float> out, dx, dw1, db1, dw2, db2, drouter(static_cast<std::size_t>(c.E * H), 0.0f);
  for (const RankOut& o : ep) {
    out.insert(out.end(), o.out.begin(), o.out.end());
    dx.insert(dx.end(), o.dx.begin(), o.dx.end());
    dw1.insert(dw1.end(), o.dw1.begin(), o.dw1.end());
    dw2.insert(dw2.end(), o.dw2.begin(), o.dw2.end());
    db1.insert(db1.end(), o.db1.begin(), o.db1.end());
    db2.insert(db2.end(), o.db2.begin(), o.db2.end());
    for (std::size_t i = 0; i < drouter.size(); ++i) drouter[i] += o.drouter[i];
    expect_close(o.aux, vec(f.aux_loss), 1e-6, "aux_loss");
  }
  const double tol = 2e-5;
  expect_close(out, vec(f.output), tol, "output");
  expect_close(dx, vec(g.dx), tol, "dx");
  expect_close(dw1, vec(g.dw1), tol, "dw1");
  expect_close(dw2, vec(g.dw2), tol, "dw2");
  if (c.bias) {
    expect_close(db1, vec(g.db1), tol, "db1");
    expect_close(db2, vec(g.db2), tol, "db2");
  }
  expect_close(drouter, vec(g.drouter), tol, "drouter (sum over ranks)");

  // Bitwise repeatable, every rank, every result.
  const std::vector<RankOut> again = run_ep(c, p);
  for (int r = 0; r < c.R; ++r) EXPECT_TRUE(again[static_cast<std::size_t>(r)] == ep[static_cast<std::size_t>(r)])
      << "rank " << r << " differs between two runs";
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, EP,
    ::testing::Values(Case{"R1", 1, {13}, 4, 2, 16, 8, Activation::swiglu, true, {}},
                      Case{"R2_uneven_starved", 2, {11, 4}, 8, 2, 16, 8, Activation::swiglu, true, {3, 6}},
                      Case{"R2_rank_without_tokens", 2, {0, 9}, 4, 2, 16, 8, Activation::gelu, false, {}},
                      Case{"R2_k1", 2, {7, 10}, 4, 1, 16, 8, Activation::swiglu, false, {}},
                      Case{"R4_uneven", 4, {5, 0, 12, 3}, 8, 3, 16, 8, Activation::swiglu, true, {1}},
                      // rank 3 holds experts 6 and 7, which receive nothing: it runs the experts on 0 rows
                      Case{"R4_rank_receives_nothing", 4, {6, 8, 1, 4}, 8, 2, 16, 8, Activation::relu_sq, true,
                           {6, 7}}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// bf16 storage: the ranks' partial sums are rounded to bf16 before the combine adds them, so the result differs
// from the single-process layer (one rounding per token) by a few bf16 ulps.
std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16(v[i]);
  return b;
}

TEST(EPBf16, TwoRanksMatchSingleProcessLayer) {
  const Case c{"bf16", 2, {9, 6}, 4, 2, 16, 8, Activation::swiglu, false, {}};
  Problem p = make_problem(c);
  auto floats = [](const Tensor& t) {
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_float(t.ptr<bf16>()[i]);
    return v;
  };
  std::vector<bf16> x = to_bf16(p.x), dout = to_bf16(p.dout), router = to_bf16(p.router), w1 = to_bf16(p.w1),
                    w2 = to_bf16(p.w2);
  const std::int64_t H = c.H, I = c.I, ZW = p.cfg.z_width(), E = c.E, El = E / c.R;
  Context ctx;
  const MoEWeights w{TensorView(router.data(), DType::bf16, {E, H}), TensorView(w1.data(), DType::bf16, {E, ZW, H}),
                     TensorView(), TensorView(w2.data(), DType::bf16, {E, H, I}), TensorView()};
  const TensorView tx(x.data(), DType::bf16, {p.T, H}), td(dout.data(), DType::bf16, {p.T, H});
  const ForwardResult f = moe_forward(ctx, p.cfg, tx, w);
  const Gradients g = moe_backward(ctx, tx, w, f.saved, td);
  std::vector<std::vector<float>> out(2), dx(2);
  run_in_process(c.R, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::int64_t t0 = r == 0 ? 0 : c.tokens[0], T = c.tokens[static_cast<std::size_t>(r)];
    const MoEWeights lw{w.router, TensorView(w1.data() + r * El * ZW * H, DType::bf16, {El, ZW, H}), TensorView(),
                        TensorView(w2.data() + r * El * H * I, DType::bf16, {El, H, I}), TensorView()};
    const TensorView lx(x.data() + t0 * H, DType::bf16, {T, H}), ld(dout.data() + t0 * H, DType::bf16, {T, H});
    EPForwardResult ef = ep_moe_forward(ctx, comm, p.cfg, lx, lw);
    EPGradients eg = ep_moe_backward(ctx, comm, lx, lw, ef.saved, ld);
    out[static_cast<std::size_t>(r)] = floats(ef.output);
    dx[static_cast<std::size_t>(r)] = floats(eg.dx);
  });
  std::vector<float> all_out = out[0], all_dx = dx[0];
  all_out.insert(all_out.end(), out[1].begin(), out[1].end());
  all_dx.insert(all_dx.end(), dx[1].begin(), dx[1].end());
  expect_close(all_out, floats(f.output), 2e-2, "output (bf16)");
  expect_close(all_dx, floats(g.dx), 2e-2, "dx (bf16)");
}

// MoEWeights::w1_main_grad / w2_main_grad / router_main_grad through the EP layer (threads as ranks, bf16): each
// rank's local experts' and router's fp32 main_grads receive their gradients (rounded: bitwise the dW1 / dW2 / its
// drouter share of the same backward without them), which come back undefined; dx bitwise unchanged.
TEST(EPMainGrad, TwoRanksAddIntoTheLocalMainGrads) {
  const Case c{"bf16", 2, {9, 6}, 4, 2, 16, 8, Activation::swiglu, false, {}};
  Problem p = make_problem(c);
  std::vector<bf16> x = to_bf16(p.x), dout = to_bf16(p.dout), router = to_bf16(p.router), w1 = to_bf16(p.w1),
                    w2 = to_bf16(p.w2);
  const std::int64_t H = c.H, I = c.I, ZW = p.cfg.z_width(), E = c.E, El = E / c.R;
  Context ctx;
  std::vector<int> ok(2, 0);
  run_in_process(c.R, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::int64_t t0 = r == 0 ? 0 : c.tokens[0], T = c.tokens[static_cast<std::size_t>(r)];
    MoEWeights lw{TensorView(router.data(), DType::bf16, {E, H}),
                  TensorView(w1.data() + r * El * ZW * H, DType::bf16, {El, ZW, H}), TensorView(),
                  TensorView(w2.data() + r * El * H * I, DType::bf16, {El, H, I}), TensorView()};
    const TensorView lx(x.data() + t0 * H, DType::bf16, {T, H}), ld(dout.data() + t0 * H, DType::bf16, {T, H});
    EPForwardResult ef = ep_moe_forward(ctx, comm, p.cfg, lx, lw);
    const EPGradients plain = ep_moe_backward(ctx, comm, lx, lw, ef.saved, ld);
    Tensor m1 = Tensor::zeros({El, ZW, H}, DType::f32), m2 = Tensor::zeros({El, H, I}, DType::f32),
           mr = Tensor::zeros({E, H}, DType::f32);
    lw.w1_main_grad = m1;
    lw.w2_main_grad = m2;
    lw.router_main_grad = mr;
    const EPGradients g = ep_moe_backward(ctx, comm, lx, lw, ef.saved, ld);
    bool good = !g.dw1.defined() && !g.dw2.defined() && !g.drouter.defined() && plain.dw1.defined() &&
                plain.dw2.defined() && std::memcmp(g.dx.data(), plain.dx.data(), g.dx.nbytes()) == 0;
    for (std::int64_t i = 0; good && i < m1.numel(); ++i)
      good = float_to_bf16(m1.ptr<float>()[i]).bits == plain.dw1.ptr<bf16>()[i].bits;
    for (std::int64_t i = 0; good && i < m2.numel(); ++i)
      good = float_to_bf16(m2.ptr<float>()[i]).bits == plain.dw2.ptr<bf16>()[i].bits;
    for (std::int64_t i = 0; good && i < mr.numel(); ++i)
      good = float_to_bf16(mr.ptr<float>()[i]).bits == plain.drouter.ptr<bf16>()[i].bits;
    ok[static_cast<std::size_t>(r)] = good ? 1 : 0;
  });
  EXPECT_EQ(ok[0], 1);
  EXPECT_EQ(ok[1], 1);
}

TEST(EPErrors, Contract) {
  using ::testing::HasSubstr;
  const MoEConfig cfg = small_config(3, 1);
  std::vector<float> x(16, 0.5f), router(24, 0.1f);
  std::string msg;
  try {
    run_in_process(2, [&](Communicator& comm) {
      Context ctx;
      MoEWeights w;
      w.router = TensorView(router.data(), DType::f32, {3, 8});
      ep_moe_forward(ctx, comm, cfg, TensorView(x.data(), DType::f32, {2, 8}), w);
    });
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_THAT(msg, HasSubstr("config.num_experts = 3 is not divisible by the world size 2"));
  if (!nccl_available())
    EXPECT_THROW(make_nccl_communicator(&msg, 0), Error);
}

// The C++ EP layer stays bf16 / f32: f16 x is refused with an error that says so.
TEST(EPErrors, F16Refused) {
  using ::testing::AllOf;
  using ::testing::HasSubstr;
  const MoEConfig cfg = small_config(2, 1);
  std::vector<std::uint16_t> x(2 * 8, 0x3c00), router(2 * 8, 0x3c00);  // f16 ones
  std::string msg;
  try {
    run_in_process(1, [&](Communicator& comm) {
      Context ctx;
      MoEWeights w;
      w.router = TensorView(router.data(), DType::f16, {2, 8});
      ep_moe_forward(ctx, comm, cfg, TensorView(x.data(), DType::f16, {2, 8}), w);
    });
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_THAT(msg, AllOf(HasSubstr("'x'"), HasSubstr("f16"), HasSubstr("bf16 or f32")));
}

// A rank whose arguments are refused (here rank 1's x has the wrong width, then its d_out) still joins the first
// collective, so every rank stops there, naming the cause: the refusing rank with its own error, the others with
// "refused their arguments"; run_in_process reports the refusing rank's error. Forward and backward.
TEST(EPErrors, RefusingRankStopsEveryRank) {
  using ::testing::HasSubstr;
  const MoEConfig cfg = small_config(4, 2);
  const int R = 2;
  std::vector<float> router(4 * 8, 0.1f), w1(2 * 16 * 8, 0.01f), w2(2 * 8 * 8, 0.01f);
  std::vector<float> x(3 * 8, 0.5f), d_out(3 * 8, 1.0f);
  for (int phase = 0; phase < 2; ++phase) {
    std::vector<std::string> msgs(R);
    std::string top;
    try {
      run_in_process(R, [&](Communicator& comm) {
        Context ctx;
        MoEWeights w;
        w.router = TensorView(router.data(), DType::f32, {4, 8});
        w.w1 = TensorView(w1.data(), DType::f32, {2, 16, 8});
        w.w2 = TensorView(w2.data(), DType::f32, {2, 8, 8});
        const bool bad = comm.rank() == 1;
        const TensorView xv(x.data(), DType::f32, {3, 8});
        try {
          if (phase == 0) {
            ep_moe_forward(ctx, comm, cfg, bad ? TensorView(x.data(), DType::f32, {4, 6}) : xv, w);
          } else {
            EPForwardResult f = ep_moe_forward(ctx, comm, cfg, xv, w);
            ep_moe_backward(ctx, comm, xv, w, f.saved, TensorView(d_out.data(), DType::f32, {bad ? 2 : 3, 8}));
          }
        } catch (const Error& e) {
          msgs[static_cast<std::size_t>(comm.rank())] = e.what();
          throw;
        }
      });
    } catch (const Error& e) {
      top = e.what();
    }
    const char* arg = phase == 0 ? "'x'" : "'d_out'";
    EXPECT_THAT(msgs[1], HasSubstr(arg)) << phase;
    EXPECT_THAT(msgs[0], HasSubstr("1 rank(s) of the group refused their arguments")) << phase;
    EXPECT_EQ(top, msgs[1]) << phase;
  }
}

TEST(EPErrors, FailingRankAbortsTheGroup) {
  // Rank 1 throws before its first collective; rank 0 must not wait forever, and the rank's own error surfaces.
  std::string msg;
  try {
    run_in_process(2, [&](Communicator& comm) {
      if (comm.rank() == 1) throw Error("rank 1 failed on purpose");
      std::vector<float> v(4, 1.0f);
      comm.all_reduce_sum(TensorView(v.data(), DType::f32, {4}), nullptr);
    });
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "rank 1 failed on purpose");
}

}  // namespace

// Token rounding (DESIGN.md section 4) of the CPU reference: invariants on random and skewed logits, the
// exact choice against the naive float64 model, deterministic tie-breaking, and hand-derived small cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "naive_moe.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using naive::IVec;
using naive::Vec;

Routing run_rounding(const Vec& logits, int T, int E, int K, int tile, RoutingMode mode) {
  Tensor l = naive::to_tensor(logits, {T, E});
  return token_rounding(Context{}, l, K, tile, mode);
}

// Every invariant of DESIGN.md section 4 plus the exact comparison with the naive model.
void check_rounding(const Vec& logits, int T, int E, int K, int tile, RoutingMode mode) {
  Routing R = run_rounding(logits, T, E, K, tile, mode);
  naive::Routing nr = naive::route_rounding(logits, T, E, K, tile, mode);
  IVec ptok = naive::ifrom_tensor(R.pair_token), pex = naive::ifrom_tensor(R.pair_expert),
       pslot = naive::ifrom_tensor(R.pair_slot);
  Vec psc = naive::from_tensor(R.pair_score);
  IVec tex = naive::ifrom_tensor(R.topk_expert);
  Vec tsc = naive::from_tensor(R.topk_score);
  const int N = static_cast<int>(ptok.size());
  ASSERT_EQ(R.meta.num_pairs, N);
  ASSERT_EQ(static_cast<int>(pex.size()), N);
  ASSERT_EQ(static_cast<int>(pslot.size()), N);
  ASSERT_EQ(static_cast<int>(psc.size()), N);

  // The router's own top-K.
  EXPECT_EQ(tex, nr.topk_expert) << "topk_expert";
  EXPECT_LE(naive::rel_err(tsc, nr.topk_score), 1e-6) << "topk_score";
  std::vector<IVec> slot_of(T, IVec(E, -1));
  IVec f(E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      slot_of[t][nr.topk_expert[t * K + k]] = k;
      f[nr.topk_expert[t * K + k]]++;
    }

  // Per-expert row counts.
  IVec counts = naive::ifrom_tensor(R.meta.counts);
  ASSERT_EQ(static_cast<int>(counts.size()), E);
  long total = 0;
  for (int e = 0; e < E; ++e) {
    const int down = (f[e] / tile) * tile, up = std::min(((f[e] + tile - 1) / tile) * tile, T);
    EXPECT_TRUE(counts[e] % tile == 0 || counts[e] == T)
        << "expert " << e << ": " << counts[e] << " rows, neither a multiple of tile " << tile << " nor T = " << T;
    EXPECT_LE(counts[e], T);
    if (mode == RoutingMode::round_down) {
      EXPECT_EQ(counts[e], std::min(down, T)) << "expert " << e << " f=" << f[e];
    }
    if (mode == RoutingMode::round_up) {
      EXPECT_EQ(counts[e], up) << "expert " << e << " f=" << f[e];
    }
    if (mode == RoutingMode::round_nearest) {
      EXPECT_TRUE(counts[e] == down || counts[e] == up) << "expert " << e;
      EXPECT_EQ(counts[e], 2 * (f[e] % tile) >= tile ? up : down) << "expert " << e << " f=" << f[e];
    }
    total += counts[e];
  }
  EXPECT_EQ(total, N);
  if (mode == RoutingMode::round_down) {
    EXPECT_LE(N, T * K);
  }
  if (mode == RoutingMode::round_up) {
    EXPECT_GE(N, T * K);
  }

  // Pair order: by token, then strictly increasing expert; slots and scores as specified.
  std::set<std::pair<int, int>> chosen;
  for (int p = 0; p < N; ++p) {
    ASSERT_GE(ptok[p], 0);
    ASSERT_LT(ptok[p], T);
    ASSERT_GE(pex[p], 0);
    ASSERT_LT(pex[p], E);
    if (p > 0) {
      EXPECT_TRUE(ptok[p - 1] < ptok[p] || (ptok[p - 1] == ptok[p] && pex[p - 1] < pex[p]))
          << "pairs not sorted by (token, expert) at " << p;
    }
    chosen.insert({ptok[p], pex[p]});
    const int t = ptok[p], e = pex[p];
    EXPECT_EQ(pslot[p], slot_of[t][e]) << "slot of pair " << p << " (token " << t << ", expert " << e << ")";
    if (pslot[p] >= 0) {
      EXPECT_EQ(tex[t * K + pslot[p]], e);
      EXPECT_EQ(psc[p], tsc[t * K + pslot[p]]) << "a top-K pair's score is the K-way softmax score";
    } else {
      EXPECT_NEAR(psc[p], nr.probs[t * E + e], 1e-6) << "a non-top-K pair's score is the full softmax prob";
    }
    if (mode == RoutingMode::round_down) {
      EXPECT_GE(pslot[p], 0) << "round-down added a pair outside the top-K";
    }
  }
  if (mode == RoutingMode::round_up) {
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        EXPECT_TRUE(chosen.count({t, tex[t * K + k]}))
            << "round-up dropped top-K pair (" << t << ", " << tex[t * K + k] << ")";
      }
    }
  }

  // Exactly the naive choice.
  EXPECT_EQ(ptok, nr.token) << "pair_token differs from the naive ranking";
  EXPECT_EQ(pex, nr.expert) << "pair_expert differs from the naive ranking";

  // Metadata consistent with the pairs.
  naive::Metadata m = naive::metadata_of(ptok, pex, T, E);
  EXPECT_EQ(counts, m.counts);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.offsets), m.offsets);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.pair), m.pair);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.gather), m.gather);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.rev), m.rev);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.token_offsets), m.token_offsets);
}

struct RCase {
  const char* name;
  int T, E, K, tile;
  double skew;  // column bias strength: logits[t][e] += skew * (E - e) / E
  unsigned seed;
};

std::ostream& operator<<(std::ostream& os, const RCase& c) { return os << c.name; }

Vec make_logits(const RCase& c) {
  std::mt19937 rng(c.seed);
  Vec l = naive::randn(rng, static_cast<size_t>(c.T) * c.E, 1.0);
  for (int t = 0; t < c.T; ++t)
    for (int e = 0; e < c.E; ++e) l[t * c.E + e] += c.skew * (c.E - e) / c.E;
  return naive::stored(l, DType::f32);
}

const RCase kRCases[] = {
    {"T130_E8_K2_tile16", 130, 8, 2, 16, 0.0, 1},
    {"T200_E8_K2_tile16_skewed", 200, 8, 2, 16, 4.0, 2},
    {"T257_E16_K4_tile32_skewed", 257, 16, 4, 32, 8.0, 3},
    {"T130_E60_K4_tile8", 130, 60, 4, 8, 0.0, 4},
    {"T130_E2_K2_tile128_capped", 130, 2, 2, 128, 0.0, 5},
    {"T130_E2_K1_tile128", 130, 2, 1, 128, 1.0, 6},
    {"T1_E4_K2_tile4", 1, 4, 2, 4, 0.0, 7},
    {"T50_E5_K1_tile1", 50, 5, 1, 1, 0.0, 8},
    {"T40_E6_K6_tile16", 40, 6, 6, 16, 0.0, 9},
    {"T300_E12_K3_tile128_skewed", 300, 12, 3, 128, 6.0, 10},
};

const RoutingMode kModes[] = {RoutingMode::round_down, RoutingMode::round_up, RoutingMode::round_nearest};

class Rounding : public testing::TestWithParam<std::tuple<RCase, RoutingMode>> {};

TEST_P(Rounding, InvariantsAndNaiveChoice) {
  const auto& [c, mode] = GetParam();
  check_rounding(make_logits(c), c.T, c.E, c.K, c.tile, mode);
}

INSTANTIATE_TEST_SUITE_P(RandomAndSkewed, Rounding, testing::Combine(testing::ValuesIn(kRCases), testing::ValuesIn(kModes)),
                         [](const testing::TestParamInfo<std::tuple<RCase, RoutingMode>>& i) {
                           std::string m = routing_mode_name(std::get<1>(i.param));
                           for (auto& ch : m)
                             if (ch == '-') ch = '_';
                           return std::string(std::get<0>(i.param).name) + "_" + m;
                         });

// Rows of expert e as a sorted token list.
IVec tokens_of(const Routing& R, int e) {
  IVec ptok = naive::ifrom_tensor(R.pair_token), pex = naive::ifrom_tensor(R.pair_expert), out;
  for (size_t p = 0; p < ptok.size(); ++p)
    if (pex[p] == e) out.push_back(ptok[p]);
  return out;
}

// Identical rows: every tie is broken by the lower token id (derived by hand).
//   T=8, E=4, K=1, tile 4. Tokens != 5 have row [2, 1, 0.5, 0] (pick expert 0); token 5 has
//   [0, 1, 0.5, 2] (picks expert 3). f = {7, 0, 0, 1}.
TEST(RoundingTies, LowerTokenIdWins) {
  const int T = 8, E = 4, K = 1, tile = 4;
  Vec l;
  for (int t = 0; t < T; ++t) {
    if (t == 5) l.insert(l.end(), {0.0, 1.0, 0.5, 2.0});
    else l.insert(l.end(), {2.0, 1.0, 0.5, 0.0});
  }
  {
    // down: expert 0 keeps 4 of its 7 equal-score pickers: 0, 1, 2, 3. Expert 3: 0 rows.
    Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_down);
    EXPECT_EQ(tokens_of(R, 0), (IVec{0, 1, 2, 3}));
    EXPECT_EQ(tokens_of(R, 1), IVec{});
    EXPECT_EQ(tokens_of(R, 3), IVec{});
  }
  {
    // up: expert 0 -> 8 rows = every token (its 7 pickers, then token 5). Expert 3 -> 4 rows: token 5,
    // then the three best others, all tied on the softmax prob of expert 3: tokens 0, 1, 2.
    Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_up);
    EXPECT_EQ(tokens_of(R, 0), (IVec{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(tokens_of(R, 3), (IVec{0, 1, 2, 5}));
    EXPECT_EQ(tokens_of(R, 1), IVec{});
    EXPECT_EQ(tokens_of(R, 2), IVec{});
    // Token 5 is in expert 0 from outside its top-K: slot -1, score = full softmax prob of expert 0.
    IVec ptok = naive::ifrom_tensor(R.pair_token), pex = naive::ifrom_tensor(R.pair_expert),
         pslot = naive::ifrom_tensor(R.pair_slot);
    Vec psc = naive::from_tensor(R.pair_score);
    const double z = std::exp(0.0) + std::exp(1.0) + std::exp(0.5) + std::exp(2.0);
    bool found = false;
    for (size_t p = 0; p < ptok.size(); ++p)
      if (ptok[p] == 5 && pex[p] == 0) {
        found = true;
        EXPECT_EQ(pslot[p], -1);
        EXPECT_NEAR(psc[p], std::exp(0.0) / z, 1e-6);
      } else if (ptok[p] == 5 && pex[p] == 3) {
        EXPECT_EQ(pslot[p], 0);
        EXPECT_NEAR(psc[p], 1.0, 1e-6);  // K = 1: the renormalised score is 1
      }
    EXPECT_TRUE(found);
  }
  {
    // nearest: 7 mod 4 = 3 >= 2 -> up (8); 1 mod 4 = 1 < 2 -> down (0).
    Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_nearest);
    EXPECT_EQ(tokens_of(R, 0), (IVec{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(tokens_of(R, 3), IVec{});
  }
}

// Pickers ranked by renormalised score, not by id (derived by hand).
//   T=6, E=3, K=2, tile 4; token t's row is [a_t, 0, -5] with a = {1, 3, 2, 3, 0.5, 2.5}: every token picks
//   {0, 1}, score of expert 0 = sigmoid(a_t), of expert 1 = 1 - sigmoid(a_t). f = {6, 6, 0}; down -> 4 rows.
//   Expert 0 ranks a descending: 1, 3 (tie: lower id first), 5, 2, 0, 4 -> keeps {1, 3, 5, 2}.
//   Expert 1 ranks a ascending: 4, 0, 2, 5, 1, 3 -> keeps {4, 0, 2, 5}.
TEST(RoundingTies, PickersRankedByScore) {
  const int T = 6, E = 3, K = 2, tile = 4;
  const double a[6] = {1, 3, 2, 3, 0.5, 2.5};
  Vec l;
  for (int t = 0; t < T; ++t) l.insert(l.end(), {a[t], 0.0, -5.0});
  Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_down);
  EXPECT_EQ(tokens_of(R, 0), (IVec{1, 2, 3, 5}));
  EXPECT_EQ(tokens_of(R, 1), (IVec{0, 2, 4, 5}));
  EXPECT_EQ(tokens_of(R, 2), IVec{});
  EXPECT_EQ(naive::ifrom_tensor(R.pair_token), (IVec{0, 1, 2, 2, 3, 4, 5, 5}));
  EXPECT_EQ(naive::ifrom_tensor(R.pair_expert), (IVec{1, 0, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(naive::ifrom_tensor(R.pair_slot), (IVec{1, 0, 0, 1, 0, 1, 0, 1}));
  Vec sc = naive::from_tensor(R.pair_score);
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  const Vec want = {1 - sig(1), sig(3), sig(2), 1 - sig(2), sig(3), 1 - sig(0.5), sig(2.5), 1 - sig(2.5)};
  for (size_t i = 0; i < want.size() && i < sc.size(); ++i) EXPECT_NEAR(sc[i], want[i], 1e-6) << "pair " << i;
}

// Non-picking tokens ranked by full softmax prob (derived by hand).
//   T=5, E=2, K=1, tile 4, round-up. Rows [b_t, 0] with b = {1, 2, -3, 0.5, -1}: expert 0 is picked by
//   tokens 0, 1, 3 (f0 = 3 -> 4 rows); expert 1 by tokens 2, 4 (f1 = 2 -> 4 rows).
//   Expert 0 takes its 3 pickers then the best other by prob of expert 0 = sigmoid(b): token 4 (-1 > -3).
//   Expert 1 takes 2, 4 then the best others by prob of expert 1 = sigmoid(-b): token 3 (b=0.5), token 0 (b=1).
TEST(RoundingTies, OthersRankedByFullSoftmax) {
  const int T = 5, E = 2, K = 1, tile = 4;
  const double b[5] = {1, 2, -3, 0.5, -1};
  Vec l;
  for (int t = 0; t < T; ++t) l.insert(l.end(), {b[t], 0.0});
  Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_up);
  EXPECT_EQ(tokens_of(R, 0), (IVec{0, 1, 3, 4}));
  EXPECT_EQ(tokens_of(R, 1), (IVec{0, 2, 3, 4}));
}

// Capping: T = 3 < tile; round-up gives every expert with a picker all T tokens.
TEST(RoundingTies, CappedAtT) {
  const int T = 3, E = 4, K = 2, tile = 128;
  Vec l = {3, 2, 1, 0, 0, 3, 2, 1, 1, 0, 3, 2};  // picks {0,1}, {1,2}, {2,3}
  Routing R = run_rounding(l, T, E, K, tile, RoutingMode::round_up);
  EXPECT_EQ(naive::ifrom_tensor(R.meta.counts), (IVec{3, 3, 3, 3}));
  Routing D = run_rounding(l, T, E, K, tile, RoutingMode::round_down);
  EXPECT_EQ(naive::ifrom_tensor(D.meta.counts), (IVec{0, 0, 0, 0}));
  EXPECT_EQ(D.meta.num_pairs, 0);
  Routing Nn = run_rounding(l, T, E, K, tile, RoutingMode::round_nearest);  // f = 1, 2, 2, 1 < 64 -> 0
  EXPECT_EQ(naive::ifrom_tensor(Nn.meta.counts), (IVec{0, 0, 0, 0}));
}

// Same input, same answer, every time; and identical to the rounding inside the layer's route().
TEST(RoundingTies, DeterministicAcrossCalls) {
  RCase c{"det", 200, 8, 2, 16, 0.0, 42};
  Vec l = make_logits(c);
  // Many identical rows to stress ties.
  for (int t = 100; t < 200; ++t)
    for (int e = 0; e < c.E; ++e) l[t * c.E + e] = l[(t % 7) * c.E + e];
  for (RoutingMode mode : kModes) {
    Routing a = run_rounding(l, c.T, c.E, c.K, c.tile, mode);
    for (int rep = 0; rep < 3; ++rep) {
      Routing b = run_rounding(l, c.T, c.E, c.K, c.tile, mode);
      EXPECT_EQ(naive::ifrom_tensor(a.pair_token), naive::ifrom_tensor(b.pair_token));
      EXPECT_EQ(naive::ifrom_tensor(a.pair_expert), naive::ifrom_tensor(b.pair_expert));
      EXPECT_EQ(naive::ifrom_tensor(a.pair_slot), naive::ifrom_tensor(b.pair_slot));
      EXPECT_EQ(naive::from_tensor(a.pair_score), naive::from_tensor(b.pair_score));
      EXPECT_EQ(naive::ifrom_tensor(a.meta.pair), naive::ifrom_tensor(b.meta.pair));
    }
    check_rounding(l, c.T, c.E, c.K, c.tile, mode);
  }
}

TEST(RoundingTies, LayerRouteUsesTheSameRounding) {
  const int T = 90, H = 8, E = 6, K = 2;
  std::mt19937 rng(5);
  Vec x = naive::stored(naive::randn(rng, T * H, 1.0), DType::f32);
  Vec wr = naive::stored(naive::randn(rng, E * H, 0.7), DType::f32);
  MoEConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = K;
  cfg.hidden_size = H;
  cfg.intermediate_size = 4;
  for (RoutingMode mode : kModes) {
    RoutingSpec spec;
    spec.mode = mode;
    spec.tile = 8;
    Routing r = route(Context{}, cfg, naive::to_tensor(x, {T, H}), naive::to_tensor(wr, {E, H}), spec);
    EXPECT_EQ(r.mode, mode);
    Vec lg = naive::from_tensor(r.logits);
    ASSERT_EQ(static_cast<int>(lg.size()), T * E);
    naive::Routing nr = naive::route_rounding(lg, T, E, K, 8, mode);
    EXPECT_EQ(naive::ifrom_tensor(r.pair_token), nr.token);
    EXPECT_EQ(naive::ifrom_tensor(r.pair_expert), nr.expert);
    EXPECT_EQ(naive::ifrom_tensor(r.pair_slot), nr.slot);
    EXPECT_NEAR(naive::from_tensor(r.aux_loss).at(0), nr.aux, 1e-5 * nr.aux);
  }
}

}  // namespace

// A deliberately naive float64 model of the whole MoE layer (DESIGN.md sections 2-4), written from the
// specification only (never from src/reference): routing (top-K, general, token rounding), metadata,
// forward, the aux loss, and the backward derived by hand, loop by loop, for each token and each of its
// pairs. The tests compare the library's CPU reference against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "sonicmoe/moe.h"
#include "sonicmoe/types.h"

namespace naive {

using Vec = std::vector<double>;
using IVec = std::vector<int>;
using sonicmoe::Activation;
using sonicmoe::RoutingMode;

inline bool is_rounding(RoutingMode m) {
  return m == RoutingMode::round_down || m == RoutingMode::round_up || m == RoutingMode::round_nearest;
}

// ---- activations ---------------------------------------------------------------------------------

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// tanh GELU in its textbook form (the library writes it as x sigmoid(2u)).
inline double gelu_tanh_u(double x) { return std::sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x); }
inline double gelu_tanh(double x) { return 0.5 * x * (1.0 + std::tanh(gelu_tanh_u(x))); }
inline double dgelu_tanh(double x) {
  const double t = std::tanh(gelu_tanh_u(x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * std::sqrt(2.0 / 3.14159265358979323846) * (1.0 + 3 * 0.044715 * x * x);
}

// The scalar function f of an activation (the gate function of a GLU kind).
inline double act_f(Activation a, double x) {
  switch (a) {
    case Activation::swiglu:
    case Activation::silu: return x * sigmoid(x);
    case Activation::geglu:
    case Activation::gelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::geglu_tanh:
    case Activation::gelu_tanh: return gelu_tanh(x);
    case Activation::reglu:
    case Activation::relu: return x > 0 ? x : 0.0;
    case Activation::relu_sq: return x > 0 ? x * x : 0.0;
  }
  return 0.0;
}

// f'(x).
inline double act_df(Activation a, double x) {
  const double pi = 3.14159265358979323846;
  switch (a) {
    case Activation::swiglu:
    case Activation::silu: {
      double s = sigmoid(x);
      return s + x * s * (1.0 - s);
    }
    case Activation::geglu:
    case Activation::gelu:
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * pi);
    case Activation::geglu_tanh:
    case Activation::gelu_tanh: return dgelu_tanh(x);
    case Activation::reglu:
    case Activation::relu: return x > 0 ? 1.0 : 0.0;
    case Activation::relu_sq: return x > 0 ? 2.0 * x : 0.0;
  }
  return 0.0;
}

// ---- problem description -------------------------------------------------------------------------

struct Config {
  int T = 0, H = 0, I = 0, E = 0, K = 0;
  Activation act = Activation::swiglu;
  bool bias = false;
  int zw() const { return sonicmoe::is_glu(act) ? 2 * I : I; }
};

// Row-major, same layouts as the library: router [E,H], w1 [E,ZW,H], b1 [E,ZW], w2 [E,H,I], b2 [E,H].
struct Weights {
  Vec router, w1, b1, w2, b2;
};

// Pairs in token order (p = index). slot = k for the token's k-th top-K choice, -1 otherwise.
struct Routing {
  RoutingMode mode = RoutingMode::topk;
  int K = 0;
  Vec logits;        // [T,E] (router modes)
  Vec probs;         // [T,E] full softmax (router modes)
  IVec topk_expert;  // [T,K]
  Vec topk_score;    // [T,K]
  IVec token, expert, slot;
  Vec score;
  IVec counts;  // [E] rows per expert
  double aux = 0.0;
};

struct Metadata {
  IVec counts, offsets, pair, gather, rev, token_offsets;
};

struct Grads {
  Vec dx, dw1, db1, dw2, db2, drouter, dscore, dlogits;
};

// ---- routing --------------------------------------------------------------------------------------

inline Vec logits_of(const Config& c, const Vec& x, const Vec& router) {
  Vec l(static_cast<size_t>(c.T) * c.E, 0.0);
  for (int t = 0; t < c.T; ++t)
    for (int e = 0; e < c.E; ++e) {
      double acc = 0;
      for (int h = 0; h < c.H; ++h) acc += x[t * c.H + h] * router[e * c.H + h];
      l[t * c.E + e] = acc;
    }
  return l;
}

inline Vec softmax_rows(const Vec& l, int T, int E) {
  Vec p(l.size());
  for (int t = 0; t < T; ++t) {
    double m = -INFINITY;
    for (int e = 0; e < E; ++e) m = std::max(m, l[t * E + e]);
    double s = 0;
    for (int e = 0; e < E; ++e) s += std::exp(l[t * E + e] - m);
    for (int e = 0; e < E; ++e) p[t * E + e] = std::exp(l[t * E + e] - m) / s;
  }
  return p;
}

// The K largest of one row, descending, ties to the lower id (K passes of "strictly greater" search).
inline IVec topk_row(const double* row, int E, int K) {
  std::vector<bool> used(E, false);
  IVec out;
  for (int k = 0; k < K; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (!used[e] && (best < 0 || row[e] > row[best])) best = e;
    used[best] = true;
    out.push_back(best);
  }
  return out;
}

// Top-K choice and its K-way softmax for every token.
inline void topk_all(const Vec& logits, int T, int E, int K, IVec& ex, Vec& sc) {
  ex.assign(static_cast<size_t>(T) * K, 0);
  sc.assign(static_cast<size_t>(T) * K, 0.0);
  for (int t = 0; t < T; ++t) {
    IVec sel = topk_row(&logits[static_cast<size_t>(t) * E], E, K);
    double m = logits[t * E + sel[0]];
    double s = 0;
    for (int k = 0; k < K; ++k) s += std::exp(logits[t * E + sel[k]] - m);
    for (int k = 0; k < K; ++k) {
      ex[t * K + k] = sel[k];
      sc[t * K + k] = std::exp(logits[t * E + sel[k]] - m) / s;
    }
  }
}

inline double aux_of(const Vec& probs, const IVec& counts, int T, int E) {
  double F = 0;
  for (int e = 0; e < E; ++e) F += counts[e];
  if (F == 0) return 0.0;
  double aux = 0;
  for (int e = 0; e < E; ++e) {
    double P = 0;
    for (int t = 0; t < T; ++t) P += probs[t * E + e];
    aux += (P / T) * (counts[e] / F);
  }
  return E * aux;
}

inline Routing route_topk(const Vec& logits, int T, int E, int K) {
  Routing r;
  r.mode = RoutingMode::topk;
  r.K = K;
  r.logits = logits;
  r.probs = softmax_rows(logits, T, E);
  topk_all(logits, T, E, K, r.topk_expert, r.topk_score);
  r.counts.assign(E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      r.token.push_back(t);
      r.expert.push_back(r.topk_expert[t * K + k]);
      r.score.push_back(r.topk_score[t * K + k]);
      r.slot.push_back(k);
      r.counts[r.topk_expert[t * K + k]]++;
    }
  r.aux = aux_of(r.probs, r.counts, T, E);
  return r;
}

inline Routing route_general(const IVec& token, const IVec& expert, const Vec& score, int E) {
  Routing r;
  r.mode = RoutingMode::general;
  r.token = token;
  r.expert = expert;
  r.score = score;
  r.slot.assign(token.size(), -1);
  r.counts.assign(E, 0);
  for (int e : expert) r.counts[e]++;
  r.aux = 0.0;
  return r;
}

// Rows an expert with f top-K pickers receives under a rounding mode (before the cap at T).
inline int rounded_count(int f, int tile, RoutingMode mode) {
  int down = (f / tile) * tile;
  int up = ((f + tile - 1) / tile) * tile;
  if (mode == RoutingMode::round_down) return down;
  if (mode == RoutingMode::round_up) return up;
  return 2 * (f % tile) >= tile ? up : down;
}

inline Routing route_rounding(const Vec& logits, int T, int E, int K, int tile, RoutingMode mode) {
  Routing r;
  r.mode = mode;
  r.K = K;
  r.logits = logits;
  r.probs = softmax_rows(logits, T, E);
  topk_all(logits, T, E, K, r.topk_expert, r.topk_score);
  // slot_of[t][e]: k if e is token t's k-th choice, else -1.
  std::vector<IVec> slot_of(T, IVec(E, -1));
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) slot_of[t][r.topk_expert[t * K + k]] = k;
  std::vector<std::vector<bool>> chosen(T, std::vector<bool>(E, false));
  for (int e = 0; e < E; ++e) {
    IVec pickers, others;
    for (int t = 0; t < T; ++t) (slot_of[t][e] >= 0 ? pickers : others).push_back(t);
    auto key_pick = [&](int t) { return r.topk_score[t * K + slot_of[t][e]]; };
    auto key_other = [&](int t) { return r.probs[t * E + e]; };
    std::stable_sort(pickers.begin(), pickers.end(), [&](int a, int b) {
      if (key_pick(a) != key_pick(b)) return key_pick(a) > key_pick(b);
      return a < b;
    });
    std::stable_sort(others.begin(), others.end(), [&](int a, int b) {
      if (key_other(a) != key_other(b)) return key_other(a) > key_other(b);
      return a < b;
    });
    IVec ranking = pickers;
    ranking.insert(ranking.end(), others.begin(), others.end());
    int n = std::min(rounded_count(static_cast<int>(pickers.size()), tile, mode), T);
    for (int i = 0; i < n; ++i) chosen[ranking[i]][e] = true;
  }
  r.counts.assign(E, 0);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      if (chosen[t][e]) {
        r.token.push_back(t);
        r.expert.push_back(e);
        int k = slot_of[t][e];
        r.slot.push_back(k);
        r.score.push_back(k >= 0 ? r.topk_score[t * K + k] : r.probs[t * E + e]);
        r.counts[e]++;
      }
  r.aux = aux_of(r.probs, r.counts, T, E);
  return r;
}

inline Metadata metadata_of(const IVec& token, const IVec& expert, int T, int E) {
  Metadata m;
  const int N = static_cast<int>(token.size());
  m.counts.assign(E, 0);
  for (int e : expert) m.counts[e]++;
  m.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) m.offsets[e + 1] = m.offsets[e] + m.counts[e];
  m.pair.clear();
  for (int e = 0; e < E; ++e)
    for (int p = 0; p < N; ++p)
      if (expert[p] == e) m.pair.push_back(p);
  m.gather.resize(N);
  m.rev.resize(N);
  for (int r = 0; r < N; ++r) {
    m.gather[r] = token[m.pair[r]];
    m.rev[m.pair[r]] = r;
  }
  m.token_offsets.assign(T + 1, 0);
  for (int t = 0; t <= T; ++t) {
    int first = 0;
    while (first < N && token[first] < t) ++first;
    m.token_offsets[t] = first;
  }
  return m;
}

// ---- expert computation ---------------------------------------------------------------------------

// z = W1[e] x_t (+ b1[e]), a = act(z), y = W2[e] a (+ b2[e]) for one pair.
struct PairActs {
  Vec z, a, y;
};

inline PairActs pair_forward(const Config& c, const Vec& x, const Weights& w, int t, int e) {
  const int ZW = c.zw(), H = c.H, I = c.I;
  PairActs pa;
  pa.z.assign(ZW, 0.0);
  for (int j = 0; j < ZW; ++j) {
    double acc = c.bias ? w.b1[e * ZW + j] : 0.0;
    for (int h = 0; h < H; ++h) acc += w.w1[(static_cast<size_t>(e) * ZW + j) * H + h] * x[t * H + h];
    pa.z[j] = acc;
  }
  pa.a.assign(I, 0.0);
  for (int i = 0; i < I; ++i) {
    if (sonicmoe::is_glu(c.act)) pa.a[i] = act_f(c.act, pa.z[2 * i]) * pa.z[2 * i + 1];
    else pa.a[i] = act_f(c.act, pa.z[i]);
  }
  pa.y.assign(H, 0.0);
  for (int h = 0; h < H; ++h) {
    double acc = c.bias ? w.b2[e * H + h] : 0.0;
    for (int i = 0; i < I; ++i) acc += w.w2[(static_cast<size_t>(e) * H + h) * I + i] * pa.a[i];
    pa.y[h] = acc;
  }
  return pa;
}

struct Forward {
  Vec out;  // [T,H]
  std::vector<Vec> z;  // per pair p
};

inline Forward forward(const Config& c, const Vec& x, const Weights& w, const Routing& r) {
  Forward f;
  f.out.assign(static_cast<size_t>(c.T) * c.H, 0.0);
  for (size_t p = 0; p < r.token.size(); ++p) {
    const int t = r.token[p], e = r.expert[p];
    PairActs pa = pair_forward(c, x, w, t, e);
    for (int h = 0; h < c.H; ++h) f.out[t * c.H + h] += r.score[p] * pa.y[h];
    f.z.push_back(pa.z);
  }
  return f;
}

// L = <dO, O> + d_aux * aux, differentiated by hand. Counts (and the choice of pairs) are constants.
inline Grads backward(const Config& c, const Vec& x, const Weights& w, const Routing& r, const Vec& dO,
                      double d_aux) {
  const int T = c.T, H = c.H, I = c.I, E = c.E, ZW = c.zw();
  Grads g;
  g.dx.assign(static_cast<size_t>(T) * H, 0.0);
  g.dw1.assign(static_cast<size_t>(E) * ZW * H, 0.0);
  g.db1.assign(static_cast<size_t>(E) * ZW, 0.0);
  g.dw2.assign(static_cast<size_t>(E) * H * I, 0.0);
  g.db2.assign(static_cast<size_t>(E) * H, 0.0);
  g.dscore.assign(r.token.size(), 0.0);

  // Expert part: for each token, for each of its pairs.
  for (int t = 0; t < T; ++t) {
    for (size_t p = 0; p < r.token.size(); ++p) {
      if (r.token[p] != t) continue;
      const int e = r.expert[p];
      const double s = r.score[p];
      PairActs pa = pair_forward(c, x, w, t, e);
      // dL/ds_p = <dO_t, y_p>
      double ds = 0;
      for (int h = 0; h < H; ++h) ds += dO[t * H + h] * pa.y[h];
      g.dscore[p] = ds;
      // dy = s * dO_t
      Vec dy(H);
      for (int h = 0; h < H; ++h) dy[h] = s * dO[t * H + h];
      // y = W2 a + b2
      Vec da(I, 0.0);
      for (int h = 0; h < H; ++h) {
        if (c.bias) g.db2[e * H + h] += dy[h];
        for (int i = 0; i < I; ++i) {
          g.dw2[(static_cast<size_t>(e) * H + h) * I + i] += dy[h] * pa.a[i];
          da[i] += w.w2[(static_cast<size_t>(e) * H + h) * I + i] * dy[h];
        }
      }
      // a = act(z)
      Vec dz(ZW, 0.0);
      for (int i = 0; i < I; ++i) {
        if (sonicmoe::is_glu(c.act)) {
          double gate = pa.z[2 * i], up = pa.z[2 * i + 1];
          dz[2 * i] = act_df(c.act, gate) * up * da[i];
          dz[2 * i + 1] = act_f(c.act, gate) * da[i];
        } else {
          dz[i] = act_df(c.act, pa.z[i]) * da[i];
        }
      }
      // z = W1 x + b1
      for (int j = 0; j < ZW; ++j) {
        if (c.bias) g.db1[e * ZW + j] += dz[j];
        for (int h = 0; h < H; ++h) {
          g.dw1[(static_cast<size_t>(e) * ZW + j) * H + h] += dz[j] * x[t * H + h];
          g.dx[t * H + h] += w.w1[(static_cast<size_t>(e) * ZW + j) * H + h] * dz[j];
        }
      }
    }
  }
  if (r.mode == RoutingMode::general) return g;

  // Router part: dL/dlogits, then logits = X Wr^T.
  g.dlogits.assign(static_cast<size_t>(T) * E, 0.0);
  const int K = r.K;
  for (int t = 0; t < T; ++t) {
    // K-way softmax: gather dL/ds for each of the token's K slots (0 if the pair was not kept).
    Vec ds_slot(K, 0.0);
    for (size_t p = 0; p < r.token.size(); ++p) {
      if (r.token[p] != t) continue;
      if (r.slot[p] >= 0) {
        ds_slot[r.slot[p]] += g.dscore[p];
      } else {
        // score = probs[t, e] (full softmax): d p_e / d l_i = p_e (delta_ei - p_i)
        const int e = r.expert[p];
        for (int i = 0; i < E; ++i) {
          double d = (i == e ? 1.0 : 0.0) - r.probs[t * E + i];
          g.dlogits[t * E + i] += g.dscore[p] * r.probs[t * E + e] * d;
        }
      }
    }
    // s_j = exp(l_j) / sum_k exp(l_k) over the selected experts: d s_j / d l_i = s_j (delta_ij - s_i)
    for (int j = 0; j < K; ++j)
      for (int i = 0; i < K; ++i) {
        double sj = r.topk_score[t * K + j], si = r.topk_score[t * K + i];
        double d = (i == j ? 1.0 : 0.0) - si;
        g.dlogits[t * E + r.topk_expert[t * K + i]] += ds_slot[j] * sj * d;
      }
  }
  // aux = E * sum_e (P_e / T) * c_e, c_e = f_e / F constant; P_e = sum_t p[t,e].
  double F = 0;
  for (int e = 0; e < E; ++e) F += r.counts[e];
  if (F > 0 && d_aux != 0.0) {
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < E; ++i) {
        double acc = 0;  // d aux / d l[t,i] = E/T * sum_e c_e p_e (delta_ei - p_i)
        for (int e = 0; e < E; ++e) {
          double ce = r.counts[e] / F;
          double d = (i == e ? 1.0 : 0.0) - r.probs[t * E + i];
          acc += ce * r.probs[t * E + e] * d;
        }
        g.dlogits[t * E + i] += d_aux * E / T * acc;
      }
  }
  g.drouter.assign(static_cast<size_t>(E) * H, 0.0);
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      double dl = g.dlogits[t * E + e];
      for (int h = 0; h < H; ++h) {
        g.drouter[e * H + h] += dl * x[t * H + h];
        g.dx[t * H + h] += dl * w.router[e * H + h];
      }
    }
  return g;
}

// ---- data ---------------------------------------------------------------------------------------

inline Vec randn(std::mt19937& rng, size_t n, double stddev) {
  std::normal_distribution<double> d(0.0, stddev);
  Vec v(n);
  for (auto& x : v) {
    x = d(rng);
    if (x == 0.0) x = stddev * 1e-3;  // non-zero data
  }
  return v;
}

inline Weights random_weights(std::mt19937& rng, const Config& c, double router_scale = 1.0) {
  Weights w;
  const int ZW = c.zw();
  w.router = randn(rng, static_cast<size_t>(c.E) * c.H, router_scale / std::sqrt(double(c.H)));
  w.w1 = randn(rng, static_cast<size_t>(c.E) * ZW * c.H, 1.0 / std::sqrt(double(c.H)));
  w.w2 = randn(rng, static_cast<size_t>(c.E) * c.H * c.I, 1.0 / std::sqrt(double(c.I)));
  if (c.bias) {
    w.b1 = randn(rng, static_cast<size_t>(c.E) * ZW, 0.1);
    w.b2 = randn(rng, static_cast<size_t>(c.E) * c.H, 0.1);
  }
  return w;
}

inline double rel_err(const Vec& got, const Vec& want) {
  double num = 0, den = 0;
  size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  if (got.size() != want.size()) return INFINITY;
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

}  // namespace naive

// ---- glue between the naive vectors and the library's tensors (tests only) ---------------------------

#include "sonicmoe/tensor.h"

namespace naive {

// The value a double has once stored in `dt` (what the library actually sees).
inline double stored(double v, sonicmoe::DType dt) {
  float f = static_cast<float>(v);
  if (dt == sonicmoe::DType::bf16) return static_cast<double>(sonicmoe::round_to_bf16(f));
  if (dt == sonicmoe::DType::f16) return static_cast<double>(sonicmoe::round_to_f16(f));
  return static_cast<double>(f);
}
inline Vec stored(const Vec& v, sonicmoe::DType dt) {
  Vec r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = stored(v[i], dt);
  return r;
}

inline sonicmoe::Tensor to_tensor(const Vec& v, const std::vector<std::int64_t>& shape,
                                  sonicmoe::DType dt = sonicmoe::DType::f32) {
  sonicmoe::Tensor t = sonicmoe::Tensor::empty(shape, dt);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == sonicmoe::DType::bf16) t.ptr<sonicmoe::bf16>()[i] = sonicmoe::float_to_bf16(static_cast<float>(v[i]));
    else if (dt == sonicmoe::DType::f16) t.ptr<sonicmoe::f16>()[i] = sonicmoe::float_to_f16(static_cast<float>(v[i]));
    else t.ptr<float>()[i] = static_cast<float>(v[i]);
  }
  return t;
}
inline sonicmoe::Tensor to_itensor(const IVec& v, const std::vector<std::int64_t>& shape) {
  sonicmoe::Tensor t = sonicmoe::Tensor::empty(shape, sonicmoe::DType::i32);
  for (size_t i = 0; i < v.size(); ++i) t.ptr<std::int32_t>()[i] = v[i];
  return t;
}
// The library's config for the same problem.
inline sonicmoe::MoEConfig to_config(const Config& c) { return {c.E, c.K, c.H, c.I, c.act, c.bias}; }
inline Vec from_view(const sonicmoe::TensorView& t) {
  Vec r(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < r.size(); ++i) {
    if (t.dtype == sonicmoe::DType::bf16) r[i] = sonicmoe::bf16_to_float(t.ptr<sonicmoe::bf16>()[i]);
    else if (t.dtype == sonicmoe::DType::f16) r[i] = sonicmoe::f16_to_float(t.ptr<sonicmoe::f16>()[i]);
    else if (t.dtype == sonicmoe::DType::f32) r[i] = t.ptr<float>()[i];
    else r[i] = t.ptr<std::int32_t>()[i];
  }
  return r;
}
inline Vec from_tensor(const sonicmoe::Tensor& t) {
  if (!t.defined()) return {};
  return from_view(t.view());
}
inline IVec ifrom_tensor(const sonicmoe::Tensor& t) {
  if (!t.defined()) return {};
  IVec r(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < r.size(); ++i) r[i] = t.ptr<std::int32_t>()[i];
  return r;
}

}  // namespace naive

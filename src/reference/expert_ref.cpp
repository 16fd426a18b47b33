// Reference expert computation: the grouped GEMMs of forward (steps 4-6) and backward (steps 7-10),
// one Eigen product per expert, experts in parallel. Outputs are rounded to their storage dtype where
// the GPU path stores them; fp32 values feed the next op inside a step (like a fused epilogue).
#include <vector>

#include "core/activation.h"
#include "moe/w1_layout.h"
#include "reference/matrix.h"
#include "reference/reference.h"

namespace sonicmoe::ref {

namespace {

// Runs fn(e, row0, rows) for every expert with rows, in parallel.
template <typename Fn>
void for_each_expert(const RoutingMetadata& meta, Fn&& fn) {
  const std::int32_t* off = meta.offsets.ptr<const std::int32_t>();
  const std::int64_t E = meta.num_experts;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t row0 = off[e], rows = off[e + 1] - off[e];
    if (rows > 0) fn(e, row0, rows);
  }
}

const std::int32_t* gather_of(const RoutingMetadata& meta, std::int64_t row0) {
  return meta.gather.ptr<const std::int32_t>() + row0;
}

// A = act(Z): Z [rows, z_width] -> A [rows, I].
template <Activation Act>
MatF activate(const MatF& Z) {
  constexpr bool glu = is_glu(Act);
  const std::int64_t I = glu ? Z.cols() / 2 : Z.cols();
  MatF A(Z.rows(), I);
  for (std::int64_t i = 0; i < Z.rows(); ++i)
    for (std::int64_t j = 0; j < I; ++j)
      A(i, j) = glu ? act::glu<Act>(Z(i, 2 * j), Z(i, 2 * j + 1)) : act::f<Act>(Z(i, j));
  return A;
}

// dZ from dA (= s * G) and Z.
template <Activation Act>
MatF activate_backward(const MatF& Z, const MatF& dA) {
  constexpr bool glu = is_glu(Act);
  MatF dZ(Z.rows(), Z.cols());
  for (std::int64_t i = 0; i < Z.rows(); ++i)
    for (std::int64_t j = 0; j < dA.cols(); ++j) {
      if constexpr (glu) {
        act::dglu<Act>(Z(i, 2 * j), Z(i, 2 * j + 1), dA(i, j), dZ(i, 2 * j), dZ(i, 2 * j + 1));
      } else {
        dZ(i, j) = act::df<Act>(Z(i, j)) * dA(i, j);
      }
    }
  return dZ;
}

MatF zeros_like_slice(const TensorView& w) { return MatF::Zero(w.shape[w.ndim - 2], w.shape[w.ndim - 1]); }

// W1Layout::concatenated: W1's (and b1's, dW1's, db1's) interleaved index 2j + p (gate p = 0, up p = 1) is stored at
// p * I + j. W1Layout::separate: at j of part p of the [2, E, I, ...] view (w1_part, moe/w1_layout.h). The reference
// permutes on load and store; every product runs in the interleaved order, so every layout gives the same values.
std::int64_t concat_index(std::int64_t n, std::int64_t zw) { return (n % 2) * (zw / 2) + n / 2; }

// W1[e] [z_width, H] in the interleaved row order.
MatF load_w1_slice(const TensorView& w1, std::int64_t e, W1Layout l) {
  if (l == W1Layout::separate) {
    const MatF g = load_slice(w1_part(w1, 0), e), u = load_slice(w1_part(w1, 1), e);
    MatF r(2 * g.rows(), g.cols());
    for (std::int64_t j = 0; j < g.rows(); ++j) {
      r.row(2 * j) = g.row(j);
      r.row(2 * j + 1) = u.row(j);
    }
    return r;
  }
  MatF w = load_slice(w1, e);
  if (l == W1Layout::interleaved) return w;
  MatF r(w.rows(), w.cols());
  for (std::int64_t n = 0; n < w.rows(); ++n) r.row(n) = w.row(concat_index(n, w.rows()));
  return r;
}
// b1[e] in the interleaved column order (zeros when not given).
Eigen::RowVectorXf load_b1(const TensorView& b1, std::int64_t e, std::int64_t zw, W1Layout l) {
  if (l == W1Layout::separate) {
    Eigen::RowVectorXf r = Eigen::RowVectorXf::Zero(zw);
    if (!b1.given()) return r;
    const Eigen::RowVectorXf g = load_bias(w1_part(b1, 0), e, zw / 2), u = load_bias(w1_part(b1, 1), e, zw / 2);
    for (std::int64_t j = 0; j < zw / 2; ++j) {
      r(2 * j) = g(j);
      r(2 * j + 1) = u(j);
    }
    return r;
  }
  Eigen::RowVectorXf b = load_bias(b1, e, zw);
  if (l == W1Layout::interleaved) return b;
  Eigen::RowVectorXf r(zw);
  for (std::int64_t n = 0; n < zw; ++n) r(n) = b(concat_index(n, zw));
  return r;
}
// An interleaved [rows, z_width] (dW1[e]^T's transpose: rows are W1 rows) or [1, z_width] (db1[e], columns) matrix in
// the stored order (concatenated; separate is stored by store_w1_rows / store_b1 instead).
MatF w1_rows_to_layout(const MatF& m, W1Layout l) {
  if (l == W1Layout::interleaved) return m;
  MatF r(m.rows(), m.cols());
  for (std::int64_t n = 0; n < m.rows(); ++n) r.row(concat_index(n, m.rows())) = m.row(n);
  return r;
}
MatF w1_cols_to_layout(const MatF& m, W1Layout l) {
  if (l == W1Layout::interleaved) return m;
  MatF r(m.rows(), m.cols());
  for (std::int64_t n = 0; n < m.cols(); ++n) r.col(concat_index(n, m.cols())) = m.col(n);
  return r;
}
// dW1[e] (interleaved rows) into dw1 in the layout l.
void store_w1_rows(const TensorView& dw1, std::int64_t e, const MatF& m, W1Layout l) {
  if (l != W1Layout::separate) return store_rows(dw1, 0, w1_rows_to_layout(m, l), e);
  MatF g(m.rows() / 2, m.cols()), u(m.rows() / 2, m.cols());
  for (std::int64_t j = 0; j < g.rows(); ++j) {
    g.row(j) = m.row(2 * j);
    u.row(j) = m.row(2 * j + 1);
  }
  store_rows(w1_part(dw1, 0), 0, g, e);
  store_rows(w1_part(dw1, 1), 0, u, e);
}
// db1[e] (interleaved columns, [1, z_width]) into db1 in the layout l.
void store_b1(const TensorView& db1, std::int64_t e, const MatF& m, W1Layout l) {
  if (l != W1Layout::separate) return store_rows(db1, e, w1_cols_to_layout(m, l));
  MatF g(1, m.cols() / 2), u(1, m.cols() / 2);
  for (std::int64_t j = 0; j < g.cols(); ++j) {
    g(0, j) = m(0, 2 * j);
    u(0, j) = m(0, 2 * j + 1);
  }
  store_rows(w1_part(db1, 0), e, g);
  store_rows(w1_part(db1, 1), e, u);
}

}  // namespace

void up_projection(const Context&, Activation act, const TensorView& x, const TensorView& w1, const TensorView& b1,
                   const RoutingMetadata& meta, const TensorView& z, const TensorView& a, W1Layout w1_layout) {
  act::dispatch(act, [&](auto tag) {
    constexpr Activation Act = decltype(tag)::value;
    for_each_expert(meta, [&](std::int64_t e, std::int64_t row0, std::int64_t rows) {
      const MatF Xg = load_rows(x, 0, rows, gather_of(meta, row0));
      MatF Z = Xg * load_w1_slice(w1, e, w1_layout).transpose();
      Z.rowwise() += load_b1(b1, e, Z.cols(), w1_layout);
      store_rows(z, row0, Z);
      store_rows(a, row0, activate<Act>(Z));  // from the fp32 accumulator, as the fused epilogue does
    });
  });
}

void down_projection(const Context&, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y) {
  for_each_expert(meta, [&](std::int64_t e, std::int64_t row0, std::int64_t rows) {
    MatF Y = load_rows(a, row0, rows) * load_slice(w2, e).transpose();
    Y.rowwise() += load_bias(b2, e, Y.cols());
    store_rows(y, row0, Y);
  });
}

void aggregate(const Context&, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,
               const TensorView& out) {
  const std::int64_t T = meta.num_tokens, H = y.shape[1];
  const std::int32_t* toff = meta.token_offsets.ptr<const std::int32_t>();
  const std::int32_t* rev = meta.rev.ptr<const std::int32_t>();
  const float* s = pair_score.given() ? pair_score.ptr<const float>() : nullptr;
#pragma omp parallel
  {
    std::vector<float> acc(H);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (std::int64_t p = toff[t]; p < toff[t + 1]; ++p) {
        if (rev[p] < 0) continue;  // dropped by the capacity: no row
        const float w = s ? s[p] : 1.0f;
        const std::int64_t base = static_cast<std::int64_t>(rev[p]) * H;
        for (std::int64_t h = 0; h < H; ++h) acc[h] += w * load(y, base + h);
      }
      for (std::int64_t h = 0; h < H; ++h) store(out, t * H + h, acc[h]);
    }
  }
}

void dgated(const Context&, Activation act, const TensorView& d_out, const TensorView& w2, const TensorView& b2,
            const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,
            const TensorView& as, const TensorView& dscore) {
  const float* s = pair_score.ptr<const float>();
  const std::int32_t* pair = meta.pair.ptr<const std::int32_t>();
  float* ds = dscore.ptr<float>();
  act::dispatch(act, [&](auto tag) {
    constexpr Activation Act = decltype(tag)::value;
    for_each_expert(meta, [&](std::int64_t e, std::int64_t row0, std::int64_t rows) {
      const MatF dOg = load_rows(d_out, 0, rows, gather_of(meta, row0));
      const MatF G = dOg * load_slice(w2, e);  // [rows, I]
      const MatF Z = load_rows(z, row0, rows);
      const MatF A = activate<Act>(Z);  // recomputed from the stored Z
      Eigen::VectorXf rowdot = (G.array() * A.array()).rowwise().sum();
      if (b2.given()) rowdot += dOg * load_bias(b2, e, dOg.cols()).transpose();
      MatF sG = G, sA = A;
      for (std::int64_t i = 0; i < rows; ++i) {
        const std::int32_t p = pair[row0 + i];
        ds[p] = rowdot(i);
        sG.row(i) *= s[p];
        sA.row(i) *= s[p];
      }
      store_rows(dz, row0, activate_backward<Act>(Z, sG));
      store_rows(as, row0, sA);
    });
  });
}

void weight_grad_w2(const Context&, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2, GradWrite dw_write) {
  const std::int64_t E = meta.num_experts;
  const std::int32_t* off = meta.offsets.ptr<const std::int32_t>();
  const std::int32_t* pair = meta.pair.ptr<const std::int32_t>();
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t row0 = off[e], rows = off[e + 1] - off[e];
    const MatF dOg = load_rows(d_out, 0, rows, gather_of(meta, row0));
    if (dw_write == GradWrite::accumulate) {  // an expert without rows adds nothing
      if (rows) add_rows_f32(dw2, 0, MatF(dOg.transpose() * load_rows(as, row0, rows)), e);
    } else {
      store_rows(dw2, 0, rows ? MatF(dOg.transpose() * load_rows(as, row0, rows)) : zeros_like_slice(dw2), e);
    }
    if (db2.given()) store_rows(db2, e, bias_sum(dOg, pair_score.ptr<const float>(), pair + row0));
  }
}


void weight_grad_w1(const Context&, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1, W1Layout w1_layout, GradWrite dw_write) {
  const std::int64_t E = meta.num_experts;
  const std::int32_t* off = meta.offsets.ptr<const std::int32_t>();
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t row0 = off[e], rows = off[e + 1] - off[e];
    const MatF dZ = load_rows(dz, row0, rows);
    MatF dW = rows ? MatF(dZ.transpose() * load_rows(x, 0, rows, gather_of(meta, row0)))
                   : MatF::Zero(dz.shape[1], x.shape[1]);
    if (dw_write == GradWrite::accumulate) {  // (interleaved or concatenated: the stage refuses separate)
      if (rows) add_rows_f32(dw1, 0, w1_rows_to_layout(dW, w1_layout), e);
    } else {
      store_w1_rows(dw1, e, dW, w1_layout);
    }
    if (db1.given()) store_b1(db1, e, MatF(bias_sum(dZ)), w1_layout);
  }
}

void expert_input_grad(const Context&, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe, W1Layout w1_layout) {
  for_each_expert(meta, [&](std::int64_t e, std::int64_t row0, std::int64_t rows) {
    store_rows(dxe, row0, MatF(load_rows(dz, row0, rows) * load_w1_slice(w1, e, w1_layout)));
  });
}

}  // namespace sonicmoe::ref

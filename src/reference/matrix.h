// Eigen helpers of the reference backend: load (optionally gathered) rows of a bf16/f16/f32 view into an fp32
// matrix, and store an fp32 matrix back rounded to the view's dtype.
#pragma once

#include <Eigen/Dense>
#include <cstdint>

#include "sonicmoe/tensor.h"

namespace sonicmoe::ref {

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecF = Eigen::Matrix<float, Eigen::Dynamic, 1>;

inline float load(const TensorView& v, std::int64_t i) {
  if (v.dtype == DType::bf16) return bf16_to_float(v.ptr<const bf16>()[i]);
  if (v.dtype == DType::f16) return f16_to_float(v.ptr<const f16>()[i]);
  return v.ptr<const float>()[i];
}
inline void store(const TensorView& v, std::int64_t i, float f) {
  if (v.dtype == DType::bf16) v.ptr<bf16>()[i] = float_to_bf16(f);
  else if (v.dtype == DType::f16) v.ptr<f16>()[i] = float_to_f16(f);
  else v.ptr<float>()[i] = f;
}

// Rows of a contiguous [R, C] view (or of slice `outer` of a [*, R, C] view): row index rows[i] if
// `rows` is given, else row0 + i, for i in [0, n).
inline MatF load_rows(const TensorView& v, std::int64_t row0, std::int64_t n, const std::int32_t* rows = nullptr,
                      std::int64_t outer = 0) {
  const std::int64_t C = v.shape[v.ndim - 1];
  const std::int64_t R = v.ndim >= 2 ? v.shape[v.ndim - 2] : 1;
  const std::int64_t base = outer * R * C;
  MatF m(n, C);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t r = rows ? rows[i] : row0 + i;
    for (std::int64_t c = 0; c < C; ++c) m(i, c) = load(v, base + r * C + c);
  }
  return m;
}
// The whole [R, C] slice `outer` of a [E, R, C] weight.
inline MatF load_slice(const TensorView& v, std::int64_t outer) {
  return load_rows(v, 0, v.shape[v.ndim - 2], nullptr, outer);
}
// Row `outer` of a [E, C] bias as a row vector (zeros when not given).
inline Eigen::RowVectorXf load_bias(const TensorView& b, std::int64_t outer, std::int64_t C) {
  Eigen::RowVectorXf r = Eigen::RowVectorXf::Zero(C);
  if (b.given())
    for (std::int64_t c = 0; c < C; ++c) r(c) = load(b, outer * C + c);
  return r;
}
// Stores m into rows [row0, row0 + m.rows()) of slice `outer`.
inline void store_rows(const TensorView& v, std::int64_t row0, const MatF& m, std::int64_t outer = 0) {
  const std::int64_t C = v.shape[v.ndim - 1];
  const std::int64_t R = v.ndim >= 2 ? v.shape[v.ndim - 2] : 1;
  const std::int64_t base = outer * R * C;
  for (std::int64_t i = 0; i < m.rows(); ++i)
    for (std::int64_t c = 0; c < C; ++c) store(v, base + (row0 + i) * C + c, m(i, c));
}

// Adds m into rows [row0, row0 + m.rows()) of slice `outer` of an f32 view (GradWrite::accumulate), in fp32.
inline void add_rows_f32(const TensorView& v, std::int64_t row0, const MatF& m, std::int64_t outer = 0) {
  const std::int64_t C = v.shape[v.ndim - 1];
  const std::int64_t R = v.ndim >= 2 ? v.shape[v.ndim - 2] : 1;
  float* d = v.ptr<float>() + outer * R * C;
  for (std::int64_t i = 0; i < m.rows(); ++i)
    for (std::int64_t c = 0; c < C; ++c) d[(row0 + i) * C + c] += m(i, c);
}

// A bias gradient's sum over an expert's rows m: row i weighted by score[pair[i]] when score is given (db2), else
// Eigen's column sum (db1). One definition for the bf16 stages and the FP8 ones, so that both sum in the same order.
inline Eigen::RowVectorXf bias_sum(const MatF& m, const float* score = nullptr, const std::int32_t* pair = nullptr) {
  if (!score) return m.colwise().sum();
  Eigen::RowVectorXf d = Eigen::RowVectorXf::Zero(m.cols());
  for (std::int64_t i = 0; i < m.rows(); ++i) d += score[pair[i]] * m.row(i);
  return d;
}

}  // namespace sonicmoe::ref

// Softmax and top-K selection helpers of the reference routing (one token's row of logits at a time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/exp_f32.h"
#include "sonicmoe/error.h"

namespace sonicmoe::ref {

// Rejects NaN / inf logits: their top-K order is meaningless and would silently route garbage.
inline void check_finite(const float* L, std::int64_t T, std::int64_t E, const char* fn) {
  for (std::int64_t i = 0; i < T * E; ++i)
    SONICMOE_CHECK(std::isfinite(L[i]), "sonicmoe::", fn, ": logits[", i / E, ", ", i % E, "] = ", L[i],
                   " is not finite");
}

// "a ranks before b": larger logit first, ties to the lower expert id.
inline bool logit_before(const float* row, std::int32_t a, std::int32_t b) {
  return row[a] > row[b] || (row[a] == row[b] && a < b);
}

// The K best experts of one row (descending logit, ties lower id) and softmax over their logits.
inline void select_topk(const float* row, std::int64_t E, std::int64_t k, std::int32_t* ids, float* scores) {
  std::vector<std::int32_t> idx(E);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [row](std::int32_t a, std::int32_t b) { return logit_before(row, a, b); });
  const float mx = row[idx[0]];
  float sum = 0.0f;
  for (std::int64_t j = 0; j < k; ++j) {
    ids[j] = idx[j];
    scores[j] = exp_f32(row[idx[j]] - mx);
    sum += scores[j];
  }
  for (std::int64_t j = 0; j < k; ++j) scores[j] /= sum;
}

// sum_e exp_f32(row[e] - mx) in the GPU's order, so that the two backends agree bit for bit: 32 partial sums
// (partial l adds experts l, l+32, l+64, ... in that order), then a butterfly over the 32 partials
// (level o = 16, 8, 4, 2, 1: partial[l] += partial[l ^ o]), exactly what one warp computes with
// __shfl_xor_sync (fp32 addition is commutative, so both partners of a pair get the same sum).
inline float softmax_denominator(const float* row, std::int64_t E, float mx) {
  float part[32];
  for (int l = 0; l < 32; ++l) {
    float acc = 0.0f;
    for (std::int64_t e = l; e < E; e += 32) acc += exp_f32(row[e] - mx);
    part[l] = acc;
  }
  for (int o = 16; o > 0; o >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = part[l] + part[l ^ o];
    for (int l = 0; l < 32; ++l) part[l] = next[l];
  }
  return part[0];
}

// Softmax over all E of one row, in fp32, with the GPU's summation order (bitwise equal).
inline void softmax_row(const float* row, std::int64_t E, float* out) {
  const float mx = *std::max_element(row, row + E);
  const float sum = softmax_denominator(row, E, mx);
  for (std::int64_t e = 0; e < E; ++e) out[e] = exp_f32(row[e] - mx) / sum;
}

// sum_t softmax(logits)[t, e], accumulated in double.
inline std::vector<double> softmax_column_sums(const float* L, std::int64_t T, std::int64_t E) {
  std::vector<double> P(E, 0.0);
  std::vector<float> q(E);
  for (std::int64_t t = 0; t < T; ++t) {
    softmax_row(L + t * E, E, q.data());
    for (std::int64_t e = 0; e < E; ++e) P[e] += q[e];
  }
  return P;
}

}  // namespace sonicmoe::ref

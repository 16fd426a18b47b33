// Reference routing: router logits, top-K softmax (router variants: router_ref.cpp), metadata (counting sort), aux loss.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "reference/matrix.h"
#include "reference/reference.h"
#include "reference/router_ref.h"
#include "reference/softmax.h"
#include "sonicmoe/error.h"

namespace sonicmoe::ref {

void router_logits(const Context&, const TensorView& x, const TensorView& router_weight, const TensorView& logits) {
  const MatF X = load_rows(x, 0, x.shape[0]);
  const MatF W = load_slice(router_weight, 0);
  Eigen::Map<MatF> L(logits.ptr<float>(), logits.shape[0], logits.shape[1]);
  L.noalias() = X * W.transpose();
}

void topk_softmax(const Context&, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts, const RouterSpec& router) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  const float* L = logits.ptr<const float>();
  std::int32_t* ids = topk_expert.ptr<std::int32_t>();
  float* sc = topk_score.ptr<float>();
  check_finite(L, T, E, "topk_softmax");
  if (router.scores_default()) {
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) select_topk(L + t * E, E, k, ids + t * k, sc + t * k);
  } else {
    const float* bias = router.e_score_correction_bias.given() ? router.e_score_correction_bias.ptr<const float>()
                                                               : nullptr;
#pragma omp parallel
    {
      std::vector<float> scratch(2 * E);
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < T; ++t)
        router_select_row(L + t * E, E, k, router, bias, ids + t * k, sc + t * k, scratch.data());
    }
  }
  std::int32_t* c = counts.ptr<std::int32_t>();
  std::fill(c, c + E, 0);
  for (std::int64_t i = 0, n = topk_expert.numel(); i < n; ++i) ++c[ids[i]];  // the T*K choices
}

void topk_pair_token(const Context&, std::int64_t k, const TensorView& pair_token) {
  std::int32_t* p = pair_token.ptr<std::int32_t>();
  for (std::int64_t i = 0, n = pair_token.numel(); i < n; ++i) p[i] = static_cast<std::int32_t>(i / k);
}

RoutingMetadata topk_routing(const Context& ctx, const TensorView& logits, std::int64_t k,
                             const TensorView& topk_expert, const TensorView& topk_score,
                             const TensorView& pair_token, const RouterSpec& router) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  Tensor counts = Tensor::empty({E}, DType::i32, ctx.device(), ctx.allocator);
  ref::topk_softmax(ctx, logits, k, topk_expert, topk_score, counts, router);
  ref::topk_pair_token(ctx, k, pair_token);
  RoutingMetadata m = ref::build_metadata(ctx, pair_token, topk_expert, T, E);
  if (router.has_capacity()) apply_capacity(ctx, m, router.expert_capacity(T, k, E));
  return m;
}

void apply_capacity(const Context& ctx, RoutingMetadata& m, std::int64_t capacity) {
  const std::int64_t E = m.num_experts;
  m.demand = Tensor::empty({E}, DType::i32, ctx.device(), ctx.allocator);
  m.dropped = Tensor::empty({1}, DType::i32, ctx.device(), ctx.allocator);
  std::int32_t* counts = m.counts.ptr<std::int32_t>();
  std::int32_t* offsets = m.offsets.ptr<std::int32_t>();
  std::int32_t* pair = m.pair.ptr<std::int32_t>();
  std::int32_t* gather = m.gather.ptr<std::int32_t>();
  std::int32_t* rev = m.rev.ptr<std::int32_t>();
  std::int32_t* demand = m.demand.ptr<std::int32_t>();
  std::int32_t dropped = 0;
  std::int32_t row = 0;  // rows move only towards the front: an in-place compaction
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int32_t begin = offsets[e], n = counts[e];
    const std::int32_t kept = static_cast<std::int32_t>(std::min<std::int64_t>(n, capacity));
    offsets[e] = row;
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t p = pair[begin + i];
      if (i < kept) {  // the expert's rows are in pair order: the first `kept` pairs stay
        pair[row] = p;
        gather[row] = gather[begin + i];
        rev[p] = row++;
      } else {
        rev[p] = -1;
      }
    }
    demand[e] = n;
    counts[e] = kept;
    dropped += n - kept;
  }
  offsets[E] = row;
  for (std::int64_t r = row; r < m.num_pairs; ++r) {  // unused rows: no pair, token 0
    pair[r] = -1;
    gather[r] = 0;
  }
  m.dropped.ptr<std::int32_t>()[0] = dropped;
}

RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts) {
  const std::int64_t N = pair_token.numel(), T = num_tokens, E = num_experts;
  const Device dev = ctx.device();
  RoutingMetadata m;
  m.num_tokens = T;
  m.num_experts = E;
  m.num_pairs = N;
  m.counts = Tensor::zeros({E}, DType::i32, dev, ctx.allocator);
  m.offsets = Tensor::empty({E + 1}, DType::i32, dev, ctx.allocator);
  m.pair = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  m.gather = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  m.rev = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  m.token_offsets = Tensor::empty({T + 1}, DType::i32, dev, ctx.allocator);

  const std::int32_t* tok = pair_token.ptr<const std::int32_t>();
  const std::int32_t* exp = pair_expert.ptr<const std::int32_t>();
  std::int32_t* counts = m.counts.ptr<std::int32_t>();
  std::int32_t* offsets = m.offsets.ptr<std::int32_t>();
  for (std::int64_t p = 0; p < N; ++p) ++counts[exp[p]];
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  // Stable counting sort: pairs of one expert keep increasing p.
  std::vector<std::int32_t> cursor(offsets, offsets + E);
  std::int32_t* pair = m.pair.ptr<std::int32_t>();
  std::int32_t* gather = m.gather.ptr<std::int32_t>();
  std::int32_t* rev = m.rev.ptr<std::int32_t>();
  for (std::int64_t p = 0; p < N; ++p) {
    const std::int32_t r = cursor[exp[p]]++;
    pair[r] = static_cast<std::int32_t>(p);
    gather[r] = tok[p];
    rev[p] = r;
  }
  std::int32_t* toff = m.token_offsets.ptr<std::int32_t>();
  std::int64_t p = 0;
  for (std::int64_t t = 0; t <= T; ++t) {
    while (p < N && tok[p] < t) ++p;
    toff[t] = static_cast<std::int32_t>(p);
  }
  return m;
}

void aux_loss(const Context&, const TensorView& logits, const TensorView& counts, const TensorView& out) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  const std::vector<double> P = softmax_column_sums(logits.ptr<const float>(), T, E);
  const std::int32_t* c = counts.ptr<const std::int32_t>();
  double F = 0;
  for (std::int64_t e = 0; e < E; ++e) F += c[e];
  double loss = 0;
  if (F > 0)
    for (std::int64_t e = 0; e < E; ++e) loss += (P[e] / static_cast<double>(T)) * (c[e] / F);
  out.ptr<float>()[0] = static_cast<float>(static_cast<double>(E) * loss);
}

}  // namespace sonicmoe::ref

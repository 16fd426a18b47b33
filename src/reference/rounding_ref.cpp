// Reference token rounding (DESIGN.md section 4): every expert's row count becomes a multiple of the tile.
#include <algorithm>
#include <numeric>
#include <vector>

#include "reference/reference.h"
#include "reference/softmax.h"

namespace sonicmoe::ref {

namespace {

// Rows expert e keeps from its top-K count f: a multiple of `tile`, capped at T (the only case where the
// count is not a multiple: round-up/nearest asked for more tokens than exist).
std::int64_t rounded_count(std::int64_t f, std::int64_t tile, RoutingMode mode, std::int64_t T) {
  const std::int64_t down = f / tile * tile;
  const std::int64_t up = (f + tile - 1) / tile * tile;
  std::int64_t c = down;
  if (mode == RoutingMode::round_up) c = up;
  if (mode == RoutingMode::round_nearest) c = 2 * (f - down) >= tile ? up : down;
  return std::min(c, T);
}

}  // namespace

Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode) {
  const std::int64_t T = logits.shape[0], E = logits.shape[1];
  const Device dev = ctx.device();
  Routing r;
  r.mode = mode;
  r.top_k = k;
  r.topk_expert = Tensor::empty({T, k}, DType::i32, dev, ctx.allocator);
  r.topk_score = Tensor::empty({T, k}, DType::f32, dev, ctx.allocator);
  Tensor topk_counts = Tensor::empty({E}, DType::i32, dev, ctx.allocator);
  ref::topk_softmax(ctx, logits, k, r.topk_expert, r.topk_score, topk_counts, RouterSpec{});
  const std::int32_t* ids = r.topk_expert.ptr<const std::int32_t>();
  const float* ts = r.topk_score.ptr<const float>();
  const float* L = logits.ptr<const float>();

  const auto TE = static_cast<std::size_t>(logits.numel());  // T*E, overflow-checked by the view
  std::vector<float> prob(TE);
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < T; ++t) softmax_row(L + t * E, E, prob.data() + t * E);

  // slot_of[t*E + e] = k if e is token t's k-th choice, else -1.
  std::vector<std::int32_t> slot_of(TE, -1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) slot_of[t * E + ids[t * k + j]] = static_cast<std::int32_t>(j);

  // Per expert: rank all tokens (pickers first by renormalised score, then the rest by softmax prob;
  // ties to the lower token id) and keep the head. keep[t*E + e] marks chosen pairs.
  std::vector<unsigned char> keep(TE, 0);
  const std::int32_t* f = topk_counts.ptr<const std::int32_t>();
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t c = rounded_count(f[e], tile, mode, T);
    if (c == 0) continue;
    auto key = [&](std::int32_t t, bool& picked) {
      const std::int32_t s = slot_of[t * E + e];
      picked = s >= 0;
      return picked ? ts[t * k + s] : prob[t * E + e];
    };
    std::vector<std::int32_t> order(T);
    std::iota(order.begin(), order.end(), 0);
    auto before = [&](std::int32_t a, std::int32_t b) {
      bool pa, pb;
      const float ka = key(a, pa), kb = key(b, pb);
      if (pa != pb) return pa;
      if (ka != kb) return ka > kb;
      return a < b;
    };
    std::partial_sort(order.begin(), order.begin() + c, order.end(), before);
    for (std::int64_t i = 0; i < c; ++i) keep[order[i] * E + e] = 1;
  }

  // Pairs in token order, then expert id.
  std::int64_t N = 0;
  for (unsigned char v : keep) N += v;
  r.pair_token = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  r.pair_expert = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  r.pair_score = Tensor::empty({N}, DType::f32, dev, ctx.allocator);
  r.pair_slot = Tensor::empty({N}, DType::i32, dev, ctx.allocator);
  std::int64_t p = 0;
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      if (!keep[t * E + e]) continue;
      const std::int32_t s = slot_of[t * E + e];
      r.pair_token.ptr<std::int32_t>()[p] = static_cast<std::int32_t>(t);
      r.pair_expert.ptr<std::int32_t>()[p] = static_cast<std::int32_t>(e);
      r.pair_score.ptr<float>()[p] = s >= 0 ? ts[t * k + s] : prob[t * E + e];
      r.pair_slot.ptr<std::int32_t>()[p] = s;
      ++p;
    }
  r.meta = ref::build_metadata(ctx, r.pair_token, r.pair_expert, T, E);
  return r;
}

}  // namespace sonicmoe::ref

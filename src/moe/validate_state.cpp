// validate_saved_state: the routing state that re-enters the library from outside (the PyTorch binding's raw backward
// op) checked before any kernel indexes with it. Shapes first, then every index array's values on the host (device
// arrays are copied back after the stream is synchronised): an out-of-range index would otherwise read or write out
// of bounds on the GPU.
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/device_ops.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"

namespace sonicmoe {
namespace {

using check::Arg;
constexpr const char* kFn = "validate_saved_state";

std::vector<std::int32_t> host_ints(const Context& ctx, const Tensor& t) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(t.numel()));
  if (v.empty()) return v;
  const std::vector<std::int64_t> shape(t.view().shape.begin(), t.view().shape.begin() + t.ndim());
  copy_async(TensorView(v.data(), DType::i32, shape, Device::cpu()), t.view(), ctx.stream);
  if (t.device().is_cuda()) devops::cuda_stream_synchronize(t.device().index, ctx.stream);
  return v;
}

void ints(const Context& ctx, const char* name, const Tensor& t, std::int64_t n, const char* desc) {
  Arg a(kFn, name, t.view());
  a.given().dtype(DType::i32).shape({n}, desc).on(ctx.device()).contiguous();
}

[[noreturn]] void bad(const char* name, std::int64_t i, std::int64_t v, const std::string& expected) {
  throw Error(std::string("sonicmoe::") + kFn + ": saved state '" + name + "'[" + std::to_string(i) + "] = " +
              std::to_string(v) + ", expected " + expected + " (the state does not come from this forward)");
}

}  // namespace

void validate_saved_state(const Context& ctx, const SavedState& s, std::int64_t T) {
  check::backend(ctx, kFn);
  const MoEConfig& cfg = s.config;
  validate_config(cfg);
  SONICMOE_CHECK(T >= 0, "sonicmoe::", kFn, ": num_tokens = ", T, ", expected >= 0");
  const Routing& r = s.routing;
  const RoutingMetadata& m = r.meta;
  const std::int64_t E = cfg.num_experts, N = m.num_pairs, K = r.top_k;
  SONICMOE_CHECK(r.mode == RoutingMode::topk || r.mode == RoutingMode::general || is_token_rounding(r.mode),
                 "sonicmoe::", kFn, ": routing.mode = ", static_cast<int>(r.mode), " is not a RoutingMode");
  SONICMOE_CHECK(r.mode == RoutingMode::general || (K >= 1 && K <= E), "sonicmoe::", kFn, ": routing.top_k = ", K,
                 ", expected 1 <= top_k <= E = ", E);
  SONICMOE_CHECK(m.num_tokens == T && m.num_experts == E && N >= 0, "sonicmoe::", kFn, ": the saved state is for T=",
                 m.num_tokens, ", E=", m.num_experts, ", expected T=", T, ", E=", E);
  if (cfg.precision == Precision::fp8_blockwise) {
    { Arg a(kFn, "z_fp8", s.z_fp8.view()); a.given().dtype(DType::f8e4m3).shape({N, cfg.z_width()}, "[N, z_width]")
                                              .on(ctx.device()).contiguous(); }
    { Arg a(kFn, "z_scale", s.z_scale.view()); a.given().dtype(DType::f32)
          .shape({N, fp8_num_blocks(cfg.z_width())}, "[N, z_width / 128]").on(ctx.device()).contiguous(); }
  } else {
    Arg a(kFn, "z", s.z.view());
    a.given().shape({N, cfg.z_width()}, "[N, z_width]").on(ctx.device()).contiguous();
  }
  check::routing_metadata(kFn, ctx, m, T, E, /*values=*/false);  // scanned below, as 'saved state' entries
  ints(ctx, "pair_token", r.pair_token, N, "[N]");
  ints(ctx, "pair_expert", r.pair_expert, N, "[N]");
  { Arg a(kFn, "pair_score", r.pair_score.view()); a.given().dtype(DType::f32).shape({N}, "[N]").on(ctx.device()); }
  const bool router = r.mode != RoutingMode::general;
  if (router) {
    { Arg a(kFn, "logits", r.logits.view()); a.given().dtype(DType::f32).shape({T, E}, "[T, E]").on(ctx.device()); }
    { Arg a(kFn, "topk_expert", r.topk_expert.view()); a.given().dtype(DType::i32).shape({T, K}, "[T, K]"); }
    { Arg a(kFn, "topk_score", r.topk_score.view()); a.given().dtype(DType::f32).shape({T, K}, "[T, K]"); }
  }
  if (is_token_rounding(r.mode)) ints(ctx, "pair_slot", r.pair_slot, N, "[N]");

  const auto counts = host_ints(ctx, m.counts), offsets = host_ints(ctx, m.offsets), pair = host_ints(ctx, m.pair),
             gather = host_ints(ctx, m.gather), rev = host_ints(ctx, m.rev), tok_off = host_ints(ctx, m.token_offsets),
             pair_token = host_ints(ctx, r.pair_token), pair_expert = host_ints(ctx, r.pair_expert);
  if (offsets[0] != 0) bad("offsets", 0, offsets[0], "0");
  for (std::int64_t e = 0; e < E; ++e) {
    if (counts[e] < 0) bad("counts", e, counts[e], ">= 0");
    if (offsets[e + 1] != static_cast<std::int64_t>(offsets[e]) + counts[e])
      bad("offsets", e + 1, offsets[e + 1], "offsets[e] + counts[e] = " + std::to_string(offsets[e] + counts[e]));
  }
  const std::int64_t rows = offsets[E];  // valid rows (N is a capacity under token rounding on the GPU)
  if (rows > N) bad("offsets", E, rows, "<= N = " + std::to_string(N));
  if (tok_off[0] != 0) bad("token_offsets", 0, tok_off[0], "0");
  for (std::int64_t t = 0; t < T; ++t)
    if (tok_off[t + 1] < tok_off[t] || tok_off[t + 1] > N)
      bad("token_offsets", t + 1, tok_off[t + 1], "non-decreasing and <= N = " + std::to_string(N));
  std::int64_t e = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    while (offsets[e + 1] <= i) ++e;  // the expert of row i
    const std::int64_t p = pair[i];
    if (p < 0 || p >= N) bad("pair", i, p, "in [0, N = " + std::to_string(N) + ")");
    if (rev[p] != i) bad("rev", p, rev[p], std::to_string(i) + " (rev[pair[r]] = r)");
    if (gather[i] < 0 || gather[i] >= T) bad("gather", i, gather[i], "in [0, T = " + std::to_string(T) + ")");
    if (pair_token[p] != gather[i]) bad("pair_token", p, pair_token[p], "gather[r] = " + std::to_string(gather[i]));
    if (pair_expert[p] != e) bad("pair_expert", p, pair_expert[p], "the expert of its row, " + std::to_string(e));
    // the aggregation and the router backward find a token's pairs through token_offsets
    const std::int64_t t = gather[i];
    if (p < tok_off[t] || p >= tok_off[t + 1])
      bad("token_offsets", t + 1, tok_off[t + 1], "a range [" + std::to_string(tok_off[t]) + ", ...) of token " +
                                                      std::to_string(t) + " that holds its pair " + std::to_string(p));
  }
  // Token rounding: pair_slot[p] is the top-K slot k of pair p's expert in its token's picks (topk_expert[t, k] =
  // pair_expert[p]), or -1 for an expert the rounding added; the router backward indexes its K-sized arrays with it.
  if (is_token_rounding(r.mode)) {
    const auto slot = host_ints(ctx, r.pair_slot), topk_expert = host_ints(ctx, r.topk_expert);
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t p = pair[i], t = pair_token[p], s = slot[p];
      std::int64_t picked = -1;  // the slot of pair_expert[p] among token t's picks
      for (std::int64_t k = 0; k < K; ++k)
        if (topk_expert[t * K + k] == pair_expert[p]) picked = k;
      if (s != picked)
        bad("pair_slot", p, s, picked < 0 ? std::string("-1 (expert ") + std::to_string(pair_expert[p]) +
                                                " is not among token " + std::to_string(t) + "'s top-K picks)"
                                          : std::to_string(picked) + " (the slot of expert " +
                                                std::to_string(pair_expert[p]) + " in token " + std::to_string(t) +
                                                "'s top-K picks)");
    }
  }
  // Pairs without a row: only under a capacity (demand and dropped given), and then with rev = -1.
  const bool capacity = m.demand.defined() || m.dropped.defined();
  std::int64_t rowless = 0;
  for (std::int64_t p = 0; p < N; ++p) {
    if (rev[p] >= 0 && rev[p] < rows && pair[rev[p]] == p) continue;
    if (!capacity || rev[p] != -1)
      bad("rev", p, rev[p], capacity ? "-1 or a row r < offsets[E] with pair[r] = p" : "a row r with pair[r] = p");
    ++rowless;
  }
  if (capacity) {
    ints(ctx, "demand", m.demand, E, "[E]");
    ints(ctx, "dropped", m.dropped, 1, "[1]");
    const auto demand = host_ints(ctx, m.demand), dropped = host_ints(ctx, m.dropped);
    // demand: the router's picks per expert before the drop (the aux loss and its gradient count them)
    const auto picks = host_ints(ctx, r.topk_expert);
    std::vector<std::int64_t> picked(static_cast<std::size_t>(E), 0);
    for (std::int32_t id : picks)
      if (id >= 0 && id < E) ++picked[static_cast<std::size_t>(id)];
    for (std::int64_t e = 0; e < E; ++e) {
      if (demand[e] < counts[e]) bad("demand", e, demand[e], ">= counts[e] = " + std::to_string(counts[e]));
      if (demand[e] != picked[static_cast<std::size_t>(e)])
        bad("demand", e, demand[e], "the router's picks of expert " + std::to_string(e) + " in topk_expert, " +
                                        std::to_string(picked[static_cast<std::size_t>(e)]));
    }
    if (dropped[0] != rowless) bad("dropped", 0, dropped[0], "the pairs with rev = -1, " + std::to_string(rowless));
  }
  if (router) {
    const auto topk_expert = host_ints(ctx, r.topk_expert);
    for (std::int64_t i = 0; i < T * K; ++i)
      if (topk_expert[i] < 0 || topk_expert[i] >= E)
        bad("topk_expert", i, topk_expert[i], "in [0, E = " + std::to_string(E) + ")");
  }
}

}  // namespace sonicmoe

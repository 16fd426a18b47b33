// Public stage entry points: validate every argument, then run the context's backend.
#include "sonicmoe/stages.h"

#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/check.h"
#include "core/device_ops.h"
#include "cuda/cuda_limits.h"
#include "moe/router.h"
#include "moe/w1_layout.h"
#include "reference/reference.h"
#include "sonicmoe/detail/stage_list.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace sonicmoe {

// The documented declarations of stages.h are the stage list (sonicmoe/detail/stage_list.h), which declares both
// backends: a stage that differs from the list in return type or parameters fails here.
#define SONICMOE_CHECK_PUBLIC_STAGE(ret, name, params)                                   \
  static_assert(std::is_same_v<decltype(&sonicmoe::name), ret(*) params>,                \
                "include/sonicmoe/stages.h: " #name " differs from the stage list");
SONICMOE_STAGE_LIST(SONICMOE_CHECK_PUBLIC_STAGE)
#undef SONICMOE_CHECK_PUBLIC_STAGE

namespace {

using check::Arg;

// Runs ref::fn or cuda::fn by ctx.backend.
#ifdef SONICMOE_WITH_CUDA
#define SONICMOE_DISPATCH(ctx, fn, ...) \
  ((ctx).backend == Backend::cuda ? cuda::fn(__VA_ARGS__) : ref::fn(__VA_ARGS__))
#else
#define SONICMOE_DISPATCH(ctx, fn, ...) ref::fn(__VA_ARGS__)
#endif

void check_context(const Context& ctx, const char* fn) { check::backend(ctx, fn); }

// The index contract (sonicmoe/moe.h, kMaxRows) on every backend: the routing stages write token and pair indices,
// counts and offsets as int32, which would wrap past it. (The cuda backend checks its own limits on top.)
void check_rows(const char* fn, const char* what, std::int64_t v) {
  SONICMOE_CHECK(v <= kMaxRows, "sonicmoe::", fn, ": ", what, " = ", v, " exceeds the limit of ", kMaxRows,
                 " (the routing's indices and counts are int32)");
}

// An Activation cast from an int outside the enum would run some other activation's math (or none).
void check_activation(const char* fn, Activation act) {
  const int a = static_cast<int>(act);
  SONICMOE_CHECK(a >= 0 && a < kNumActivations, "sonicmoe::", fn, ": argument 'act' = ", a,
                 " is not an Activation, expected 0 to ", kNumActivations - 1);
}

// The cuda backend's size limits (src/cuda/cuda_limits.h), checked once per entry after the arguments.
void check_backend_limits(const char* fn, const Context& ctx, const cuda::StageSizes& sizes) {
  if (ctx.backend == Backend::cuda) cuda::check_limits(fn, sizes);
}
// The end of a grouped GEMM stage's validation: the routing metadata (T tokens, its own E), then on the cuda
// backend the sizes (T, N, E and up to three widths, each named) against its limits.
void check_gemm_stage(const char* fn, const Context& ctx, const RoutingMetadata& meta, std::int64_t T,
                      std::initializer_list<std::pair<const char*, std::int64_t>> widths) {
  check::routing_metadata(fn, ctx, meta, T, meta.num_experts);
  cuda::StageSizes s;
  std::tie(s.tokens, s.pairs, s.experts) = std::make_tuple(meta.num_tokens, meta.num_pairs, meta.num_experts);
  s.gemm = true;
  int i = 0;
  for (const auto& [name, v] : widths) {
    s.width_name[i] = name;
    s.width[i++] = v;
  }
  check_backend_limits(fn, ctx, s);
}
// A routing stage's sizes.
cuda::StageSizes routing_sizes(std::int64_t T, std::int64_t N, std::int64_t E, std::int64_t k,
                               std::int64_t router_groups = -1) {
  cuda::StageSizes s;
  std::tie(s.tokens, s.pairs, s.experts, s.top_k, s.router_groups) = std::make_tuple(T, N, E, k, router_groups);
  return s;
}

// A float activation/weight tensor: given, of dtype dt, on the context's device, contiguous; on the GPU
// also 16-byte aligned (vector loads, TMA).
Arg& float_arg(Arg& a, const Context& ctx, DType dt) {
  a.given().dtype(dt).on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cuda) a.aligned(16);
  return a;
}
Arg& int_arg(Arg& a, const Context& ctx) { return a.given().dtype(DType::i32).on(ctx.device()).contiguous(); }
Arg& f32_arg(Arg& a, const Context& ctx) { return a.given().dtype(DType::f32).on(ctx.device()).contiguous(); }

// One tensor checked in one statement: float_arg / f32_arg / int_arg, then its shape.
using Shape = std::initializer_list<std::int64_t>;
void float_tensor(const char* fn, const char* name, const TensorView& t, const Context& ctx, DType dt, Shape shape,
                  const char* desc) {
  Arg a(fn, name, t);
  float_arg(a, ctx, dt).shape(shape, desc);
}
// An optional float tensor (a bias or its gradient): float_tensor when given.
void optional_float_tensor(const char* fn, const char* name, const TensorView& t, const Context& ctx, DType dt,
                           Shape shape, const char* desc) {
  if (t.given()) float_tensor(fn, name, t, ctx, dt, shape, desc);
}
void f32_tensor(const char* fn, const char* name, const TensorView& t, const Context& ctx, Shape shape,
                const char* desc) {
  Arg a(fn, name, t);
  f32_arg(a, ctx).shape(shape, desc);
}
// The stage's first float tensor: bf16 or f32, the dtype every other float tensor of the stage must have
// (returned), then float_arg and its shape.
DType leading_float_tensor(const char* fn, const char* name, const TensorView& t, const Context& ctx, Shape shape,
                           const char* desc) {
  Arg a(fn, name, t);
  a.given().float_dtype();
  float_arg(a, ctx, t.dtype).shape(shape, desc);
  return t.dtype;
}
void int_tensor(const char* fn, const char* name, const TensorView& t, const Context& ctx, Shape shape,
                const char* desc) {
  Arg a(fn, name, t);
  int_arg(a, ctx).shape(shape, desc);
}

void check_topk(const char* fn, const Context& ctx, std::int64_t k, std::int64_t E) {
  (void)ctx;
  SONICMOE_CHECK(k >= 1 && k <= E, "sonicmoe::", fn, ": top_k = ", k, ", expected 1 <= top_k <= E = ", E);
}

// logits f32 [T, E], k valid for E, topk_expert / topk_score [T, K]; returns T.
std::int64_t check_topk_io(const char* fn, const Context& ctx, const TensorView& logits, std::int64_t k,
                           const TensorView& topk_expert, const TensorView& topk_score) {
  check_context(ctx, fn);
  Arg al(fn, "logits", logits);
  f32_arg(al, ctx).ndim(2);
  const std::int64_t T = logits.shape[0];
  check_topk(fn, ctx, k, logits.shape[1]);
  check_rows(fn, "T (logits' rows)", T);
  check_rows(fn, "T*K", checked_mul(T, k, "T*K"));
  int_tensor(fn, "topk_expert", topk_expert, ctx, {T, k}, "[T, K]");
  f32_tensor(fn, "topk_score", topk_score, ctx, {T, k}, "[T, K]");
  return T;
}

}  // namespace

void router_logits(const Context& ctx, const TensorView& x, const TensorView& router_weight,
                   const TensorView& logits) {
  const char* fn = "router_logits";
  check_context(ctx, fn);
  Arg ax(fn, "x", x);
  ax.given().float_dtype().ndim(2);
  float_arg(ax, ctx, x.dtype);
  const std::int64_t T = x.shape[0], H = x.shape[1];
  float_tensor(fn, "router_weight", router_weight, ctx, x.dtype, {-1, H}, "[E, H]");
  const std::int64_t E = router_weight.shape[0];
  f32_tensor(fn, "logits", logits, ctx, {T, E}, "[T, E]");
  SONICMOE_DISPATCH(ctx, router_logits, ctx, x, router_weight, logits);
}

void topk_softmax(const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts, const RouterSpec& router) {
  const char* fn = "topk_softmax";
  check_topk_io(fn, ctx, logits, k, topk_expert, topk_score);
  check_router(fn, ctx, router, logits.shape[1], k);
  int_tensor(fn, "counts", counts, ctx, {logits.shape[1]}, "[E]");
  check_backend_limits(fn, ctx, routing_sizes(logits.shape[0], -1, logits.shape[1], k, router.n_group));
  SONICMOE_DISPATCH(ctx, topk_softmax, ctx, logits, k, topk_expert, topk_score, counts, router);
}

RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts) {
  const char* fn = "build_metadata";
  check_context(ctx, fn);
  SONICMOE_CHECK(num_tokens >= 0, "sonicmoe::", fn, ": num_tokens = ", num_tokens, ", expected >= 0");
  SONICMOE_CHECK(num_experts >= 1, "sonicmoe::", fn, ": num_experts = ", num_experts, ", expected >= 1");
  // The metadata's [T+1] and [E+1] arrays are allocated and written here: the int32 index contract bounds them
  // (a huge num_tokens would otherwise allocate and fill that many offsets).
  check_rows(fn, "num_tokens", num_tokens);
  SONICMOE_CHECK(num_experts <= kMaxDim, "sonicmoe::", fn, ": num_experts = ", num_experts, " exceeds the limit of ",
                 kMaxDim, " (int32)");
  Arg at(fn, "pair_token", pair_token);
  int_arg(at, ctx).ndim(1);
  const std::int64_t N = pair_token.shape[0];
  check_rows(fn, "N (pair_token's length)", N);
  Arg ae(fn, "pair_expert", pair_expert);
  int_arg(ae, ctx).shape({N}, "[N], as pair_token");
  at.values_in(0, num_tokens, "[0, T)").non_decreasing();  // the O(N) scans once the sizes are known to be sane
  ae.values_in(0, num_experts, "[0, E)");
  check_backend_limits(fn, ctx, routing_sizes(num_tokens, N, num_experts, -1));
  return SONICMOE_DISPATCH(ctx, build_metadata, ctx, pair_token, pair_expert, num_tokens, num_experts);
}

RoutingMetadata topk_routing(const Context& ctx, const TensorView& logits, std::int64_t k,
                             const TensorView& topk_expert, const TensorView& topk_score,
                             const TensorView& pair_token, const RouterSpec& router) {
  const char* fn = "topk_routing";
  const std::int64_t T = check_topk_io(fn, ctx, logits, k, topk_expert, topk_score);
  check_router(fn, ctx, router, logits.shape[1], k);
  int_tensor(fn, "pair_token", pair_token, ctx, {checked_mul(T, k, "T*K")}, "[T*K]");
  check_backend_limits(fn, ctx, routing_sizes(T, T * k, logits.shape[1], k, router.n_group));
  return SONICMOE_DISPATCH(ctx, topk_routing, ctx, logits, k, topk_expert, topk_score, pair_token, router);
}

Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode) {
  const char* fn = "token_rounding";
  check_context(ctx, fn);
  Arg al(fn, "logits", logits);
  f32_arg(al, ctx).ndim(2);
  check_topk(fn, ctx, k, logits.shape[1]);
  check_rows(fn, "T (logits' rows)", logits.shape[0]);
  check_rows(fn, "T*K", checked_mul(logits.shape[0], k, "T*K"));
  SONICMOE_CHECK(tile >= 1, "sonicmoe::", fn, ": tile = ", tile, ", expected >= 1");
  SONICMOE_CHECK(is_token_rounding(mode), "sonicmoe::", fn, ": mode = ", routing_mode_name(mode),
                 ", expected round-down, round-up or round-nearest");
  cuda::StageSizes sizes = routing_sizes(logits.shape[0], -1, logits.shape[1], k);
  sizes.rounding_tile = tile;
  check_backend_limits(fn, ctx, sizes);
  return SONICMOE_DISPATCH(ctx, token_rounding, ctx, logits, k, tile, mode);
}

void aux_loss(const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out) {
  const char* fn = "aux_loss";
  check_context(ctx, fn);
  Arg al(fn, "logits", logits);
  f32_arg(al, ctx).ndim(2);
  int_tensor(fn, "counts", counts, ctx, {logits.shape[1]}, "[E]");
  Arg(fn, "counts", counts).values_in(0, kMaxRows + 1, "a count >= 0");  // host only (a negative f_e: a wrong loss)
  f32_tensor(fn, "out", out, ctx, {1}, "[1]");
  SONICMOE_DISPATCH(ctx, aux_loss, ctx, logits, counts, out);
}

namespace {
// A stage's W1Layout: a known value; concatenated and separate need W1's rows in two halves (even z_width).
void check_w1_layout(const char* fn, W1Layout l, std::int64_t z_width) {
  SONICMOE_CHECK(l == W1Layout::interleaved || l == W1Layout::concatenated || l == W1Layout::separate, "sonicmoe::",
                 fn, ": w1_layout = ", static_cast<int>(l), " is not a W1Layout");
  SONICMOE_CHECK(l == W1Layout::interleaved || z_width % 2 == 0, "sonicmoe::", fn, ": w1_layout ", w1_layout_name(l),
                 " needs an even z_width (gate and up halves), got z_width = ", z_width);
}
// W1 or dW1 [E, z_width, H] in the layout l: under separate the [2, E, I, H] view of w1_separate_view.
void w1_operand(const char* fn, const char* name, const TensorView& t, const Context& ctx, DType dt, W1Layout l,
                std::int64_t E, std::int64_t ZW, std::int64_t H) {
  if (l == W1Layout::separate)
    check_w1_separate_operand(fn, name, t, ctx, dt, {E, ZW / 2, H}, "[2, E, I, H] (gate, up)");
  else
    float_tensor(fn, name, t, ctx, dt, {E, ZW, H}, "[E, z_width, H]");
}
// b1 or db1 [E, z_width] when given, likewise ([2, E, I] under separate).
void b1_operand(const char* fn, const char* name, const TensorView& t, const Context& ctx, DType dt, W1Layout l,
                std::int64_t E, std::int64_t ZW) {
  if (!t.given()) return;
  if (l == W1Layout::separate)
    check_w1_separate_operand(fn, name, t, ctx, dt, {E, ZW / 2}, "[2, E, I] (gate, up)");
  else
    float_tensor(fn, name, t, ctx, dt, {E, ZW}, "[E, z_width]");
}
}  // namespace

void up_projection(const Context& ctx, Activation act, const TensorView& x, const TensorView& w1,
                   const TensorView& b1, const RoutingMetadata& meta, const TensorView& z, const TensorView& a,
                   W1Layout w1_layout) {
  const char* fn = "up_projection";
  check_context(ctx, fn);
  check_activation(fn, act);
  SONICMOE_CHECK(w1_layout == W1Layout::interleaved || is_glu(act), "sonicmoe::", fn, ": w1_layout ",
                 w1_layout_name(w1_layout), " needs a glu activation (", activation_name(act),
                 " has no gate/up halves: pass interleaved)");
  Arg ax(fn, "x", x);
  ax.given().float_dtype().ndim(2);
  float_arg(ax, ctx, x.dtype);
  const std::int64_t T = x.shape[0], H = x.shape[1], N = meta.num_pairs;
  float_tensor(fn, "a", a, ctx, x.dtype, {N, -1}, "[N, I]");
  const std::int64_t I = a.shape[1], ZW = is_glu(act) ? 2 * I : I;
  check_w1_layout(fn, w1_layout, ZW);
  w1_operand(fn, "w1", w1, ctx, x.dtype, w1_layout, meta.num_experts, ZW, H);
  b1_operand(fn, "b1", b1, ctx, x.dtype, w1_layout, meta.num_experts, ZW);
  float_tensor(fn, "z", z, ctx, x.dtype, {N, ZW}, "[N, z_width]");
  check_gemm_stage(fn, ctx, meta, T, {{"hidden_size H", H}, {"intermediate_size I", I}, {"z_width", ZW}});
  SONICMOE_DISPATCH(ctx, up_projection, ctx, act, x, w1, b1, meta, z, a, w1_layout);
}

namespace {
// The operands of a varlen-M GEMM over the sorted rows (steps 5 and 10a, out[r] = rows[r] W[e]^T or rows[r] W[e]):
// `rows` [N, K], the stage's leading float tensor, and the experts' weight `w` [E, ., .] holding K at dim k_dim
// (1 or 2). Returns their dtype, K and the weight's other dim (the output width).
struct RowGemmOperands {
  DType dt;
  std::int64_t K, W;
};
RowGemmOperands check_row_gemm_operands(const char* fn, const Context& ctx, const RoutingMetadata& meta,
                                        const char* rows_name, const TensorView& rows, const char* rows_desc,
                                        const char* w_name, const TensorView& w, int k_dim, const char* w_desc) {
  check_context(ctx, fn);
  const std::int64_t E = meta.num_experts;
  const DType dt = leading_float_tensor(fn, rows_name, rows, ctx, {meta.num_pairs, -1}, rows_desc);
  const std::int64_t K = rows.shape[1];
  if (k_dim == 2) float_tensor(fn, w_name, w, ctx, dt, {E, -1, K}, w_desc);
  else float_tensor(fn, w_name, w, ctx, dt, {E, K, -1}, w_desc);
  return {dt, K, w.shape[3 - k_dim]};
}

}  // namespace

void down_projection(const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y) {
  const char* fn = "down_projection";
  const auto [dt, I, H] = check_row_gemm_operands(fn, ctx, meta, "a", a, "[N, I]", "w2", w2, 2, "[E, H, I]");
  optional_float_tensor(fn, "b2", b2, ctx, dt, {meta.num_experts, H}, "[E, H]");
  float_tensor(fn, "y", y, ctx, dt, {meta.num_pairs, H}, "[N, H]");
  check_gemm_stage(fn, ctx, meta, meta.num_tokens, {{"intermediate_size I", I}, {"hidden_size H", H}});
  SONICMOE_DISPATCH(ctx, down_projection, ctx, a, w2, b2, meta, y);
}

void aggregate(const Context& ctx, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,
               const TensorView& out) {
  const char* fn = "aggregate";
  check_context(ctx, fn);
  const std::int64_t N = meta.num_pairs, T = meta.num_tokens;
  leading_float_tensor(fn, "y", y, ctx, {N, -1}, "[N, H]");
  if (pair_score.given()) f32_tensor(fn, "pair_score", pair_score, ctx, {N}, "[N]");
  float_tensor(fn, "out", out, ctx, y.dtype, {T, y.shape[1]}, "[T, H]");
  check::routing_metadata(fn, ctx, meta, T, meta.num_experts);
  SONICMOE_DISPATCH(ctx, aggregate, ctx, y, pair_score, meta, out);
}

namespace {
void check_dgated(const char* fn, const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                  const TensorView& b2, const TensorView& z, const TensorView& pair_score,
                  const RoutingMetadata& meta, const TensorView& dz, const TensorView& as,
                  const TensorView& dscore) {
  check_context(ctx, fn);
  check_activation(fn, act);
  const std::int64_t N = meta.num_pairs, T = meta.num_tokens, E = meta.num_experts;
  const DType dt = leading_float_tensor(fn, "d_out", d_out, ctx, {T, -1}, "[T, H]");
  const std::int64_t H = d_out.shape[1];
  float_tensor(fn, "w2", w2, ctx, dt, {E, H, -1}, "[E, H, I]");
  const std::int64_t I = w2.shape[2], ZW = is_glu(act) ? 2 * I : I;
  optional_float_tensor(fn, "b2", b2, ctx, dt, {E, H}, "[E, H]");
  float_tensor(fn, "z", z, ctx, dt, {N, ZW}, "[N, z_width]");
  f32_tensor(fn, "pair_score", pair_score, ctx, {N}, "[N]");
  float_tensor(fn, "dz", dz, ctx, dt, {N, ZW}, "[N, z_width]");
  float_tensor(fn, "as", as, ctx, dt, {N, I}, "[N, I]");
  f32_tensor(fn, "dscore", dscore, ctx, {N}, "[N]");
  check_gemm_stage(fn, ctx, meta, T, {{"hidden_size H", H}, {"intermediate_size I", I}});
}

// The operands of a varlen-K weight gradient (steps 8 and 9, dW[e] = sum over the expert's rows of
// tok[gather[r]]^T rows[r]): `tok` [T, H] in token order, the stage's leading float tensor, and `rows` [N, C] in
// sorted row order. Returns their dtype, H and C.
struct WeightGradOperands {
  DType dt;
  std::int64_t H, C;
};
WeightGradOperands check_weight_grad_operands(const char* fn, const Context& ctx, const RoutingMetadata& meta,
                                              const char* tok_name, const TensorView& tok, const char* rows_name,
                                              const TensorView& rows, const char* rows_desc) {
  check_context(ctx, fn);
  const DType dt = leading_float_tensor(fn, tok_name, tok, ctx, {meta.num_tokens, -1}, "[T, H]");
  float_tensor(fn, rows_name, rows, ctx, dt, {meta.num_pairs, -1}, rows_desc);
  return {dt, tok.shape[1], rows.shape[1]};
}

// A GradWrite from the caller (an int cast to it would run neither).
void check_grad_write(const char* fn, GradWrite w) {
  SONICMOE_CHECK(w == GradWrite::store || w == GradWrite::accumulate, "sonicmoe::", fn, ": dw_write = ",
                 static_cast<int>(w), " is not a GradWrite");
}

void check_weight_grad_w2(const char* fn, const Context& ctx, const TensorView& d_out, const TensorView& as,
                          const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dw2,
                          const TensorView& db2, GradWrite dw_write) {
  const auto [dt, H, I] = check_weight_grad_operands(fn, ctx, meta, "d_out", d_out, "as", as, "[N, I]");
  const std::int64_t E = meta.num_experts;
  check_grad_write(fn, dw_write);
  if (dw_write == GradWrite::accumulate) f32_tensor(fn, "dw2", dw2, ctx, {E, H, I}, "[E, H, I] (accumulated into)");
  else float_tensor(fn, "dw2", dw2, ctx, dt, {E, H, I}, "[E, H, I]");
  if (db2.given()) {
    float_tensor(fn, "db2", db2, ctx, dt, {E, H}, "[E, H]");
    f32_tensor(fn, "pair_score", pair_score, ctx, {meta.num_pairs}, "[N] (needed for db2)");
  }
  check_gemm_stage(fn, ctx, meta, meta.num_tokens, {{"hidden_size H", H}, {"intermediate_size I", I}});
}
}  // namespace

void dgated(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
            const TensorView& b2, const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta,
            const TensorView& dz, const TensorView& as, const TensorView& dscore) {
  check_dgated("dgated", ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
  SONICMOE_DISPATCH(ctx, dgated, ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
}

void weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2, GradWrite dw_write) {
  check_weight_grad_w2("weight_grad_w2", ctx, d_out, as, pair_score, meta, dw2, db2, dw_write);
  SONICMOE_DISPATCH(ctx, weight_grad_w2, ctx, d_out, as, pair_score, meta, dw2, db2, dw_write);
}

void dgated_and_weight_grad_w2(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                               const TensorView& b2, const TensorView& z, const TensorView& pair_score,
                               const RoutingMetadata& meta, const TensorView& dz, const TensorView& as,
                               const TensorView& dscore, const TensorView& dw2, const TensorView& db2,
                               GradWrite dw_write) {
  const char* fn = "dgated_and_weight_grad_w2";
  check_dgated(fn, ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
  check_weight_grad_w2(fn, ctx, d_out, as, pair_score, meta, dw2, db2, dw_write);
  // The backends run the two stages back to back (on the cuda backend each GEMM gathers the rows of dO itself).
  SONICMOE_DISPATCH(ctx, dgated, ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
  SONICMOE_DISPATCH(ctx, weight_grad_w2, ctx, d_out, as, pair_score, meta, dw2, db2, dw_write);
}

void weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1, W1Layout w1_layout, GradWrite dw_write) {
  const char* fn = "weight_grad_w1";
  const auto [dt, H, ZW] = check_weight_grad_operands(fn, ctx, meta, "x", x, "dz", dz, "[N, z_width]");
  const std::int64_t E = meta.num_experts;
  check_w1_layout(fn, w1_layout, ZW);
  check_grad_write(fn, dw_write);
  if (dw_write == GradWrite::accumulate) {
    SONICMOE_CHECK(w1_layout != W1Layout::separate, "sonicmoe::", fn, ": dw_write accumulate takes dw1 in the "
                   "interleaved or concatenated W1 layout, not separate");
    f32_tensor(fn, "dw1", dw1, ctx, {E, ZW, H}, "[E, z_width, H] (accumulated into)");
  } else {
    w1_operand(fn, "dw1", dw1, ctx, dt, w1_layout, E, ZW, H);
  }
  b1_operand(fn, "db1", db1, ctx, dt, w1_layout, E, ZW);
  check_gemm_stage(fn, ctx, meta, meta.num_tokens, {{"z_width", ZW}, {"hidden_size H", H}});
  SONICMOE_DISPATCH(ctx, weight_grad_w1, ctx, dz, x, meta, dw1, db1, w1_layout, dw_write);
}

void expert_input_grad(const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe, W1Layout w1_layout) {
  const char* fn = "expert_input_grad";
  check_context(ctx, fn);
  const DType dt = leading_float_tensor(fn, "dz", dz, ctx, {meta.num_pairs, -1}, "[N, z_width]");
  const std::int64_t ZW = dz.shape[1];
  check_w1_layout(fn, w1_layout, ZW);
  // H from W1's last dimension: [E, z_width, H], or [2, E, I, H] under separate
  const std::int64_t H = w1.ndim > 0 ? w1.shape[w1.ndim - 1] : -1;
  w1_operand(fn, "w1", w1, ctx, dt, w1_layout, meta.num_experts, ZW, H);
  float_tensor(fn, "dxe", dxe, ctx, dt, {meta.num_pairs, H}, "[N, H]");
  check_gemm_stage(fn, ctx, meta, meta.num_tokens, {{"z_width", ZW}, {"hidden_size H", H}});
  SONICMOE_DISPATCH(ctx, expert_input_grad, ctx, dz, w1, meta, dxe, w1_layout);
}

void router_backward(const Context& ctx, const Routing& routing, const TensorView& dscore,
                     const AuxLossGrad& d_aux_loss, const TensorView& dlogits) {
  const char* fn = "router_backward";
  check_context(ctx, fn);
  SONICMOE_CHECK(routing.mode != RoutingMode::general, "sonicmoe::", fn,
                 ": general routing has no router; its score gradient is the output dscore");
  Arg al(fn, "routing.logits", routing.logits.view());
  f32_arg(al, ctx).ndim(2);
  const std::int64_t T = routing.logits.size(0), E = routing.logits.size(1), N = routing.meta.num_pairs;
  SONICMOE_CHECK(N >= 0, "sonicmoe::", fn, ": routing.meta.num_pairs = ", N, ", expected N >= 0");
  f32_tensor(fn, "dscore", dscore, ctx, {N}, "[N]");
  f32_tensor(fn, "dlogits", dlogits, ctx, {T, E}, "[T, E]");
  if (d_aux_loss.tensor.given()) {  // a device scalar the cuda kernels read; the reference reads it on the host
    f32_tensor(fn, "d_aux_loss", d_aux_loss.tensor, ctx, {1}, "[1]");
  }
  // What the backward reads besides the logits: the router's top-K choice and weights, the pairs and their metadata.
  const bool rounding = is_token_rounding(routing.mode);
  SONICMOE_CHECK(routing.mode == RoutingMode::topk || rounding, "sonicmoe::", fn, ": routing.mode = ",
                 static_cast<int>(routing.mode), " is not a routing mode with a router (topk or token rounding)");
  const std::int64_t K = routing.top_k;
  check_topk(fn, ctx, K, E);
  check_router(fn, ctx, routing.router, E, K);
  int_tensor(fn, "routing.topk_expert", routing.topk_expert, ctx, {T, K}, "[T, K]");
  f32_tensor(fn, "routing.topk_score", routing.topk_score, ctx, {T, K}, "[T, K]");
  int_tensor(fn, "routing.pair_expert", routing.pair_expert, ctx, {N}, "[N]");
  if (rounding) int_tensor(fn, "routing.pair_slot", routing.pair_slot, ctx, {N}, "[N]");
  // (not the whole metadata: the expert-parallel backward passes the group's counts, which its offsets do not scan)
  int_tensor(fn, "routing.meta.token_offsets", routing.meta.token_offsets, ctx, {T + 1}, "[T+1]");
  int_tensor(fn, "routing.meta.counts", routing.meta.counts, ctx, {E}, "[E]");
  if (routing.meta.demand.defined()) int_tensor(fn, "routing.meta.demand", routing.meta.demand, ctx, {E}, "[E]");
  if (!ctx.device().is_cuda()) {  // the reference indexes with these values
    Arg(fn, "routing.topk_expert", routing.topk_expert.view()).values_in(0, E, "[0, E)");
    Arg(fn, "routing.pair_expert", routing.pair_expert.view()).values_in(0, E, "[0, E)");
    const std::int32_t* toff = routing.meta.token_offsets.ptr<const std::int32_t>();
    SONICMOE_CHECK(toff[0] == 0, "sonicmoe::", fn, ": routing.meta.token_offsets[0] = ", toff[0], ", expected 0");
    for (std::int64_t t = 0; t < T; ++t)
      SONICMOE_CHECK(toff[t + 1] >= toff[t] && toff[t + 1] <= N, "sonicmoe::", fn, ": routing.meta.token_offsets[",
                     t + 1, "] = ", toff[t + 1], ", expected non-decreasing and <= N = ", N);
    if (rounding) {
      Arg(fn, "routing.pair_slot", routing.pair_slot.view()).values_in(-1, K, "-1 or a slot in [0, K)");
    } else {
      for (std::int64_t t = 0; t < T; ++t)  // top-K: a token's pairs are its slots
        SONICMOE_CHECK(toff[t + 1] - toff[t] <= K, "sonicmoe::", fn, ": token ", t, " has ", toff[t + 1] - toff[t],
                       " pairs in routing.meta.token_offsets, expected at most top_k = ", K);
    }
  }
  check_backend_limits(fn, ctx, routing_sizes(T, N, E, routing.top_k));
  SONICMOE_DISPATCH(ctx, router_backward, ctx, routing, dscore, d_aux_loss, dlogits);
}

void router_weight_grad(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx,
                        GradWrite dw_write) {
  const char* fn = "router_weight_grad";
  check_context(ctx, fn);
  Arg ax(fn, "x", x);
  ax.given().float_dtype().ndim(2);
  const DType dt = x.dtype;
  float_arg(ax, ctx, dt);
  const std::int64_t T = x.shape[0], H = x.shape[1];
  float_tensor(fn, "router_weight", router_weight, ctx, dt, {-1, H}, "[E, H]");
  const std::int64_t E = router_weight.shape[0];
  f32_tensor(fn, "dlogits", dlogits, ctx, {T, E}, "[T, E]");
  check_grad_write(fn, dw_write);
  if (dw_write == GradWrite::accumulate) f32_tensor(fn, "drouter", drouter, ctx, {E, H}, "[E, H] (accumulated into)");
  else float_tensor(fn, "drouter", drouter, ctx, dt, {E, H}, "[E, H]");
  float_tensor(fn, "dx", dx, ctx, dt, {T, H}, "[T, H]");
  SONICMOE_DISPATCH(ctx, router_weight_grad, ctx, dlogits, x, router_weight, drouter, dx, dw_write);
}

}  // namespace sonicmoe

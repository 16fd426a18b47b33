// The layer: DESIGN.md sections 2-3 as one call per step. Backend-independent: every step is a stage
// (src/moe/stages.cpp), every buffer comes from the context's allocator and is dropped as soon as the
// next step no longer needs it, so only X, Z, the scores and the metadata outlive forward.
#include <string>
#include <utility>

#include "core/check.h"
#include "core/context_alloc.h"
#include "core/device_ops.h"
#include "moe/fp8_weights.h"
#include "moe/grad_buffers.h"
#include "moe/limits.h"
#include "moe/router.h"
#include "moe/w1_layout.h"
#include "reference/fp8_layer_ref.h"
#include "reference/reference.h"
#include "sonicmoe/dispatched.h"
#include "sonicmoe/expert_rows.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"
#include "sonicmoe/stages.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/cuda_backend.h"
#include "cuda/fp8/fp8_layer.h"
#endif

namespace sonicmoe {

namespace {

using check::Arg;


// Shapes of X and the weights against the config (the stages check them again against each other).
void check_layer_args(const char* fn, const Context& ctx, const MoEConfig& cfg, const TensorView& x,
                      const MoEWeights& w, bool need_router) {
  check::backend(ctx, fn);
  SONICMOE_CHECK(!(x.given() && x.dtype == DType::f16 && cfg.precision == Precision::fp8_blockwise), "sonicmoe::", fn,
                 ": argument 'x' has dtype f16; precision fp8_blockwise takes bf16 or f32 inputs (f16 runs with "
                 "precision bf16, the 16-bit layer)");
  validate_config(cfg);
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  Arg ax(fn, "x", x);
  ax.given().float_dtype().shape({-1, H}, "[T, H]").on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cuda) ax.aligned(16);  // the kernels' 16-byte vector loads and TMA
  SONICMOE_CHECK(x.shape[0] >= 1, "sonicmoe::", fn, ": argument 'x' has T = ", x.shape[0],
                 " tokens, expected T >= 1");
  const DType dt = x.dtype;
  // The cuda FP8 layer hands these to its kernels directly (the bf16 layer's stages check alignment themselves).
  const std::size_t align = ctx.backend == Backend::cuda && cfg.precision == Precision::fp8_blockwise ? 16 : 1;
  const bool separate = cfg.effective_w1_layout() == W1Layout::separate;
  if (separate) {  // gate and up [E, I, H] (and [E, I] biases), their addresses checked by w1_separate_view
    for (auto [name, t] : {std::pair{"w1", &w.w1}, {"w1_up", &w.w1_up}}) {
      Arg a(fn, name, *t);
      a.given().dtype(dt).shape({E, I, H}, "[E, I, H] (w1_layout separate)").on(ctx.device()).contiguous();
    }
    (void)w1_separate_view(fn, "w1", w.w1, "w1_up", w.w1_up);
  } else {
    SONICMOE_CHECK(!w.w1_up.given() && !w.b1_up.given(), "sonicmoe::", fn, ": w1_up / b1_up were given but the "
                   "config's effective w1_layout is ", w1_layout_name(cfg.effective_w1_layout()), ", not separate");
    Arg a(fn, "w1", w.w1);
    a.given().dtype(dt).shape({E, ZW, H}, "[E, z_width, H]").on(ctx.device()).contiguous().aligned(align);
  }
  { Arg a(fn, "w2", w.w2); a.given().dtype(dt).shape({E, H, I}, "[E, H, I]").on(ctx.device()).contiguous()
        .aligned(align); }
  if (cfg.add_bias) {
    if (separate) {
      for (auto [name, t] : {std::pair{"b1", &w.b1}, {"b1_up", &w.b1_up}}) {
        Arg a(fn, name, *t);
        a.given().dtype(dt).shape({E, I}, "[E, I] (w1_layout separate)").on(ctx.device()).contiguous();
      }
      (void)w1_separate_view(fn, "b1", w.b1, "b1_up", w.b1_up);
    } else {
      Arg a(fn, "b1", w.b1);
      a.given().dtype(dt).shape({E, ZW}, "[E, z_width]").on(ctx.device()).contiguous().aligned(align);
    }
    { Arg a(fn, "b2", w.b2); a.given().dtype(dt).shape({E, H}, "[E, H]").on(ctx.device()).contiguous()
          .aligned(align); }
  } else {
    SONICMOE_CHECK(!w.b1.given() && !w.b1_up.given() && !w.b2.given(), "sonicmoe::", fn,
                   ": biases b1/b2 were given but config.add_bias is false");
  }
  if (need_router) {
    Arg a(fn, "router", w.router);
    a.given().dtype(dt).shape({E, H}, "[E, H]").on(ctx.device()).contiguous();
  }
}

// W1 and b1 as the stages take them (stages.h): under W1Layout::separate the [2, E, I, H] / [2, E, I] views of the
// gate / up pairs (w1_separate_view), otherwise the caller's tensors. Checked by check_layer_args first.
TensorView stage_w1(const char* fn, const MoEConfig& cfg, const MoEWeights& w) {
  if (cfg.effective_w1_layout() != W1Layout::separate) return w.w1;
  return w1_separate_view(fn, "w1", w.w1, "w1_up", w.w1_up);
}
TensorView stage_b1(const char* fn, const MoEConfig& cfg, const MoEWeights& w) {
  if (cfg.effective_w1_layout() != W1Layout::separate || !w.b1.given()) return w.b1;
  return w1_separate_view(fn, "b1", w.b1, "b1_up", w.b1_up);
}

// The caller's (token, expert, score) triples of general routing: int32 / int32 / f32 [N] on the context's device.
void check_general_spec(const char* fn, const Context& ctx, const RoutingSpec& spec) {
  Arg at(fn, "spec.token", spec.token);
  at.given().dtype(DType::i32).ndim(1).on(ctx.device()).contiguous();
  const std::int64_t N = spec.token.shape[0];
  { Arg a(fn, "spec.expert", spec.expert); a.given().dtype(DType::i32).shape({N}, "[N]").on(ctx.device()).contiguous(); }
  { Arg a(fn, "spec.score", spec.score); a.given().dtype(DType::f32).shape({N}, "[N]").on(ctx.device()).contiguous(); }
}

// Before anything is allocated: the index contract on every backend, and on the cpu backend the pass's buffers
// against the host's available memory (past it the OS would kill the process mid-run instead of an Error).
void check_sizes(const char* fn, const Context& ctx, const MoEConfig& cfg, std::int64_t T, std::int64_t N,
                 RoutingMode mode, DType dt, MemoryPass pass, bool reuse_z = false,
                 bool fp8_backward_quantises = false) {
  limits::check_index_limits(fn, cfg, T, N, limits::pairs_desc(mode));
  if (ctx.backend != Backend::cpu) return;
  const std::size_t need = limits::layer_bytes(cfg, T, N, dt, mode, pass, reuse_z, fp8_backward_quantises);
  const char* what = pass == MemoryPass::forward ? "the forward" : pass == MemoryPass::inference ? "the inference forward"
                                                                                                 : "the backward";
  limits::check_host_memory(fn, cfg, T, need, what);
}

// The expert part under fp8_blockwise (steps 4-6 / 7-10) on the context's backend: the CPU reference
// (src/reference/fp8_layer_ref.h) or the cuda FP8 layer (src/cuda/fp8/fp8_layer.h), stage for stage the same.
Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, SavedState* saved, const Fp8Rows* xq = nullptr) {
#ifdef SONICMOE_WITH_CUDA
  if (ctx.backend == Backend::cuda) return cuda::fp8_experts_forward(ctx, cfg, x, w, r, saved, xq);
#endif
  return ref::fp8_experts_forward(ctx, cfg, x, w, r, saved, xq);
}
// reuse_z: dZ's codes written over the saved FP8 Z on the GPU (the CPU reference keeps its own buffers).
void fp8_experts_backward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const SavedState& saved, const TensorView& d_out, Gradients& g, bool reuse_z) {
#ifdef SONICMOE_WITH_CUDA
  if (ctx.backend == Backend::cuda) return cuda::fp8_experts_backward(ctx, cfg, x, w, saved, d_out, g, reuse_z);
#endif
  (void)reuse_z;
  ref::fp8_experts_backward(ctx, cfg, x, w, saved, d_out, g);
}

}  // namespace

void validate_config(const MoEConfig& c) {
  SONICMOE_CHECK(c.num_experts >= 1, "sonicmoe::MoEConfig: num_experts = ", c.num_experts, ", expected >= 1");
  SONICMOE_CHECK(c.hidden_size >= 1, "sonicmoe::MoEConfig: hidden_size = ", c.hidden_size, ", expected >= 1");
  SONICMOE_CHECK(c.intermediate_size >= 1, "sonicmoe::MoEConfig: intermediate_size = ", c.intermediate_size,
                 ", expected >= 1");
  SONICMOE_CHECK(c.top_k >= 1 && c.top_k <= c.num_experts, "sonicmoe::MoEConfig: top_k = ", c.top_k,
                 ", expected 1 <= top_k <= num_experts = ", c.num_experts);
  int a = static_cast<int>(c.activation);
  SONICMOE_CHECK(a >= 0 && a < kNumActivations, "sonicmoe::MoEConfig: activation = ", a, " is not an Activation");
  // The GEMM dimensions are int32 in the kernels (kMaxDim); checked before z_width() doubles I.
  for (auto [name, v] : {std::pair{"num_experts", c.num_experts}, {"hidden_size", c.hidden_size},
                         {"intermediate_size", c.intermediate_size}})
    SONICMOE_CHECK(v <= kMaxDim, "sonicmoe::MoEConfig: ", name, " = ", v, " exceeds the limit of ", kMaxDim,
                   " (the kernels' int32 dimensions)");
  for (auto [name, p] : {std::pair{"precision", c.precision}, {"weight_grad_precision", c.weight_grad_precision},
                         {"dgated_precision", c.dgated_precision}})
    SONICMOE_CHECK(p == Precision::bf16 || p == Precision::fp8_blockwise, "sonicmoe::MoEConfig: ", name, " = ",
                   static_cast<int>(p), " is not a Precision");
  // fp8_blockwise: every GEMM reduction (H, I, z_width) runs over whole 1x128 / 128x128 blocks (docs/ALGORITHM.md).
  if (c.precision == Precision::fp8_blockwise)
    for (auto [name, v] : {std::pair{"hidden_size", c.hidden_size}, {"intermediate_size", c.intermediate_size}})
      SONICMOE_CHECK(v % kFp8BlockSize == 0, "sonicmoe::MoEConfig: ", name, " = ", v, " cannot be quantised under "
                     "precision fp8_blockwise: it must be a multiple of ", kFp8BlockSize, " (the FP8 block size)");
  SONICMOE_CHECK(c.w1_layout == W1Layout::interleaved || c.w1_layout == W1Layout::concatenated ||
                     c.w1_layout == W1Layout::separate,
                 "sonicmoe::MoEConfig: w1_layout = ", static_cast<int>(c.w1_layout), " is not a W1Layout");
  // FP8's 128x128 weight blocks group W1's rows in their stored order: the layouts would quantise differently.
  SONICMOE_CHECK(!(c.precision == Precision::fp8_blockwise && is_glu(c.activation) &&
                   c.w1_layout != W1Layout::interleaved),
                 "sonicmoe::MoEConfig: w1_layout ", w1_layout_name(c.w1_layout), " is not supported with precision "
                 "fp8_blockwise (W1's 128x128 quantisation blocks depend on the row order); use the interleaved "
                 "layout");
  SONICMOE_CHECK(c.z_width() <= kMaxDim, "sonicmoe::MoEConfig: z_width = 2 * intermediate_size = ", c.z_width(),
                 " exceeds the limit of ", kMaxDim, " (the kernels' int32 dimensions)");
}

std::size_t saved_state_bytes(const SavedState& s) {
  const Routing& r = s.routing;
  const RoutingMetadata& m = r.meta;
  // Under top-K the pair expert / score arrays are views of the top-K arrays: each buffer counted once.
  const Tensor* all[] = {&s.z, &s.z_fp8, &s.z_scale, &s.w1_t_fp8, &s.w1_t_scale, &s.w2_t_fp8, &s.w2_t_scale,
                         &r.logits, &r.topk_expert, &r.topk_score, &r.pair_token, &r.pair_expert, &r.pair_score,
                         &r.pair_slot, &r.aux_loss, &m.counts, &m.offsets, &m.pair, &m.gather, &m.rev,
                         &m.token_offsets, &m.demand, &m.dropped};
  std::size_t b = 0;
  for (std::size_t i = 0; i < sizeof(all) / sizeof(all[0]); ++i) {
    const Tensor& t = *all[i];
    if (!t.defined() || t.nbytes() == 0) continue;
    bool seen = false;
    for (std::size_t j = 0; j < i && !seen; ++j) seen = all[j]->defined() && all[j]->data() == t.data();
    if (!seen) b += t.nbytes();
  }
  return b;
}

double moe_forward_flops(const MoEConfig& cfg, std::int64_t num_pairs) {
  return 2.0 * static_cast<double>(num_pairs) * static_cast<double>(cfg.hidden_size) *
         static_cast<double>(cfg.z_width() + cfg.intermediate_size);
}

Routing route(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const TensorView& router_weight,
              const RoutingSpec& spec) {
  const char* fn = "route";
  check::backend(ctx, fn);
  validate_config(cfg);
  SONICMOE_CHECK(spec.mode == RoutingMode::topk || spec.mode == RoutingMode::general || is_token_rounding(spec.mode),
                 "sonicmoe::route: unknown routing mode ", static_cast<int>(spec.mode));
  Arg(fn, "x", x).given().ndim(2);  // T comes from x: valid before anything is sized by it
  const std::int64_t T = x.shape[0], E = cfg.num_experts, K = cfg.top_k;
  if (spec.mode == RoutingMode::general) check_general_spec(fn, ctx, spec);
  SONICMOE_CHECK(spec.mode == RoutingMode::topk || spec.router.is_default(), "sonicmoe::route: spec.router (a "
                 "non-default RouterSpec) needs routing mode topk, got ", routing_mode_name(spec.mode));
  if (spec.mode == RoutingMode::topk) check_router(fn, ctx, spec.router, E, K);  // before anything is computed
  const std::int64_t N_max = limits::max_pairs(cfg, T, spec);
  limits::check_index_limits(fn, cfg, T, N_max, limits::pairs_desc(spec.mode));
  if (ctx.backend == Backend::cpu)  // route is public: called alone it must not run the host out of memory either
    limits::check_host_memory(fn, cfg, T, limits::routing_bytes(cfg, T, N_max, spec.mode), "the routing");
  Routing r;
  r.mode = spec.mode;
  r.top_k = K;

  if (spec.mode == RoutingMode::general) {
    const std::int64_t N = N_max;
    r.pair_token = alloc_on(ctx, {N}, DType::i32);
    r.pair_expert = alloc_on(ctx, {N}, DType::i32);
    r.pair_score = alloc_on(ctx, {N}, DType::f32);
    copy_async(r.pair_token, spec.token, ctx.stream);
    copy_async(r.pair_expert, spec.expert, ctx.stream);
    copy_async(r.pair_score, spec.score, ctx.stream);
    r.aux_loss = alloc_zeros_on(ctx, {1}, DType::f32);
    r.meta = build_metadata(ctx, r.pair_token, r.pair_expert, T, E);
    return r;
  }

  // Steps 1-2 (router) for top-K and token rounding.
  r.logits = alloc_on(ctx, {T, E}, DType::f32);
  router_logits(ctx, x, router_weight, r.logits);
  if (spec.mode == RoutingMode::topk) {
    r.topk_expert = alloc_on(ctx, {T, K}, DType::i32);
    r.topk_score = alloc_on(ctx, {T, K}, DType::f32);
    r.pair_token = alloc_on(ctx, {N_max}, DType::i32);  // N = T*K exactly
    r.meta = topk_routing(ctx, r.logits, K, r.topk_expert, r.topk_score, r.pair_token, spec.router);  // steps 2-3
    r.router = spec.router;
    r.router.e_score_correction_bias = TensorView();  // selection only: the backward never reads it
    r.pair_expert = r.topk_expert.reshape({N_max});
    r.pair_score = r.topk_score.reshape({N_max});
  } else {
    Tensor logits = r.logits;
    r = token_rounding(ctx, logits, K, spec.tile, spec.mode);
    r.logits = logits;
  }
  r.aux_loss = alloc_on(ctx, {1}, DType::f32);
  // f_e counts the router's choices, before a capacity drops any (Switch / GShard / Megatron-LM do the same).
  aux_loss(ctx, r.logits, r.meta.demand.defined() ? r.meta.demand : r.meta.counts, r.aux_loss);
  return r;
}

namespace {

// Steps 4-6 on routed tokens: returns O [T, H] (Y [N, H] before step 6 with expert_rows). Z goes into `z_keep` when
// given (the training forward keeps it for the backward); otherwise into a buffer dropped right after the
// up-projection, so the peak is max(Z + A, A + Y) instead of Z + A + Y.
Tensor experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                       const Routing& r, const Tensor& z_keep, bool expert_rows = false) {
  const std::int64_t T = x.shape[0], H = cfg.hidden_size, I = cfg.intermediate_size, N = r.meta.num_pairs;
  const DType dt = x.dtype;
  Tensor y;
  {
    Tensor a = alloc_on(ctx, {N, I}, dt);
    {
      Tensor z = z_keep.defined() ? z_keep : alloc_on(ctx, {N, cfg.z_width()}, dt);
      up_projection(ctx, cfg.activation, x, stage_w1("up_projection", cfg, w), stage_b1("up_projection", cfg, w),
                    r.meta, z, a, cfg.effective_w1_layout());  // step 4
    }
    y = alloc_on(ctx, {N, H}, dt);
    down_projection(ctx, a, w.w2, w.b2, r.meta, y);  // step 5; A is dropped here
  }
  if (expert_rows) return y;
  Tensor out = alloc_on(ctx, {T, H}, dt);
  aggregate(ctx, y, r.pair_score, r.meta, out);  // step 6
  return out;
}

// The expert-rows entries (sonicmoe/expert_rows.h): general routing (with a router, step 11 adds into dX) and the
// 16-bit layer (the FP8 one sums inside its own stages).
void check_expert_rows(const char* fn, const MoEConfig& cfg, RoutingMode mode) {
  SONICMOE_CHECK(mode == RoutingMode::general, "sonicmoe::", fn, ": the expert rows are returned under general "
                 "routing only (the routing modes with a router add the router's dX into the summed rows)");
  SONICMOE_CHECK(cfg.precision == Precision::bf16, "sonicmoe::", fn, ": the expert rows are returned by the 16-bit "
                 "layer only (the config has precision ", precision_name(cfg.precision), ")");
}

// moe_forward's steps 1-6 under `fn`'s name; xq (precision fp8_blockwise): X given quantised 1x128, x then only its
// shape and dtype (moe_forward_general_fp8); expert_rows: steps 1-5, the output Y [N, H] (moe_forward_expert_rows).
ForwardResult forward_impl(const char* fn, const Context& ctx, const MoEConfig& cfg, const TensorView& x,
                           const MoEWeights& w, const RoutingSpec& spec, const Fp8Rows* xq = nullptr,
                           bool expert_rows = false) {
  const bool has_router = spec.mode != RoutingMode::general;
  if (expert_rows) check_expert_rows(fn, cfg, spec.mode);
  check_layer_args(fn, ctx, cfg, x, w, has_router);
  const std::int64_t T = x.shape[0];
  const DType dt = x.dtype;
  if (!has_router) check_general_spec(fn, ctx, spec);
  check_sizes(fn, ctx, cfg, T, limits::max_pairs(cfg, T, spec), spec.mode, dt, MemoryPass::forward);

  ForwardResult res;
  res.saved.config = cfg;
  res.saved.routing = route(ctx, cfg, x, w.router, spec);  // steps 1-3 (general routing reads no X)
  const Routing& r = res.saved.routing;
  const std::int64_t N = r.meta.num_pairs;

  if (cfg.precision == Precision::fp8_blockwise) {  // steps 4-6 in FP8 (DESIGN.md section 9); saves Z in FP8
    res.output = fp8_experts_forward(ctx, cfg, x, w, r, &res.saved, xq);
  } else {
    res.saved.z = alloc_on(ctx, {N, cfg.z_width()}, dt);
    res.output = experts_forward(ctx, cfg, x, w, r, res.saved.z, expert_rows);  // steps 4-6 (4-5)
  }
  res.aux_loss = r.aux_loss;
  return res;
}

}  // namespace

ForwardResult moe_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const RoutingSpec& spec) {
  return forward_impl("moe_forward", ctx, cfg, x, w, spec);
}

ForwardResult moe_forward_expert_rows(const Context& ctx, const MoEConfig& cfg, const TensorView& x,
                                      const MoEWeights& w, const RoutingSpec& spec) {
  return forward_impl("moe_forward_expert_rows", ctx, cfg, x, w, spec, nullptr, /*expert_rows=*/true);
}

ForwardResult moe_forward_general_fp8(const Context& ctx, const MoEConfig& cfg, const Fp8Rows& xq,
                                      const MoEWeights& w, const RoutingSpec& spec) {
  const char* fn = "moe_forward_general_fp8";
  SONICMOE_CHECK(cfg.precision == Precision::fp8_blockwise, "sonicmoe::", fn, ": tokens given in FP8 need "
                 "MoEConfig::precision = fp8_blockwise (the config has ", precision_name(cfg.precision), ")");
  SONICMOE_CHECK(spec.mode == RoutingMode::general, "sonicmoe::", fn, ": tokens given in FP8 take general routing");
  check::backend(ctx, fn);
  validate_config(cfg);
  const std::int64_t H = cfg.hidden_size;
  { Arg a(fn, "xq.q", xq.q); a.given().dtype(DType::f8e4m3).shape({-1, H}, "[N, H]").on(ctx.device()).contiguous();
    if (ctx.backend == Backend::cuda) a.aligned(16); }
  const std::int64_t T = xq.q.shape[0];
  { Arg a(fn, "xq.scale", xq.scale); a.given().dtype(DType::f32).shape({T, fp8_num_blocks(H)}, "[N, H / 128]")
        .on(ctx.device()).contiguous(); }
  // The weights' dtype is the layer's (output, saved state); X's shape and that dtype stand in for X in the checks
  // and the routing (a view at the codes' address that nothing reads: the experts read xq).
  Arg(fn, "w1", w.w1).given().float_dtype();
  SONICMOE_CHECK(w.w1.dtype != DType::f16, "sonicmoe::", fn, ": argument 'w1' has dtype f16; precision fp8_blockwise "
                 "takes bf16 or f32 weights");
  return forward_impl(fn, ctx, cfg, TensorView(xq.q.data, w.w1.dtype, {T, H}, ctx.device()), w, spec, &xq);
}

Tensor moe_inference(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                     const RoutingSpec& spec, Tensor* dropped) {
  const bool has_router = spec.mode != RoutingMode::general;
  check_layer_args("moe_inference", ctx, cfg, x, w, has_router);
  const std::int64_t T = x.shape[0];
  if (!has_router) check_general_spec("moe_inference", ctx, spec);
  check_sizes("moe_inference", ctx, cfg, T, limits::max_pairs(cfg, T, spec), spec.mode, x.dtype,
              MemoryPass::inference);
  const Routing r = route(ctx, cfg, x, w.router, spec);  // steps 1-3
  if (dropped) *dropped = r.meta.dropped;
  if (cfg.precision == Precision::fp8_blockwise) return fp8_experts_forward(ctx, cfg, x, w, r, nullptr);
  return experts_forward(ctx, cfg, x, w, r, Tensor());     // steps 4-6, Z dropped after step 4
}

namespace {

// Steps 7-11. Buffers are allocated where a step needs them and dropped after their last use, in the order that
// keeps the fewest alive: dXe [N, H] (the largest) is made and summed into dX before dW1 [E, z_width, H] exists.
// With reuse_z, dZ is written over Z (the dgated epilogue reads each Z element once, in the lane that then writes
// dZ there), which saves [N, z_width] of the peak; the caller gives Z up.
// part: the whole backward, or one half of the split one (moe_backward_activations / moe_backward_weights; `keep`
// carries dZ and A*s from the first half to the second). expert_rows (the first half, moe_backward_expert_rows): g.dx
// is dXe [N, H], not summed (step 10b is the caller's, before the second half).
enum class Part { all, activations, weights };

Gradients backward_steps(const Context& ctx, const TensorView& x, const MoEWeights& w, const SavedState& saved,
                         const TensorView& d_out, const AuxLossGrad& d_aux_loss, bool reuse_z, Part part = Part::all,
                         WeightGradOperands* keep = nullptr, bool dw2_in_part1 = false, bool expert_rows = false) {
  const char* fn = expert_rows ? "moe_backward_expert_rows"
                   : part == Part::all ? "moe_backward"
                   : part == Part::activations ? "moe_backward_activations" : "moe_backward_weights";
  const MoEConfig& cfg = saved.config;
  const Routing& r = saved.routing;
  const bool has_router = r.mode != RoutingMode::general;
  if (expert_rows) check_expert_rows(fn, cfg, r.mode);
  check_layer_args(fn, ctx, cfg, x, w, has_router);
  const std::int64_t T = x.shape[0], E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size;
  const std::int64_t ZW = cfg.z_width(), N = r.meta.num_pairs;
  const DType dt = x.dtype;
  check_router_main_grad(fn, ctx, E, H, w, has_router);
  check_expert_main_grads(fn, ctx, cfg.effective_w1_layout(), E, ZW, H, I, w);
  check_main_grads_disjoint(fn, w, {{"x", x}, {"d_out", d_out}});
  { Arg a(fn, "d_out", d_out); a.given().dtype(dt).shape({T, H}, "[T, H]").on(ctx.device()).contiguous();
    if (ctx.backend == Backend::cuda && cfg.precision == Precision::fp8_blockwise) a.aligned(16); }
  SONICMOE_CHECK(r.meta.num_tokens == T, "sonicmoe::", fn, ": argument 'x' has T = ", T,
                 " tokens but the saved state was made for T = ", r.meta.num_tokens);
  // (reuse_z under fp8: dZ's FP8 codes over the saved FP8 Z on the GPU; the estimate keeps their own buffer)
  check_sizes(fn, ctx, cfg, T, N, r.mode, dt, MemoryPass::backward, reuse_z && cfg.precision == Precision::bf16,
              cfg.precision == Precision::fp8_blockwise && fp8_backward_quantises(w, saved));
  // On the host the state's index arrays are checked before any stage indexes with them (O(T*K + E + N), far below
  // the backward's GEMMs): a state edited or built outside this library's forward must fail here, not read out of
  // bounds. (On the cuda backend this would be a host synchronisation: validate_saved_state is the caller's call.)
  if (ctx.backend == Backend::cpu) {
    try {
      validate_saved_state(ctx, saved, T);
    } catch (const Error& e) {
      throw Error(std::string("sonicmoe::") + fn + ": argument 'saved': " + e.what());
    }
  }
  if (part != Part::all) {
    SONICMOE_CHECK(cfg.precision == Precision::bf16, "sonicmoe::", fn,
                   ": the two-part backward supports precision bf16 only (use moe_backward)");
    SONICMOE_CHECK(keep != nullptr, "sonicmoe::", fn, ": argument 'keep' is required");
  }
  if (part == Part::weights) {  // steps 8 and 9 from part 1's dZ and A*s
    const WeightGradOperands& k = *keep;
    { Arg a(fn, "keep.dz", k.dz); a.given().dtype(dt).shape({N, ZW}, "[N, z_width]").on(ctx.device()).contiguous(); }
    Gradients g;
    if (k.as.defined()) {  // else part 1 ran step 8
      Arg a(fn, "keep.as", k.as);
      a.given().dtype(dt).shape({N, I}, "[N, I]").on(ctx.device()).contiguous();
      const DwTarget d2 = alloc_dw2(ctx, cfg, dt, w, g);
      weight_grad_w2(ctx, d_out, k.as, r.pair_score, r.meta, d2.view, g.db2, d2.write);  // step 8
    }
    const DwTarget d1 = alloc_dw1(ctx, cfg, dt, w, g);
    weight_grad_w1(ctx, k.dz, x, r.meta, d1.view, g.db1, cfg.effective_w1_layout(), d1.write);  // step 9
    return g;
  }

  Gradients g;
  // Pairs dropped by a capacity have no row, so step 7 writes no dscore for them: they get zero.
  g.dscore = r.meta.dropped.defined() ? alloc_zeros_on(ctx, {N}, DType::f32) : alloc_on(ctx, {N}, DType::f32);
  if (part == Part::activations) {  // steps 7 and 10; dZ and A*s kept for part 2
    Tensor dz = reuse_z ? saved.z : alloc_on(ctx, {N, ZW}, dt);
    Tensor as = alloc_on(ctx, {N, I}, dt);
    dgated(ctx, cfg.activation, d_out, w.w2, w.b2, saved.z, r.pair_score, r.meta, dz, as, g.dscore);  // step 7
    if (dw2_in_part1) {  // step 8 here: A*s is dropped before dX, as in the whole backward
      const DwTarget d2 = alloc_dw2(ctx, cfg, dt, w, g);
      weight_grad_w2(ctx, d_out, as, r.pair_score, r.meta, d2.view, g.db2, d2.write);
      as = Tensor();
    }
    if (expert_rows) {  // step 10a only
      g.dx = alloc_on(ctx, {N, H}, dt);
      expert_input_grad(ctx, dz, stage_w1(fn, cfg, w), r.meta, g.dx, cfg.effective_w1_layout());
    } else {
      g.dx = alloc_on(ctx, {T, H}, dt);
      Tensor dxe = alloc_on(ctx, {N, H}, dt);
      expert_input_grad(ctx, dz, stage_w1(fn, cfg, w), r.meta, dxe, cfg.effective_w1_layout());  // step 10a
      aggregate(ctx, dxe, TensorView(), r.meta, g.dx);  // step 10b
    }
    keep->dz = std::move(dz);
    keep->as = std::move(as);
  } else if (cfg.precision == Precision::fp8_blockwise) {  // steps 7-10 in FP8 (DESIGN.md section 9)
    { Arg a(fn, "saved.z_fp8", saved.z_fp8); a.given().dtype(DType::f8e4m3).shape({N, ZW}, "[N, z_width]")
          .on(ctx.device()).contiguous(); if (ctx.backend == Backend::cuda) a.aligned(16); }
    { Arg a(fn, "saved.z_scale", saved.z_scale); a.given().dtype(DType::f32)
          .shape({N, fp8_num_blocks(ZW)}, "[N, z_width / 128]").on(ctx.device()).contiguous(); }
    fp8_experts_backward(ctx, cfg, x, w, saved, d_out, g, reuse_z);
  } else {
    const DwTarget d2 = alloc_dw2(ctx, cfg, dt, w, g);
    Tensor dz = reuse_z ? saved.z : alloc_on(ctx, {N, ZW}, dt);
    {
      Tensor as = alloc_on(ctx, {N, I}, dt);
      dgated_and_weight_grad_w2(ctx, cfg.activation, d_out, w.w2, w.b2, saved.z, r.pair_score, r.meta, dz, as,
                                g.dscore, d2.view, g.db2, d2.write);  // steps 7-8
    }
    g.dx = alloc_on(ctx, {T, H}, dt);
    {
      Tensor dxe = alloc_on(ctx, {N, H}, dt);
      expert_input_grad(ctx, dz, stage_w1(fn, cfg, w), r.meta, dxe, cfg.effective_w1_layout());  // step 10a
      aggregate(ctx, dxe, TensorView(), r.meta, g.dx);  // step 10b: unweighted gather-sum
    }
    const DwTarget d1 = alloc_dw1(ctx, cfg, dt, w, g);
    weight_grad_w1(ctx, dz, x, r.meta, d1.view, g.db1, cfg.effective_w1_layout(), d1.write);  // step 9
  }
  if (has_router) {  // step 11
    Tensor dlogits = alloc_on(ctx, {T, E}, DType::f32);
    router_backward(ctx, r, g.dscore, d_aux_loss, dlogits);
    const DwTarget dr = alloc_drouter(ctx, E, H, dt, w, g.drouter);
    router_weight_grad(ctx, dlogits, x, w.router, dr.view, g.dx, dr.write);
  }
  return g;
}

}  // namespace

Gradients moe_backward(const Context& ctx, const TensorView& x, const MoEWeights& w, const SavedState& saved,
                       const TensorView& d_out, const AuxLossGrad& d_aux_loss) {
  return backward_steps(ctx, x, w, saved, d_out, d_aux_loss, /*reuse_z=*/false);
}

Gradients moe_backward(const Context& ctx, const TensorView& x, const MoEWeights& w, SavedState&& saved,
                       const TensorView& d_out, const AuxLossGrad& d_aux_loss) {
  const SavedState s = std::move(saved);  // Z is ours now: dZ is written over it
  return backward_steps(ctx, x, w, s, d_out, d_aux_loss, /*reuse_z=*/true);
}

Gradients moe_backward_expert_rows(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                   const SavedState& saved, const TensorView& d_out, WeightGradOperands& keep,
                                   bool dz_over_z) {
  return backward_steps(ctx, x, w, saved, d_out, AuxLossGrad(), dz_over_z, Part::activations, &keep,
                        /*dw2_in_part1=*/true, /*expert_rows=*/true);
}

Gradients moe_backward_activations(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                   const SavedState& saved, const TensorView& d_out, WeightGradOperands& keep,
                                   const AuxLossGrad& d_aux_loss, bool dz_over_z, bool dw2_in_part1) {
  return backward_steps(ctx, x, w, saved, d_out, d_aux_loss, dz_over_z, Part::activations, &keep, dw2_in_part1);
}

ExpertWeightGradients moe_backward_weights(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                           const SavedState& saved, const TensorView& d_out,
                                           const WeightGradOperands& keep) {
  Gradients g = backward_steps(ctx, x, w, saved, d_out, AuxLossGrad(), /*reuse_z=*/false, Part::weights,
                               const_cast<WeightGradOperands*>(&keep));
  return std::move(static_cast<ExpertWeightGradients&>(g));
}

}  // namespace sonicmoe

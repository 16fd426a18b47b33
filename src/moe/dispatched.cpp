// Entries for tokens a framework has already dispatched (include/sonicmoe/dispatched.h, DESIGN.md section 10): the
// contract becomes general-routing pairs (token = row, local expert, weight), then moe_forward / moe_backward.
#include "sonicmoe/dispatched.h"

#include <utility>
#include <vector>

#include "core/check.h"
#include "moe/dispatch_util.h"
#include "moe/grad_buffers.h"
#include "sonicmoe/quant.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/dispatch/dispatch_kernels.h"
#endif

namespace sonicmoe {

namespace {

using check::Arg;

// The local config: general routing reads no top_k, but validate_config wants 1 <= top_k <= E.
MoEConfig local_config(const MoEConfig& cfg) {
  MoEConfig c = cfg;
  c.top_k = 1;
  validate_config(c);
  SONICMOE_CHECK(c.effective_w1_layout() != W1Layout::separate, "sonicmoe: the dispatched entries do not take "
                 "w1_layout separate (give W1 interleaved or concatenated)");
  return c;
}

// The entry's rows x [N, H] on ctx's backend; returns N.
std::int64_t check_x(const char* fn, const char* name, const Context& ctx, const MoEConfig& cfg, const TensorView& x) {
  check::backend(ctx, fn);
  Arg(fn, name, x).given().float_dtype().shape({-1, cfg.hidden_size}, "[N, H]").on(ctx.device()).contiguous();
  return x.shape[0];
}

// N = 0 rows: nothing runs; the weight gradients are zeros (as for an expert without rows).
bool no_rows(const DispatchedForward& f) { return f.rows == 0; }

// The forward of N = 0 rows under `contract`: cfg checked, an empty [0, H] output, no saved state.
DispatchedForward empty_forward(const Context& ctx, const MoEConfig& cfg, DispatchContract contract, std::int64_t k,
                                DType dt) {
  local_config(cfg);
  DispatchedForward f;
  f.contract = contract;
  f.k = k;
  f.output = alloc_on(ctx, {0, cfg.hidden_size}, dt);
  return f;
}

// The forward of x's rows under `contract`: the layer's general routing over the pairs (token, expert, score).
// xq: the rows given in FP8 instead (x then only names their count).
DispatchedForward run_general(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                              const Tensor& token, const Tensor& expert, const Tensor& score,
                              DispatchContract contract, std::int64_t k, const Fp8Rows* xq = nullptr) {
  RoutingSpec spec;
  spec.mode = RoutingMode::general;
  spec.token = token;
  spec.expert = expert;
  spec.score = score;
  ForwardResult r = xq ? moe_forward_general_fp8(ctx, local_config(cfg), *xq, w, spec)
                       : moe_forward(ctx, local_config(cfg), x, w, spec);
  DispatchedForward f;
  f.contract = contract;
  f.rows = x.shape[0];
  f.k = k;
  f.output = std::move(r.output);
  f.saved = std::move(r.saved);
  return f;
}

// DeepEP: pairs on the host (cpu backend), every id checked.
void deepep_pairs_host(const char* fn, const std::int32_t* idx, const float* wts, std::int64_t N, std::int64_t K,
                       std::int64_t E, std::vector<std::int32_t>& tok, std::vector<std::int32_t>& exp,
                       std::vector<float>& sc, std::vector<std::int32_t>& slot) {
  for (std::int64_t s = 0; s < N * K; ++s) {
    const std::int32_t e = idx[s];
    SONICMOE_CHECK(e >= -1 && e < E, "sonicmoe::", fn, ": argument 'recv_topk_idx'[", s / K, ", ", s % K, "] = ", e,
                   " is out of range, expected -1 or [0, E_local) = [0, ", E, ")");
    if (e < 0) continue;
    tok.push_back(static_cast<std::int32_t>(s / K));
    exp.push_back(e);
    sc.push_back(wts[s]);
    slot.push_back(static_cast<std::int32_t>(s));
  }
}

void check_num_pairs(const char* fn, std::int64_t given, std::int64_t counted) {
  SONICMOE_CHECK(given < 0 || given == counted, "sonicmoe::", fn, ": argument 'opt.num_pairs' = ", given,
                 ", but recv_topk_idx has ", counted, " ids in [0, E_local)");
}

// DeepEP's routing (recv_topk_idx, recv_topk_weights) for N rows as general-routing pairs, in row order, with each
// pair's slot n*K + k; checked as moe_forward_deepep documents.
struct DeepepPairs {
  std::int64_t k = 0;
  Tensor token, expert, score, slot;
};
DeepepPairs deepep_pairs(const char* fn, const Context& ctx, std::int64_t N, std::int64_t E,
                         const TensorView& recv_topk_idx, const TensorView& recv_topk_weights,
                         const DispatchedOptions& opt) {
  Arg(fn, "recv_topk_idx", recv_topk_idx).given().dtype(DType::i32).ndim(2).on(ctx.device()).contiguous();
  DeepepPairs p;
  const std::int64_t K = p.k = recv_topk_idx.shape[1];
  Arg(fn, "recv_topk_idx", recv_topk_idx).shape({N, -1}, "[N, K]: N = recv_x's rows");
  Arg(fn, "recv_topk_weights", recv_topk_weights).given().dtype(DType::f32).shape({N, K}, "[N, K]: recv_topk_idx's")
      .on(ctx.device()).contiguous();
  SONICMOE_CHECK(N * K <= kMaxRows, "sonicmoe::", fn, ": N * K = ", N * K, " slots exceed the limit of ", kMaxRows,
                 " (int32 slot indices)");
  SONICMOE_CHECK(opt.num_pairs >= -1 && opt.num_pairs <= N * K, "sonicmoe::", fn, ": argument 'opt.num_pairs' = ",
                 opt.num_pairs, ", expected -1 (count them) or 0 <= num_pairs <= N * K = ", N * K);
  if (N == 0) return p;
  if (ctx.backend == Backend::cpu) {
    std::vector<std::int32_t> tok, exp, sl;
    std::vector<float> sc;
    deepep_pairs_host(fn, recv_topk_idx.ptr<const std::int32_t>(), recv_topk_weights.ptr<const float>(), N, K, E,
                      tok, exp, sc, sl);
    const std::int64_t P = static_cast<std::int64_t>(tok.size());
    check_num_pairs(fn, opt.num_pairs, P);
    p.token = hostcopy::upload(ctx, tok, {P}, DType::i32, ctx.device());
    p.expert = hostcopy::upload(ctx, exp, {P}, DType::i32, ctx.device());
    p.score = hostcopy::upload(ctx, sc, {P}, DType::f32, ctx.device());
    p.slot = hostcopy::upload(ctx, sl, {P}, DType::i32, ctx.device());
  } else {
#ifdef SONICMOE_WITH_CUDA
    if (opt.debug) {  // full scan on the host: the same checks as the cpu backend
      const auto idx = hostcopy::read<std::int32_t>(ctx, recv_topk_idx);
      const auto wts = hostcopy::read<float>(ctx, recv_topk_weights);
      std::vector<std::int32_t> tok, exp, sl;
      std::vector<float> sc;
      deepep_pairs_host(fn, idx.data(), wts.data(), N, K, E, tok, exp, sc, sl);
      check_num_pairs(fn, opt.num_pairs, static_cast<std::int64_t>(tok.size()));
    }
    Tensor slots_cap = alloc_on(ctx, {N * K}, DType::i32);
    Tensor count = alloc_on(ctx, {1}, DType::i32);
    cuda::deepep_select_slots(ctx, recv_topk_idx.ptr<const std::int32_t>(), N * K, E, slots_cap.ptr<std::int32_t>(),
                              count.ptr<std::int32_t>());
    const std::int64_t P = opt.num_pairs >= 0 ? opt.num_pairs : hostcopy::read<std::int32_t>(ctx, count)[0];
    p.token = alloc_on(ctx, {P}, DType::i32);
    p.expert = alloc_on(ctx, {P}, DType::i32);
    p.score = alloc_on(ctx, {P}, DType::f32);
    cuda::deepep_fill_pairs(ctx, recv_topk_idx.ptr<const std::int32_t>(), recv_topk_weights.ptr<const float>(),
                            slots_cap.ptr<const std::int32_t>(), count.ptr<const std::int32_t>(), P, K, N,
                            p.token.ptr<std::int32_t>(), p.expert.ptr<std::int32_t>(), p.score.ptr<float>());
    p.slot = slots_cap.carve(0, {P}, DType::i32);
#endif
  }
  return p;
}

// The DeepEP forward of x's rows over the pairs p (xq: the rows in FP8, x then only their count and dtype).
DispatchedForward deepep_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                                 DeepepPairs p, const Fp8Rows* xq = nullptr) {
  if (x.shape[0] == 0) {
    DispatchedForward f = empty_forward(ctx, cfg, DispatchContract::deepep, p.k, x.dtype);
    f.pair_slot = alloc_on(ctx, {0}, DType::i32);
    return f;
  }
  DispatchedForward f = run_general(ctx, cfg, x, w, p.token, p.expert, p.score, DispatchContract::deepep, p.k, xq);
  f.pair_slot = p.slot;
  return f;
}

}  // namespace

DispatchedForward moe_forward_deepep(const Context& ctx, const MoEConfig& cfg, const TensorView& recv_x,
                                     const TensorView& recv_topk_idx, const TensorView& recv_topk_weights,
                                     const MoEWeights& w, const DispatchedOptions& opt) {
  const char* fn = "moe_forward_deepep";
  const std::int64_t N = check_x(fn, "recv_x", ctx, cfg, recv_x), E = cfg.num_experts;
  return deepep_forward(ctx, cfg, recv_x, w, deepep_pairs(fn, ctx, N, E, recv_topk_idx, recv_topk_weights, opt));
}

DispatchedForward moe_forward_deepep_fp8(const Context& ctx, const MoEConfig& cfg, const Fp8Rows& recv_x,
                                         const TensorView& recv_topk_idx, const TensorView& recv_topk_weights,
                                         const MoEWeights& w, const DispatchedOptions& opt) {
  const char* fn = "moe_forward_deepep_fp8";
  check::backend(ctx, fn);
  SONICMOE_CHECK(cfg.precision == Precision::fp8_blockwise, "sonicmoe::", fn, ": MoEConfig::precision is ",
                 precision_name(cfg.precision), ", expected fp8_blockwise (the FP8 layer takes the dispatched codes)");
  Arg(fn, "recv_x.q", recv_x.q).given().dtype(DType::f8e4m3).shape({-1, cfg.hidden_size}, "[N, H]")
      .on(ctx.device()).contiguous();
  const std::int64_t N = recv_x.q.shape[0], E = cfg.num_experts;
  Arg(fn, "recv_x.scale", recv_x.scale).given().dtype(DType::f32)
      .shape({N, fp8_num_blocks(cfg.hidden_size)}, "[N, H / 128]").on(ctx.device()).contiguous();
  DeepepPairs p = deepep_pairs(fn, ctx, N, E, recv_topk_idx, recv_topk_weights, opt);
  Arg(fn, "w1", w.w1).given().float_dtype();
  // the rows' count and the layer's dtype (a view at the codes' address that nothing reads)
  const TensorView rows(recv_x.q.data, w.w1.dtype, {N, cfg.hidden_size}, ctx.device());
  return deepep_forward(ctx, cfg, rows, w, std::move(p), &recv_x);
}

DispatchedForward moe_forward_permuted(const Context& ctx, const MoEConfig& cfg, const TensorView& x_perm,
                                       const TensorView& tokens_per_expert, const TensorView& probs,
                                       const MoEWeights& w, const DispatchedOptions& opt) {
  const char* fn = "moe_forward_permuted";
  const std::int64_t N = check_x(fn, "x_perm", ctx, cfg, x_perm), E = cfg.num_experts;
  Arg atpe(fn, "tokens_per_expert", tokens_per_expert);
  atpe.given().dtype(DType::i32).ndim(1).contiguous();
  const bool is_offsets = tokens_per_expert.shape[0] == E + 1;
  SONICMOE_CHECK(tokens_per_expert.shape[0] == E || is_offsets, atpe.prefix(), " has shape ",
                 tokens_per_expert.shape_str(), ", expected [E_local] = [", E, "] (counts) or [E_local + 1] = [",
                 E + 1, "] (offsets)");
  SONICMOE_CHECK(!tokens_per_expert.device.is_cuda() || tokens_per_expert.device == ctx.device(), atpe.prefix(),
                 " is on ", device_name(tokens_per_expert.device), ", expected the host or ",
                 device_name(ctx.device()));
  Arg(fn, "probs", probs).given().dtype(DType::f32).shape({N}, "[N]: one per row of x_perm").on(ctx.device())
      .contiguous();
  // O(E) on host counts (always), and on device counts under debug (a host read).
  const bool on_host = !tokens_per_expert.device.is_cuda();
  if (on_host || opt.debug) {
    const auto c = hostcopy::read<std::int32_t>(ctx, tokens_per_expert);
    std::int64_t sum = 0;
    if (is_offsets) {
      SONICMOE_CHECK(c[0] == 0, atpe.prefix(), " (offsets) starts at ", c[0], ", expected 0");
      for (std::int64_t e = 0; e < E; ++e)
        SONICMOE_CHECK(c[e + 1] >= c[e], atpe.prefix(), " (offsets) decreases at ", e + 1, ": ", c[e + 1], " after ",
                       c[e]);
      sum = c[E];
    } else {
      for (std::int64_t e = 0; e < E; ++e) {
        SONICMOE_CHECK(c[e] >= 0, atpe.prefix(), "[", e, "] = ", c[e], " is negative");
        sum += c[e];
      }
    }
    SONICMOE_CHECK(sum == N, atpe.prefix(), is_offsets ? " (offsets) ends at " : " sums to ", sum,
                   ", expected N = ", N, " (the rows of x_perm)");
  }
  if (N == 0) return empty_forward(ctx, cfg, DispatchContract::permuted, 1, x_perm.dtype);
  Tensor token, expert;
  if (ctx.backend == Backend::cpu || on_host) {
    const auto c = hostcopy::read<std::int32_t>(ctx, tokens_per_expert);  // checked above
    std::vector<std::int32_t> tok(static_cast<std::size_t>(N)), exp(static_cast<std::size_t>(N));
    std::int64_t r = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t n = is_offsets ? c[e + 1] - c[e] : c[e];
      for (std::int64_t i = 0; i < n; ++i, ++r) exp[r] = static_cast<std::int32_t>(e);
    }
    for (std::int64_t i = 0; i < N; ++i) tok[i] = static_cast<std::int32_t>(i);
    token = hostcopy::upload(ctx, tok, {N}, DType::i32, ctx.device());
    expert = hostcopy::upload(ctx, exp, {N}, DType::i32, ctx.device());
  } else {
#ifdef SONICMOE_WITH_CUDA
    token = alloc_on(ctx, {N}, DType::i32);
    expert = alloc_on(ctx, {N}, DType::i32);
    cuda::permuted_pairs(ctx, tokens_per_expert.ptr<const std::int32_t>(), is_offsets, E, N,
                         token.ptr<std::int32_t>(), expert.ptr<std::int32_t>());
#endif
  }
  Tensor score = alloc_on(ctx, {N}, DType::f32);
  copy_async(score, probs, ctx.stream);
  return run_general(ctx, cfg, x_perm, w, token, expert, score, DispatchContract::permuted, 1);
}

namespace {

enum class DispatchedPart { all, activations, weights };

// moe_backward_dispatched, or one half of it (`keep`: dZ and A*s from part 1 to part 2).
DispatchedGradients backward_dispatched(const char* fn, const Context& ctx, const TensorView& x, const MoEWeights& w,
                                        const DispatchedForward& fwd, const TensorView& d_out, DispatchedPart part,
                                        WeightGradOperands* keep, bool dw2_in_part1) {
  check::backend(ctx, fn);
  SONICMOE_CHECK(x.given() && x.ndim == 2 && x.shape[0] == fwd.rows, "sonicmoe::", fn, ": argument 'x' has shape ",
                 x.shape_str(), ", expected [", fwd.rows, ", H] (the forward's rows)");
  Arg(fn, "d_out", d_out).given().dtype(x.dtype).shape({fwd.rows, x.shape[1]}, "[N, H]").on(ctx.device())
      .contiguous();
  SONICMOE_CHECK(fwd.contract == DispatchContract::deepep || fwd.contract == DispatchContract::permuted,
                 "sonicmoe::", fn, ": argument 'fwd' has contract = ", static_cast<int>(fwd.contract),
                 ", expected deepep (0) or permuted (1)");
  const bool deepep = fwd.contract == DispatchContract::deepep;
  SONICMOE_CHECK(deepep ? fwd.k >= 0 : fwd.k == 1, "sonicmoe::", fn, ": argument 'fwd' has k = ", fwd.k,
                 deepep ? ", expected K >= 0 (the forward's recv_topk_idx columns)" : ", expected 1 (permuted)");
  if (part != DispatchedPart::all)
    SONICMOE_CHECK(keep != nullptr, "sonicmoe::", fn, ": argument 'keep' is required");
  DispatchedGradients g;
  const std::vector<std::int64_t> dw_shape =
      deepep ? std::vector<std::int64_t>{fwd.rows, fwd.k} : std::vector<std::int64_t>{fwd.rows};
  if (no_rows(fwd)) {
    // No layer call checks the weights here: their shapes give the zero gradients, so check them as the layer does.
    const std::int64_t H = x.shape[1];
    Arg(fn, "w1", w.w1).given().dtype(x.dtype).shape({-1, -1, H}, "[E_local, z_width, H]").on(ctx.device())
        .contiguous();
    const std::int64_t E = w.w1.shape[0], ZW = w.w1.shape[1];
    Arg(fn, "w2", w.w2).given().dtype(x.dtype).shape({E, H, -1}, "[E_local, H, I]").on(ctx.device()).contiguous();
    const std::int64_t I = w.w2.shape[2];
    SONICMOE_CHECK(E >= 1 && I >= 1 && (ZW == I || ZW == 2 * I), "sonicmoe::", fn, ": arguments 'w1' ",
                   w.w1.shape_str(), " and 'w2' ", w.w2.shape_str(), " do not describe E_local >= 1 experts with ",
                   "z_width = I or 2I");
    if (w.b1.given()) Arg(fn, "b1", w.b1).dtype(x.dtype).shape({E, ZW}, "[E_local, z_width]").on(ctx.device());
    if (w.b2.given()) Arg(fn, "b2", w.b2).dtype(x.dtype).shape({E, H}, "[E_local, H]").on(ctx.device());
    check_router_main_grad(fn, ctx, E, H, w, false);
    check_expert_main_grads(fn, ctx, W1Layout::interleaved, E, ZW, H, I, w);  // (no rows: nothing is added to them)
    check_main_grads_disjoint(fn, w, {{"x", x}});
    if (part != DispatchedPart::weights) {
      g.dx = alloc_on(ctx, {0, H}, x.dtype);
      g.dweights = alloc_on(ctx, dw_shape, DType::f32);
    }
    if (part == DispatchedPart::activations) {  // empty dZ and A*s, with moe_backward_activations' convention
      keep->dz = alloc_on(ctx, {0, ZW}, x.dtype);
      keep->as = dw2_in_part1 ? Tensor() : alloc_on(ctx, {0, I}, x.dtype);
    } else {
      if (!w.w1_main_grad.given()) g.dw1 = alloc_zeros_on(ctx, {E, ZW, H}, x.dtype);
      if (w.b1.given()) g.db1 = alloc_zeros_on(ctx, {E, ZW}, x.dtype);
    }
    // dW2: in the whole backward, in part 1 with dw2_in_part1, else in part 2 (which runs it iff keep.as is given)
    if (part == DispatchedPart::all || (part == DispatchedPart::activations && dw2_in_part1) ||
        (part == DispatchedPart::weights && keep->as.defined())) {
      if (!w.w2_main_grad.given()) g.dw2 = alloc_zeros_on(ctx, {E, H, I}, x.dtype);
      if (w.b2.given()) g.db2 = alloc_zeros_on(ctx, {E, H}, x.dtype);
    }
    return g;
  }
  if (part == DispatchedPart::weights) {
    static_cast<ExpertWeightGradients&>(g) = moe_backward_weights(ctx, x, w, fwd.saved, d_out, *keep);
    return g;
  }
  Gradients lg = part == DispatchedPart::all
                     ? moe_backward(ctx, x, w, fwd.saved, d_out)
                     : moe_backward_activations(ctx, x, w, fwd.saved, d_out, *keep, {}, false, dw2_in_part1);
  g.dx = std::move(lg.dx);
  static_cast<ExpertWeightGradients&>(g) = std::move(static_cast<ExpertWeightGradients&>(lg));
  if (!deepep) {  // pair p is row p
    g.dweights = std::move(lg.dscore);
    return g;
  }
  g.dweights = alloc_zeros_on(ctx, dw_shape, DType::f32);
  const std::int64_t P = lg.dscore.numel();
  Arg(fn, "fwd.pair_slot", fwd.pair_slot.view()).given().dtype(DType::i32).shape({P}, "[P]: one per pair")
      .on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cpu)  // each pair's slot n*K + k in d(weights)
    Arg(fn, "fwd.pair_slot", fwd.pair_slot.view()).values_in(0, checked_mul(fwd.rows, fwd.k, "N*K"), "[0, N*K)");
  if (ctx.backend == Backend::cpu) {
    const std::int32_t* slot = fwd.pair_slot.ptr<const std::int32_t>();
    const float* ds = lg.dscore.ptr<const float>();
    float* dw = g.dweights.ptr<float>();
    for (std::int64_t p = 0; p < P; ++p) dw[slot[p]] = ds[p];
  } else {
#ifdef SONICMOE_WITH_CUDA
    cuda::scatter_slots(ctx, lg.dscore.ptr<const float>(), fwd.pair_slot.ptr<const std::int32_t>(), P,
                        g.dweights.ptr<float>());
#endif
  }
  return g;
}

}  // namespace

DispatchedGradients moe_backward_dispatched(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                            const DispatchedForward& fwd, const TensorView& d_out) {
  return backward_dispatched("moe_backward_dispatched", ctx, x, w, fwd, d_out, DispatchedPart::all, nullptr, false);
}

DispatchedGradients moe_backward_dispatched_fp8(const Context& ctx, const Fp8Rows& x, const MoEWeights& w,
                                                const DispatchedForward& fwd, const TensorView& d_out) {
  const char* fn = "moe_backward_dispatched_fp8";
  check::backend(ctx, fn);
  Arg(fn, "x.q", x.q).given().dtype(DType::f8e4m3).ndim(2).on(ctx.device()).contiguous();
  const std::int64_t N = x.q.shape[0], H = x.q.shape[1];
  Arg(fn, "x.scale", x.scale).given().dtype(DType::f32).shape({N, fp8_num_blocks(H)}, "[N, H / 128]")
      .on(ctx.device()).contiguous();
  Arg(fn, "w1", w.w1).given().float_dtype();
  SONICMOE_CHECK(fwd.saved.config.precision == Precision::fp8_blockwise || no_rows(fwd), "sonicmoe::", fn,
                 ": argument 'fwd' is not the state of moe_forward_deepep_fp8 (its precision is ",
                 precision_name(fwd.saved.config.precision), ")");
  // X for dW1, in the weights' dtype: the codes times their scales (the rows the forward's GEMMs read)
  Tensor xd = alloc_on(ctx, {N, H}, w.w1.dtype);
  fp8_dequantize_rows(ctx, x.q, x.scale, xd);
  return backward_dispatched(fn, ctx, xd.view(), w, fwd, d_out, DispatchedPart::all, nullptr, false);
}

DispatchedGradients moe_backward_dispatched_activations(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                                        const DispatchedForward& fwd, const TensorView& d_out,
                                                        WeightGradOperands& keep, bool dw2_in_part1) {
  return backward_dispatched("moe_backward_dispatched_activations", ctx, x, w, fwd, d_out,
                             DispatchedPart::activations, &keep, dw2_in_part1);
}

ExpertWeightGradients moe_backward_dispatched_weights(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                                      const DispatchedForward& fwd, const TensorView& d_out,
                                                      const WeightGradOperands& keep) {
  DispatchedGradients g = backward_dispatched("moe_backward_dispatched_weights", ctx, x, w, fwd, d_out,
                                              DispatchedPart::weights, const_cast<WeightGradOperands*>(&keep), false);
  return std::move(static_cast<ExpertWeightGradients&>(g));
}

}  // namespace sonicmoe

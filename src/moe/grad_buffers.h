// The weight-gradient buffers of the layer's backward (dW2 and db2, dW1 and db1; the biases' only with
// cfg.add_bias), each allocated by the step that writes it, on the context (src/core/context_alloc.h), so that the
// backends keep the fewest alive at once: dW1 [E, z_width, H] is made after dXe [N, H] has been summed into dX.
// A weight with a main_grad (MoEWeights::w1_main_grad / w2_main_grad) gets no buffer: its step adds into the
// main_grad (GradWrite::accumulate) and the result's dw1 / dw2 stay undefined.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/context_alloc.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

// A main_grad when given: f32 of its weight's shape, contiguous, on the context's device, 16-byte aligned on cuda.
inline void check_main_grad(const char* fn, const char* name, const TensorView& t, const Context& ctx,
                            std::initializer_list<std::int64_t> shape, const char* desc) {
  if (!t.given()) return;
  check::Arg a(fn, name, t);
  a.dtype(DType::f32).shape(shape, desc).on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cuda) a.aligned(16);
}

// MoEWeights::w1_main_grad / w2_main_grad (E experts: the layer's, or a dispatched entry's local ones; not under
// W1Layout::separate). Throws Error naming the argument.
inline void check_expert_main_grads(const char* fn, const Context& ctx, W1Layout w1_layout, std::int64_t E,
                                    std::int64_t ZW, std::int64_t H, std::int64_t I, const MoEWeights& w) {
  SONICMOE_CHECK(!w.w1_main_grad.given() || w1_layout != W1Layout::separate, "sonicmoe::", fn, ": argument "
                 "'w1_main_grad' is given but w1_layout is separate (a main_grad of W1 in the interleaved or "
                 "concatenated layout only)");
  check_main_grad(fn, "w1_main_grad", w.w1_main_grad, ctx, {E, ZW, H}, "[E, z_width, H] (w1's)");
  check_main_grad(fn, "w2_main_grad", w.w2_main_grad, ctx, {E, H, I}, "[E, H, I] (w2's)");
}

// MoEWeights::router_main_grad [E, H], only where the entry has a router (`router`).
inline void check_router_main_grad(const char* fn, const Context& ctx, std::int64_t E, std::int64_t H,
                                   const MoEWeights& w, bool router) {
  SONICMOE_CHECK(!w.router_main_grad.given() || router, "sonicmoe::", fn, ": argument 'router_main_grad' is given "
                 "but this entry has no router");
  check_main_grad(fn, "router_main_grad", w.router_main_grad, ctx, {E, H}, "[E, H] (the router's)");
}

// The bytes [lo, hi) a view can touch (its strides' extent), for the overlap checks below; {0, 0} when empty.
struct ByteSpan {
  std::uintptr_t lo = 0, hi = 0;
};
inline ByteSpan byte_span(const TensorView& t) {
  if (!t.given() || t.numel() == 0) return {};
  std::int64_t lo = 0, hi = 0;  // element offsets of the extreme elements
  for (int d = 0; d < t.ndim; ++d) {
    const std::int64_t reach = (t.shape[d] - 1) * t.stride[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  const auto es = static_cast<std::int64_t>(dtype_size(t.dtype));
  return {base + static_cast<std::uintptr_t>(lo * es), base + static_cast<std::uintptr_t>((hi + 1) * es)};
}

// A main_grad is written (read, added, stored) while the backward reads its inputs: one that shares memory with the
// weights, another main_grad or a named input (x, d_out) would change what the backward reads. Throws Error naming
// both.
inline void check_main_grads_disjoint(const char* fn, const MoEWeights& w,
                                      std::initializer_list<std::pair<const char*, TensorView>> inputs) {
  const std::pair<const char*, const TensorView*> grads[] = {
      {"w1_main_grad", &w.w1_main_grad}, {"w2_main_grad", &w.w2_main_grad}, {"router_main_grad", &w.router_main_grad}};
  std::vector<std::pair<const char*, TensorView>> others(inputs);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"router", &w.router}, {"w1", &w.w1},
                                {"b1", &w.b1}, {"w2", &w.w2}, {"b2", &w.b2}, {"w1_up", &w.w1_up}, {"b1_up", &w.b1_up}})
    others.emplace_back(name, *t);
  for (std::size_t i = 0; i < 3; ++i) {
    const TensorView& g = *grads[i].second;
    const ByteSpan gs = byte_span(g);
    if (gs.lo == gs.hi) continue;
    auto check = [&](const char* name, const TensorView& t) {
      if (!t.given() || !(t.device == g.device)) return;
      const ByteSpan ts = byte_span(t);
      SONICMOE_CHECK(ts.lo == ts.hi || ts.hi <= gs.lo || gs.hi <= ts.lo, "sonicmoe::", fn, ": argument '",
                     grads[i].first, "' (at ", g.data, ", ", gs.hi - gs.lo, " bytes) overlaps '", name, "' (at ",
                     t.data, ", ", ts.hi - ts.lo, " bytes): a main_grad must be a buffer of its own");
    };
    for (std::size_t j = i + 1; j < 3; ++j) check(grads[j].first, *grads[j].second);
    for (const auto& [name, t] : others) check(name, t);
  }
}

// Where a weight-gradient step writes dW: the tensor it hands the stage and how (sonicmoe/stages.h, dw_write).
struct DwTarget {
  TensorView view;
  GradWrite write = GradWrite::store;
};

// The router's gradient (step 11) [E, H]: its main_grad, or a buffer in g.
inline DwTarget alloc_drouter(const Context& ctx, std::int64_t E, std::int64_t H, DType dt, const MoEWeights& w,
                              Tensor& drouter) {
  if (w.router_main_grad.given()) return {w.router_main_grad, GradWrite::accumulate};
  drouter = alloc_on(ctx, {E, H}, dt);
  return {drouter, GradWrite::store};
}

inline DwTarget alloc_dw2(const Context& ctx, const MoEConfig& cfg, DType dt, const MoEWeights& w, Gradients& g) {
  if (cfg.add_bias) g.db2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size}, dt);
  if (w.w2_main_grad.given()) return {w.w2_main_grad, GradWrite::accumulate};
  g.dw2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size, cfg.intermediate_size}, dt);
  return {g.dw2, GradWrite::store};
}

// In the config's W1 layout: [E, z_width, H] / [E, z_width], or [2, E, I, H] / [2, E, I] under W1Layout::separate
// (part 0 the gate's gradient, part 1 the up's).
inline DwTarget alloc_dw1(const Context& ctx, const MoEConfig& cfg, DType dt, const MoEWeights& w, Gradients& g) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  const bool separate = cfg.effective_w1_layout() == W1Layout::separate;
  if (cfg.add_bias) g.db1 = separate ? alloc_on(ctx, {2, E, I}, dt) : alloc_on(ctx, {E, ZW}, dt);
  if (w.w1_main_grad.given()) return {w.w1_main_grad, GradWrite::accumulate};
  g.dw1 = separate ? alloc_on(ctx, {2, E, I, H}, dt) : alloc_on(ctx, {E, ZW, H}, dt);
  return {g.dw1, GradWrite::store};
}

}  // namespace sonicmoe

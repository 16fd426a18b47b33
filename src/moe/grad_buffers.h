// The weight-gradient buffers of the layer's backward (dW2 and db2, dW1 and db1; the biases' only with
// cfg.add_bias), each allocated by the step that writes it, on the context (src/core/context_alloc.h), so that the
// backends keep the fewest alive at once: dW1 [E, z_width, H] is made after dXe [N, H] has been summed into dX.
// A weight with a main_grad (MoEWeights::w1_main_grad / w2_main_grad) gets no buffer: its step adds into the
// main_grad (GradWrite::accumulate) and the result's dw1 / dw2 stay undefined.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "core/context_alloc.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

// MoEWeights::w1_main_grad / w2_main_grad when given: f32 of w1's / w2's shape (E experts: the layer's, or a
// dispatched entry's local ones), contiguous, on the context's device, 16-byte aligned on cuda; not under
// W1Layout::separate. router_main_grad: f32 [E, H] likewise, where the layer has a router (`router`). Throws Error
// naming the argument.
inline void check_main_grads(const char* fn, const Context& ctx, W1Layout w1_layout, std::int64_t E, std::int64_t ZW,
                             std::int64_t H, std::int64_t I, const MoEWeights& w, bool router) {
  const bool cuda = ctx.backend == Backend::cuda;
  if (w.router_main_grad.given()) {
    SONICMOE_CHECK(router, "sonicmoe::", fn, ": argument 'router_main_grad' is given but this entry has no router");
    check::Arg a(fn, "router_main_grad", w.router_main_grad);
    a.given().dtype(DType::f32).shape({E, H}, "[E, H] (the router's)").on(ctx.device()).contiguous();
    if (cuda) a.aligned(16);
  }
  if (w.w1_main_grad.given()) {
    SONICMOE_CHECK(w1_layout != W1Layout::separate, "sonicmoe::", fn, ": argument 'w1_main_grad' is given but "
                   "w1_layout is separate (a main_grad of W1 in the interleaved or concatenated layout only)");
    check::Arg a(fn, "w1_main_grad", w.w1_main_grad);
    a.given().dtype(DType::f32).shape({E, ZW, H}, "[E, z_width, H] (w1's)").on(ctx.device()).contiguous();
    if (cuda) a.aligned(16);
  }
  if (w.w2_main_grad.given()) {
    check::Arg a(fn, "w2_main_grad", w.w2_main_grad);
    a.given().dtype(DType::f32).shape({E, H, I}, "[E, H, I] (w2's)").on(ctx.device()).contiguous();
    if (cuda) a.aligned(16);
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

// The weight-gradient buffers of the layer's backward (dW2 and db2, dW1 and db1; the biases' only with
// cfg.add_bias), each allocated by the step that writes it, on the context (src/core/context_alloc.h), so that the
// backends keep the fewest alive at once: dW1 [E, z_width, H] is made after dXe [N, H] has been summed into dX.
#pragma once

#include "core/context_alloc.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

inline void alloc_dw2(const Context& ctx, const MoEConfig& cfg, DType dt, Gradients& g) {
  g.dw2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size, cfg.intermediate_size}, dt);
  if (cfg.add_bias) g.db2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size}, dt);
}

inline void alloc_dw1(const Context& ctx, const MoEConfig& cfg, DType dt, Gradients& g) {
  g.dw1 = alloc_on(ctx, {cfg.num_experts, cfg.z_width(), cfg.hidden_size}, dt);
  if (cfg.add_bias) g.db1 = alloc_on(ctx, {cfg.num_experts, cfg.z_width()}, dt);
}

}  // namespace sonicmoe

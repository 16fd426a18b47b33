// The weight-gradient buffers of the layer's backward (dW2 and db2, dW1 and db1; the biases' only with
// cfg.add_bias), each allocated by the step that writes it, on the context (src/core/context_alloc.h), so that the
// backends keep the fewest alive at once: dW1 [E, z_width, H] is made after dXe [N, H] has been summed into dX.
#pragma once

#include <cstdint>

#include "core/context_alloc.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

inline void alloc_dw2(const Context& ctx, const MoEConfig& cfg, DType dt, Gradients& g) {
  g.dw2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size, cfg.intermediate_size}, dt);
  if (cfg.add_bias) g.db2 = alloc_on(ctx, {cfg.num_experts, cfg.hidden_size}, dt);
}

// In the config's W1 layout: [E, z_width, H] / [E, z_width], or [2, E, I, H] / [2, E, I] under W1Layout::separate
// (part 0 the gate's gradient, part 1 the up's).
inline void alloc_dw1(const Context& ctx, const MoEConfig& cfg, DType dt, Gradients& g) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  const bool separate = cfg.effective_w1_layout() == W1Layout::separate;
  g.dw1 = separate ? alloc_on(ctx, {2, E, I, H}, dt) : alloc_on(ctx, {E, ZW, H}, dt);
  if (cfg.add_bias) g.db1 = separate ? alloc_on(ctx, {2, E, I}, dt) : alloc_on(ctx, {E, ZW}, dt);
}

}  // namespace sonicmoe

// The layer without its per-token sums (steps 6 and 10b), for a caller that sums the experts' rows itself: in parts,
// e.g. around an exchange (the binding's ExpertParallelMoE at EP = 2 sums the other rank's tokens first and sends
// them while it sums its own; DESIGN.md section 10). General routing and the 16-bit layer (MoEConfig::precision bf16)
// only; anything else is refused (Error).
#pragma once

#include "sonicmoe/moe.h"

namespace sonicmoe {

// moe_forward (general routing) whose `output` is Y [N, H]: the down-projection's rows before step 6, in the grouped
// GEMMs' row order. The layer's output is aggregate(ctx, Y, saved.routing.pair_score, saved.routing.meta, O)
// (stages.h), on every token or on a range of them (meta.token_offsets from the range's first token, O its rows).
ForwardResult moe_forward_expert_rows(const Context& ctx, const MoEConfig& cfg, const TensorView& x,
                                      const MoEWeights& w, const RoutingSpec& spec);

// The first half of the two-part backward of that forward's state (moe_backward_activations with dW2 in it,
// dw2_in_part1): steps 7, 8 and 10a, whose `dx` is dXe [N, H], the rows before step 10b (aggregate without scores
// gives dX). dZ goes to `keep` (written over the saved Z when dz_over_z: keep.dz is then that memory) for
// step 9, moe_backward_weights(ctx, x, w, saved, d_out, keep), which the caller runs once it has summed dXe: dXe and
// dW1 are never alive together, as in moe_backward.
Gradients moe_backward_expert_rows(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                   const SavedState& saved, const TensorView& d_out, WeightGradOperands& keep,
                                   bool dz_over_z = false);

}  // namespace sonicmoe

// The pipeline stage by stage (DESIGN.md sections 2-4). moe_forward / moe_backward are these calls in
// order; each stage runs on the context's backend, validates its arguments, and writes into
// caller-provided outputs, so every GPU stage can be tested alone against the CPU reference.
// Unless noted, float tensors are all of one dtype (bf16 or f32) and math accumulates in fp32.
// The stages are listed once in sonicmoe/detail/stage_list.h (the backends declare theirs from it); src/moe/stages.cpp
// checks every declaration below against that list at compile time.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

namespace sonicmoe {

// ---- Routing (steps 1-3, section 4) ----------------------------------------------------------

// Step 1: logits[T, E] (f32) = X[T, H] Wr[E, H]^T.
void router_logits(const Context& ctx, const TensorView& x, const TensorView& router_weight,
                   const TensorView& logits);

// Step 2: per token the K largest logits (ties: lower expert id first; order: descending logit),
// scores = softmax over those K (f32), and the per-expert histogram counts[E] (int32). A non-default `router`
// (RouterSpec in sonicmoe/moe.h) picks by its selection key (score + bias, inside the kept groups; order: descending
// key, ties lower id) and writes its combine weights as the scores.
void topk_softmax(const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts, const RouterSpec& router = {});

// Step 3: metadata from pairs (pair_token non-decreasing, in [0, T); pair_expert in [0, E)).
// Allocates the metadata tensors on the context's device.
RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts);

// Steps 2-3 of top-K routing in one call: topk_softmax (the histogram is the metadata's counts),
// pair_token[p] = p / k (pair_token: int32 [T*K]) and build_metadata. The cuda backend fuses them into three
// launches (the top-K kernel also writes pair_token, token_offsets and per-block expert counts).
// A capacity (router.capacity_factor > 0) drops, per expert, the pairs past its first C in pair order (see
// RoutingMetadata: rev = -1, demand, dropped); topk_softmax ignores it (it only selects).
RoutingMetadata topk_routing(const Context& ctx, const TensorView& logits, std::int64_t k,
                             const TensorView& topk_expert, const TensorView& topk_score,
                             const TensorView& pair_token, const RouterSpec& router = {});

// Section 4 token rounding: returns pair_* (N = sum of rounded counts, token order), pair_slot, metadata.
// Also fills topk_expert / topk_score (the router's own top-K, used by the router backward).
Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode);

// Switch aux loss E * sum_e (P_e / T) * (f_e / sum f), P_e = sum_t softmax(logits)[t, e], f = counts.
void aux_loss(const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out);

// ---- Forward expert computation (steps 4-6) ----------------------------------------------------

// The three stages that touch W1 (4, 9, 10a) take its row order (W1Layout, sonicmoe/types.h): w1 / b1 and dw1 / db1
// are in that order, Z and dZ always interleaved (gate_j in column 2j, up_j in 2j + 1). concatenated needs an even
// z_width (and a GLU activation in up_projection); the layer passes MoEConfig::effective_w1_layout().

// Step 4: Z[r] = X[gather[r]] W1[e(r)]^T (+ b1[e]),  A[r] = act(Z[r]).  Z [N, z_width], A [N, I].
void up_projection(const Context& ctx, Activation act, const TensorView& x, const TensorView& w1,
                   const TensorView& b1, const RoutingMetadata& meta, const TensorView& z, const TensorView& a,
                   W1Layout w1_layout = W1Layout::interleaved);

// Step 5: Y[r] = A[r] W2[e(r)]^T (+ b2[e]).  Y [N, H].
void down_projection(const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y);

// Step 6: O[t] = sum over pairs p of t of score[p] * Y[rev[p]]   (score not given: unweighted sum,
// which is also the dX gather-sum of step 10).  O [T, H].
void aggregate(const Context& ctx, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,
               const TensorView& out);

// ---- Backward (steps 7-11) ---------------------------------------------------------------------

// Step 7 "dgated": G[r] = dO[gather[r]] W2[e]; A = act(Z[r]) recomputed;
//   dscore[pair[r]] = <G[r], A[r]> (+ <dO[t], b2[e]> when b2 is given)      (f32 [N], indexed by pair)
//   dZ[r] = act'(Z[r]) applied to s[r] * G[r]                                 ([N, z_width])
//   As[r] = s[r] * A[r]                                                       ([N, I])
void dgated(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
            const TensorView& b2, const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta,
            const TensorView& dz, const TensorView& as, const TensorView& dscore);

// Step 8: dW2[e] = sum_{r in e} dO[gather[r]]^T As[r]  ([E, H, I]);  db2[e] = sum_{r in e} s[r] dO[gather[r]].
// dw_write accumulate: dw2 is f32 and receives dw2 += dW2 (GradWrite, sonicmoe/types.h); db2 is written as ever.
void weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2,
                    GradWrite dw_write = GradWrite::store);

// Steps 7 and 8 together: the same results as dgated() then weight_grad_w2(), which it runs back to back on the
// context's backend (on the cuda backend each GEMM gathers the rows dO[gather[r]] in its own mainloop). Not in the
// stage list: composed in src/moe/stages.cpp from the two listed stages.
void dgated_and_weight_grad_w2(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                               const TensorView& b2, const TensorView& z, const TensorView& pair_score,
                               const RoutingMetadata& meta, const TensorView& dz, const TensorView& as,
                               const TensorView& dscore, const TensorView& dw2, const TensorView& db2,
                               GradWrite dw_write = GradWrite::store);

// Step 9: dW1[e] = sum_{r in e} dZ[r]^T X[gather[r]]  ([E, z_width, H]);  db1[e] = sum_{r in e} dZ[r].
// dw_write accumulate: dw1 is f32 and receives dw1 += dW1 (interleaved or concatenated W1 layout, not separate).
void weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1, W1Layout w1_layout = W1Layout::interleaved,
                    GradWrite dw_write = GradWrite::store);

// Step 10a: dXe[r] = dZ[r] W1[e(r)]  ([N, H]). Step 10b is aggregate() without scores.
void expert_input_grad(const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe, W1Layout w1_layout = W1Layout::interleaved);

// Step 11a: d(logits) [T, E] (f32) from dscore[N] through the K-way softmax of each token's top-K
// (pairs with slot >= 0) and through the full softmax (pairs with slot -1, token rounding), plus the
// aux loss term scaled by d_aux_loss (a host value or a device scalar, see AuxLossGrad). Under a non-default
// routing.router the slots' gradients go through that router's weights and scores instead (no gradient to the bias).
void router_backward(const Context& ctx, const Routing& routing, const TensorView& dscore,
                     const AuxLossGrad& d_aux_loss, const TensorView& dlogits);

// Step 11b: dWr = dlogits^T X  ([E, H]),  dX += dlogits Wr  (dx is read and updated).
// dw_write accumulate: drouter is f32 and receives drouter += dWr (GradWrite, sonicmoe/types.h).
void router_weight_grad(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx,
                        GradWrite dw_write = GradWrite::store);

}  // namespace sonicmoe

// The pipeline's stages, listed once: X(return type, name, (parameters)) for every stage that each backend
// implements. The backend headers (src/cuda/cuda_backend.h, src/reference/reference.h) declare their functions from
// this list, and src/moe/stages.cpp checks the documented declarations of include/sonicmoe/stages.h against it.
// Adding a stage: one line here, its doc comment and declaration in stages.h, its validation + dispatch in
// stages.cpp, and one implementation per backend. Meaning of each stage: include/sonicmoe/stages.h.
// dgated_and_weight_grad_w2 (steps 7 and 8 in one call) is not in the list: src/moe/stages.cpp composes it from the
// two backend stages.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"

// Names are unqualified: the list expands inside namespace sonicmoe or one of its backends.
#define SONICMOE_STAGE_LIST(X)                                                                                      \
  /* routing (steps 1-3, section 4) */                                                                              \
  X(void, router_logits,                                                                                            \
    (const Context& ctx, const TensorView& x, const TensorView& router_weight, const TensorView& logits))          \
  X(void, topk_softmax,                                                                                             \
    (const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,                   \
     const TensorView& topk_score, const TensorView& counts, const RouterSpec& router))                             \
  X(RoutingMetadata, build_metadata,                                                                                \
    (const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert, std::int64_t num_tokens,      \
     std::int64_t num_experts))                                                                                     \
  X(RoutingMetadata, topk_routing,                                                                                  \
    (const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,                   \
     const TensorView& topk_score, const TensorView& pair_token, const RouterSpec& router))                         \
  X(Routing, token_rounding,                                                                                        \
    (const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile, RoutingMode mode))            \
  X(void, aux_loss, (const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out)) \
  /* forward expert computation (steps 4-6) */                                                                      \
  X(void, up_projection,                                                                                            \
    (const Context& ctx, Activation act, const TensorView& x, const TensorView& w1, const TensorView& b1,           \
     const RoutingMetadata& meta, const TensorView& z, const TensorView& a, W1Layout w1_layout))                    \
  X(void, down_projection,                                                                                          \
    (const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,                           \
     const RoutingMetadata& meta, const TensorView& y))                                                             \
  X(void, aggregate,                                                                                                \
    (const Context& ctx, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,            \
     const TensorView& out))                                                                                        \
  /* backward (steps 7-11) */                                                                                       \
  X(void, dgated,                                                                                                   \
    (const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2, const TensorView& b2,       \
     const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,          \
     const TensorView& as, const TensorView& dscore))                                                               \
  X(void, weight_grad_w2,                                                                                           \
    (const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,               \
     const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2, GradWrite dw_write))                \
  X(void, weight_grad_w1,                                                                                           \
    (const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,                    \
     const TensorView& dw1, const TensorView& db1, W1Layout w1_layout, GradWrite dw_write))                         \
  X(void, expert_input_grad,                                                                                        \
    (const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,                   \
     const TensorView& dxe, W1Layout w1_layout))                                                                    \
  X(void, router_backward,                                                                                          \
    (const Context& ctx, const Routing& routing, const TensorView& dscore, const AuxLossGrad& d_aux_loss,           \
     const TensorView& dlogits))                                                                                    \
  X(void, router_weight_grad,                                                                                       \
    (const Context& ctx, const TensorView& dlogits, const TensorView& x, const TensorView& router_weight,           \
     const TensorView& drouter, const TensorView& dx, GradWrite dw_write))

// Declares one stage function (the backends' headers expand the list with it).
#define SONICMOE_DECLARE_STAGE(ret, name, params) ret name params;

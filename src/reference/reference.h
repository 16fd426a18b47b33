// The CPU reference backend: one function per pipeline stage, same meaning and arguments as the public
// stages in include/sonicmoe/stages.h. Arguments arrive validated (src/moe/stages.cpp). fp32 accumulation,
// outputs rounded to their storage dtype exactly where the GPU path rounds; OpenMP across rows/experts.
#pragma once

#include "sonicmoe/stages.h"

namespace sonicmoe::ref {

void router_logits(const Context& ctx, const TensorView& x, const TensorView& router_weight,
                   const TensorView& logits);
void topk_softmax(const Context& ctx, const TensorView& logits, std::int64_t k, const TensorView& topk_expert,
                  const TensorView& topk_score, const TensorView& counts);
RoutingMetadata build_metadata(const Context& ctx, const TensorView& pair_token, const TensorView& pair_expert,
                               std::int64_t num_tokens, std::int64_t num_experts);
Routing token_rounding(const Context& ctx, const TensorView& logits, std::int64_t k, std::int64_t tile,
                       RoutingMode mode);
// pair_token[p] = p / k for the N = T*K pairs of top-K routing.
void topk_pair_token(const Context& ctx, std::int64_t k, const TensorView& pair_token);
RoutingMetadata topk_routing(const Context& ctx, const TensorView& logits, std::int64_t k,
                             const TensorView& topk_expert, const TensorView& topk_score,
                             const TensorView& pair_token);
void aux_loss(const Context& ctx, const TensorView& logits, const TensorView& counts, const TensorView& out);

void up_projection(const Context& ctx, Activation act, const TensorView& x, const TensorView& w1,
                   const TensorView& b1, const RoutingMetadata& meta, const TensorView& z, const TensorView& a);
void down_projection(const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y);
void aggregate(const Context& ctx, const TensorView& y, const TensorView& pair_score, const RoutingMetadata& meta,
               const TensorView& out);

void dgated(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
            const TensorView& b2, const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta,
            const TensorView& dz, const TensorView& as, const TensorView& dscore);
void weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2);
void weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1);
void expert_input_grad(const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe);
void router_backward(const Context& ctx, const Routing& routing, const TensorView& dscore,
                     const AuxLossGrad& d_aux_loss, const TensorView& dlogits);
void router_weight_grad(const Context& ctx, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx);

}  // namespace sonicmoe::ref

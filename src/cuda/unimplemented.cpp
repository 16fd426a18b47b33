// Stages whose CUDA kernels are not written yet: they fail loudly rather than compute something else.
// Each entry leaves this file when its kernel lands.
#include "cuda/cuda_backend.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {

namespace {
[[noreturn]] void missing(const char* stage) {
  throw Error(std::string("sonicmoe::") + stage +
              ": the cuda backend has no kernel for this stage yet; use Backend::cpu");
}
}  // namespace

void router_logits(const Context&, const TensorView&, const TensorView&, const TensorView&) {
  missing("router_logits");
}
void topk_softmax(const Context&, const TensorView&, std::int64_t, const TensorView&, const TensorView&,
                  const TensorView&) {
  missing("topk_softmax");
}
RoutingMetadata build_metadata(const Context&, const TensorView&, const TensorView&, std::int64_t, std::int64_t) {
  missing("build_metadata");
}
Routing token_rounding(const Context&, const TensorView&, std::int64_t, std::int64_t, RoutingMode) {
  missing("token_rounding");
}
void topk_pair_token(const Context&, std::int64_t, const TensorView&) { missing("topk_pair_token"); }
void aux_loss(const Context&, const TensorView&, const TensorView&, const TensorView&) { missing("aux_loss"); }
void up_projection(const Context&, Activation, const TensorView&, const TensorView&, const TensorView&,
                   const RoutingMetadata&, const TensorView&, const TensorView&) {
  missing("up_projection");
}
void down_projection(const Context&, const TensorView&, const TensorView&, const TensorView&,
                     const RoutingMetadata&, const TensorView&) {
  missing("down_projection");
}
void aggregate(const Context&, const TensorView&, const TensorView&, const RoutingMetadata&, const TensorView&) {
  missing("aggregate");
}
void dgated(const Context&, Activation, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
            const TensorView&, const RoutingMetadata&, const TensorView&, const TensorView&, const TensorView&) {
  missing("dgated");
}
void weight_grad_w2(const Context&, const TensorView&, const TensorView&, const TensorView&, const RoutingMetadata&,
                    const TensorView&, const TensorView&) {
  missing("weight_grad_w2");
}
void weight_grad_w1(const Context&, const TensorView&, const TensorView&, const RoutingMetadata&, const TensorView&,
                    const TensorView&) {
  missing("weight_grad_w1");
}
void expert_input_grad(const Context&, const TensorView&, const TensorView&, const RoutingMetadata&,
                       const TensorView&) {
  missing("expert_input_grad");
}
void router_backward(const Context&, const Routing&, const TensorView&, float, const TensorView&) {
  missing("router_backward");
}
void router_weight_grad(const Context&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        const TensorView&) {
  missing("router_weight_grad");
}

}  // namespace sonicmoe::cuda

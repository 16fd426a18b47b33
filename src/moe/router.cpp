// Validation of a RouterSpec (src/moe/router.h).
#include "moe/router.h"

#include <cmath>

#include "core/check.h"
#include "sonicmoe/error.h"

namespace sonicmoe {

std::int64_t RouterSpec::expert_capacity(std::int64_t T, std::int64_t K, std::int64_t E) const {
  SONICMOE_CHECK(T >= 0 && K >= 1 && E >= 1, "sonicmoe::RouterSpec::expert_capacity: T = ", T, ", K = ", K,
                 ", E = ", E, ", expected T >= 0, K >= 1, E >= 1");
  SONICMOE_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 0.0, "sonicmoe::RouterSpec::expert_capacity: "
                 "capacity_factor = ", capacity_factor, ", expected a finite value >= 0");
  // In double throughout: T * K may not fit int64, and the result is capped at T before it is converted back.
  const double c = std::ceil(static_cast<double>(T) * static_cast<double>(K) / static_cast<double>(E) * capacity_factor);
  return c >= static_cast<double>(T) ? T : static_cast<std::int64_t>(c);
}

void check_router(const char* fn, const Context& ctx, const RouterSpec& r, std::int64_t E, std::int64_t K) {
  const int sf = static_cast<int>(r.score_function);
  SONICMOE_CHECK(sf == 0 || sf == 1, "sonicmoe::", fn, ": router.score_function = ", sf,
                 ", expected softmax (0) or sigmoid (1)");
  SONICMOE_CHECK(std::isfinite(r.routed_scaling_factor) && r.routed_scaling_factor > 0.0f, "sonicmoe::", fn,
                 ": router.routed_scaling_factor = ", r.routed_scaling_factor, ", expected a finite value > 0");
  SONICMOE_CHECK(r.n_group >= 1, "sonicmoe::", fn, ": router.n_group = ", r.n_group, ", expected >= 1");
  SONICMOE_CHECK(E % r.n_group == 0, "sonicmoe::", fn, ": router.n_group = ", r.n_group,
                 " must divide the number of experts E = ", E);
  SONICMOE_CHECK(r.topk_group >= 1 && r.topk_group <= r.n_group, "sonicmoe::", fn, ": router.topk_group = ",
                 r.topk_group, ", expected 1 <= topk_group <= n_group = ", r.n_group);
  const bool selects_by_score = router_score_of(r) != RouterScore::topk_softmax;
  if (r.n_group > 1) {
    SONICMOE_CHECK(selects_by_score, "sonicmoe::", fn, ": router.n_group = ", r.n_group,
                   " (group-limited selection) needs score_function sigmoid, or softmax with softmax_over_topk = "
                   "false (groups are ranked by their scores, not by logits)");
    SONICMOE_CHECK(E / r.n_group >= 2, "sonicmoe::", fn, ": router.n_group = ", r.n_group, " leaves groups of ",
                   E / r.n_group, " expert(s) for E = ", E, "; a group is ranked by its two best scores (>= 2)");
    const std::int64_t pickable = r.topk_group * (E / r.n_group);
    SONICMOE_CHECK(K <= pickable, "sonicmoe::", fn, ": top_k = ", K, " exceeds the ", pickable,
                   " experts of the kept groups (router.topk_group * E / router.n_group = ", r.topk_group, " * ", E,
                   " / ", r.n_group, ")");
  }
  SONICMOE_CHECK(std::isfinite(r.capacity_factor) && r.capacity_factor >= 0.0, "sonicmoe::", fn,
                 ": router.capacity_factor = ", r.capacity_factor, ", expected a finite value >= 0 (0: no capacity)");
  if (r.e_score_correction_bias.given()) {
    SONICMOE_CHECK(selects_by_score, "sonicmoe::", fn,
                   ": router.e_score_correction_bias needs score_function sigmoid, or softmax with "
                   "softmax_over_topk = false (the bias is added to the scores, not to logits)");
    check::Arg a(fn, "router.e_score_correction_bias", r.e_score_correction_bias);
    a.given().dtype(DType::f32).shape({E}, "[E]").on(ctx.device()).contiguous();
    if (!ctx.device().is_cuda()) {  // the logits are checked finite; a NaN bias would steer the selection silently
      const float* b = r.e_score_correction_bias.ptr<const float>();
      for (std::int64_t e = 0; e < E; ++e)
        SONICMOE_ARG_CHECK(a, std::isfinite(b[e]), "[", e, "] = ", b[e], " is not finite");
    }
  }
}

}  // namespace sonicmoe

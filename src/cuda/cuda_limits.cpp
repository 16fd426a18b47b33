// The cuda backend's size check (cuda_limits.h).
#include "cuda/cuda_limits.h"

#include "core/check.h"

namespace sonicmoe::cuda {
namespace {

void at_most(const char* fn, const char* name, std::int64_t v, std::int64_t limit) {
  SONICMOE_CHECK(v <= limit, "sonicmoe::", fn, ": ", name, " = ", v, " exceeds the cuda backend's limit of ", limit,
                 " (src/cuda/cuda_limits.h)");
}

}  // namespace

void check_limits(const char* fn, const StageSizes& s) {
  if (s.experts >= 0) at_most(fn, "num_experts E", s.experts, s.gemm ? kGemmMaxExperts : kMaxExperts);
  if (s.top_k >= 0) at_most(fn, "top_k", s.top_k, kMaxTopK);
  if (s.router_groups >= 0) at_most(fn, "router.n_group", s.router_groups, kMaxRouterGroups);
  if (s.tokens >= 0) at_most(fn, "tokens T", s.tokens, kMaxRows - 1);
  if (s.pairs >= 0) at_most(fn, "pairs N", s.pairs, kMaxRows - 1);
  if (s.rounding_tile >= 0) {
    at_most(fn, "tile", s.rounding_tile, kMaxRoundingTile - 1);
    if (s.tokens >= 0 && s.experts > 0) at_most(fn, "T * E", s.tokens * s.experts, kMaxRoundingCells - 1);
  }
  for (int i = 0; i < 3; ++i) {
    if (s.width[i] < 0) continue;
    at_most(fn, s.width_name[i], s.width[i], kMaxWidth);
    SONICMOE_CHECK(s.width[i] % kWidthMultiple == 0, "sonicmoe::", fn, ": ", s.width_name[i], " = ", s.width[i],
                   ", the cuda backend needs a multiple of ", kWidthMultiple,
                   " (16-byte rows for TMA; src/cuda/cuda_limits.h)");
  }
}

}  // namespace sonicmoe::cuda

// Reference router variants (src/reference/router_ref.h; DESIGN.md section 4 "Routers").
#include "reference/router_ref.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/router_math.h"
#include "moe/router.h"
#include "reference/softmax.h"

namespace sonicmoe::ref {

namespace {

// key[e] = -inf for every expert outside the topk_group best groups (group rank key: the sum of its two best keys;
// ties to the lower group id).
void mask_groups(float* key, std::int64_t E, std::int64_t n_group, std::int64_t topk_group) {
  const std::int64_t gs = E / n_group;
  std::vector<float> gscore(n_group);
  for (std::int64_t g = 0; g < n_group; ++g) {
    Top2 t{-INFINITY, -INFINITY};
    for (std::int64_t e = g * gs; e < (g + 1) * gs; ++e) t.add(key[e]);
    gscore[g] = t.sum();
  }
  for (std::int64_t g = 0; g < n_group; ++g) {
    std::int64_t rank = 0;
    for (std::int64_t h = 0; h < n_group; ++h) rank += gscore[h] > gscore[g] || (gscore[h] == gscore[g] && h < g);
    if (rank >= topk_group) std::fill(key + g * gs, key + (g + 1) * gs, -INFINITY);
  }
}

}  // namespace

void router_select_row(const float* row, std::int64_t E, std::int64_t k, const RouterSpec& r, const float* bias,
                       std::int32_t* ids, float* weights, float* scratch) {
  const RouterScore kind = router_score_of(r);
  const float c = r.routed_scaling_factor;
  if (kind == RouterScore::topk_softmax) {  // selection by logit, softmax over the K picks
    select_topk(row, E, k, ids, weights);
    for (std::int64_t j = 0; j < k; ++j) weights[j] *= c;
    return;
  }
  float* s = scratch;
  float* key = scratch + E;
  if (kind == RouterScore::sigmoid) {
    for (std::int64_t e = 0; e < E; ++e) s[e] = sigmoid_f32(row[e]);
  } else {
    softmax_row(row, E, s);
  }
  for (std::int64_t e = 0; e < E; ++e) key[e] = s[e] + (bias ? bias[e] : 0.0f);
  if (r.n_group > 1) mask_groups(key, E, r.n_group, r.topk_group);
  std::vector<std::int32_t> idx(E);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [key](std::int32_t a, std::int32_t b) {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
  });
  float sum = 0.0f;
  for (std::int64_t j = 0; j < k; ++j) {
    ids[j] = idx[j];
    weights[j] = s[idx[j]];
    sum += weights[j];
  }
  if (r.norm_topk_probs) {
    if (kind == RouterScore::sigmoid) sum += kSigmoidNormEps;
    for (std::int64_t j = 0; j < k; ++j) weights[j] /= sum;
  }
  for (std::int64_t j = 0; j < k; ++j) weights[j] *= c;
}

}  // namespace sonicmoe::ref

// Reference router backward (step 11): score gradients back to the logits, then to Wr and X.
#include <vector>

#include "reference/matrix.h"
#include "reference/reference.h"
#include "reference/softmax.h"

namespace sonicmoe::ref {

void router_backward(const Context&, const Routing& routing, const TensorView& dscore,
                     const AuxLossGrad& d_aux_grad, const TensorView& dlogits) {
  const float d_aux_loss = d_aux_grad.tensor.given() ? d_aux_grad.tensor.ptr<const float>()[0] : d_aux_grad.value;
  const std::int64_t T = routing.logits.size(0), E = routing.logits.size(1), K = routing.top_k;
  const float* L = routing.logits.ptr<const float>();
  const std::int32_t* toff = routing.meta.token_offsets.ptr<const std::int32_t>();
  const std::int32_t* pexp = routing.pair_expert.ptr<const std::int32_t>();
  const std::int32_t* slot = routing.pair_slot.defined() ? routing.pair_slot.ptr<const std::int32_t>() : nullptr;
  const std::int32_t* tids = routing.topk_expert.ptr<const std::int32_t>();
  const float* tsc = routing.topk_score.ptr<const float>();
  const float* ds = dscore.ptr<const float>();
  float* dl = dlogits.ptr<float>();

  // Aux loss E * sum_e (P_e/T)(f_e/F): d/dq[t,e] = d_aux * E * f_e / (T F), the same for every token.
  std::vector<float> daux_q(E, 0.0f);
  if (d_aux_loss != 0.0f) {
    const std::int32_t* c = routing.meta.counts.ptr<const std::int32_t>();
    double F = 0;
    for (std::int64_t e = 0; e < E; ++e) F += c[e];
    if (F > 0)
      for (std::int64_t e = 0; e < E; ++e)
        daux_q[e] = static_cast<float>(d_aux_loss * static_cast<double>(E) * c[e] / (static_cast<double>(T) * F));
  }

#pragma omp parallel
  {
    std::vector<float> dk(K), q(E), dq(E);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) {
      float* drow = dl + t * E;
      std::fill(drow, drow + E, 0.0f);
      std::fill(dk.begin(), dk.end(), 0.0f);
      dq = daux_q;
      bool any_full = d_aux_loss != 0.0f;
      for (std::int64_t p = toff[t]; p < toff[t + 1]; ++p) {
        const std::int64_t k = slot ? slot[p] : p - toff[t];  // top-K: pairs of a token are its K slots
        if (k >= 0) {
          dk[k] += ds[p];
        } else {
          dq[pexp[p]] += ds[p];
          any_full = true;
        }
      }
      // K-way softmax: dl_{e_k} = s_k (ds_k - sum_j s_j ds_j).
      const float* s = tsc + t * K;
      float dot = 0.0f;
      for (std::int64_t k = 0; k < K; ++k) dot += s[k] * dk[k];
      for (std::int64_t k = 0; k < K; ++k) drow[tids[t * K + k]] += s[k] * (dk[k] - dot);
      // Full softmax over E: dl_j = q_j (dq_j - sum_i q_i dq_i).
      if (any_full) {
        softmax_row(L + t * E, E, q.data());
        float qd = 0.0f;
        for (std::int64_t e = 0; e < E; ++e) qd += q[e] * dq[e];
        for (std::int64_t e = 0; e < E; ++e) drow[e] += q[e] * (dq[e] - qd);
      }
    }
  }
}

void router_weight_grad(const Context&, const TensorView& dlogits, const TensorView& x,
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx) {
  const std::int64_t T = x.shape[0];
  Eigen::Map<const MatF> dL(dlogits.ptr<const float>(), dlogits.shape[0], dlogits.shape[1]);
  const MatF X = load_rows(x, 0, T);
  store_rows(drouter, 0, MatF(dL.transpose() * X));
  MatF dX = load_rows(dx, 0, T);
  dX.noalias() += dL * load_slice(router_weight, 0);
  store_rows(dx, 0, dX);
}

}  // namespace sonicmoe::ref

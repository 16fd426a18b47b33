// Reference router backward (step 11): score gradients back to the logits, then to Wr and X.
#include <vector>

#include "core/router_math.h"
#include "moe/router.h"
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
  const RouterScore kind = router_score_of(routing.router);
  const float scale = routing.router.routed_scaling_factor;
  const bool norm = routing.router.norm_topk_probs;

  // Aux loss E * sum_e (P_e/T)(f_e/F): d/dq[t,e] = d_aux * E * f_e / (T F), the same for every token.
  std::vector<float> daux_q(E, 0.0f);
  if (d_aux_loss != 0.0f) {
    const Tensor& f = routing.meta.demand.defined() ? routing.meta.demand : routing.meta.counts;  // before capacity
    const std::int32_t* c = f.ptr<const std::int32_t>();
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
      const std::int32_t* ids = tids + t * K;
      const float* s = tsc + t * K;
      if (kind == RouterScore::sigmoid) {
        // w_k = c u_k / S (S = sum u + eps, norm) or c u_k; u = sigmoid(l): dl = du u (1 - u).
        float S = 0.0f, dot = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) S += sigmoid_f32(L[t * E + ids[k]]);
        S += kSigmoidNormEps;
        for (std::int64_t k = 0; k < K; ++k) dot += dk[k] * sigmoid_f32(L[t * E + ids[k]]);
        for (std::int64_t k = 0; k < K; ++k) {
          const float u = sigmoid_f32(L[t * E + ids[k]]);
          const float du = norm ? (scale / S) * (dk[k] - dot / S) : scale * dk[k];
          drow[ids[k]] += du * u * (1.0f - u);
        }
      } else if (kind == RouterScore::full_softmax && !norm) {
        for (std::int64_t k = 0; k < K; ++k) dq[ids[k]] += scale * dk[k];  // w_k = c q_{e_k}: through the full softmax
        any_full = true;
      } else {
        // K-way softmax (softmax over the K picks, or the renormalised full softmax, which equals it):
        // p_k = w_k / c, dl_{e_k} = p_k (c ds_k - sum_j p_j c ds_j).
        float dot = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) dot += (s[k] / scale) * (scale * dk[k]);
        for (std::int64_t k = 0; k < K; ++k) drow[ids[k]] += (s[k] / scale) * (scale * dk[k] - dot);
      }
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
                        const TensorView& router_weight, const TensorView& drouter, const TensorView& dx,
                        GradWrite dw_write) {
  const std::int64_t T = x.shape[0];
  Eigen::Map<const MatF> dL(dlogits.ptr<const float>(), dlogits.shape[0], dlogits.shape[1]);
  const MatF X = load_rows(x, 0, T);
  if (dw_write == GradWrite::accumulate) add_rows_f32(drouter, 0, MatF(dL.transpose() * X));
  else store_rows(drouter, 0, MatF(dL.transpose() * X));
  MatF dX = load_rows(dx, 0, T);
  dX.noalias() += dL * load_slice(router_weight, 0);
  store_rows(dx, 0, dX);
}

}  // namespace sonicmoe::ref

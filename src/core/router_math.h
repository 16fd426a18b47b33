// Scalar pieces of the router variants (RouterSpec, DESIGN.md section 4) shared bit for bit by the CPU reference
// and the GPU top-K kernel.
#pragma once

#include "core/exp_f32.h"

namespace sonicmoe {

// sigmoid(x) = 1 / (1 + exp(-x)) with the library's exp_f32: the same bits on the host and the GPU (IEEE division).
SONICMOE_HD inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// Added to the sum of the K sigmoid scores before normalising them (Hugging Face DeepSeek-V3's denominator).
constexpr float kSigmoidNormEps = 1e-20f;

// How the kernels and the reference compute a router's scores and weights (from RouterSpec, validated).
enum class RouterScore : int {
  topk_softmax = 0,  // the default: softmax over the K selected logits, selection by logit
  full_softmax = 1,  // s = softmax over all E; selection by s (+ bias)
  sigmoid = 2,       // s = sigmoid(logit); selection by s (+ bias)
};

// Top-2 of a group's selection keys folded one key at a time (top1 >= top2); the group's rank key is top1 + top2.
struct Top2 {
  float top1, top2;
  SONICMOE_HD void add(float v) {
    if (v > top1) {
      top2 = top1;
      top1 = v;
    } else if (v > top2) {
      top2 = v;
    }
  }
  SONICMOE_HD float sum() const { return top1 + top2; }
};

}  // namespace sonicmoe

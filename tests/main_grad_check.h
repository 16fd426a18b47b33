// The fp32 main_grad contract of the layer's backward (MoEWeights::w1_main_grad / w2_main_grad / router_main_grad,
// GradWrite::accumulate)
// on any backend, shared by the CPU suite (test_main_grad.cpp) and the GPU one (cuda/test_layer.cpp):
//   1. into zeros: every other gradient bitwise as without main_grads, dw1 / dw2 (/ drouter) undefined, and each
//      main_grad rounded to the layer's dtype bitwise equal to the gradient the plain backward returns (the same
//      fp32 sums, once stored rounded, once added unrounded);
//   2. into random fp32 values M: exactly M + (1.) element by element (one fp32 add, the backend's only rounding);
//   3. that again: bitwise the same (deterministic).
// `ctx` picks the backend; the inputs may live anywhere (copied to the context's device).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sonicmoe/moe.h"

namespace sonicmoe::testing_util {

// The raw bytes of a tensor, copied to the host (after the device's work: Tensor::to synchronises).
inline std::vector<unsigned char> host_bytes(const Tensor& t) {
  const Tensor h = t.device().is_cuda() ? t.to(Device::cpu()) : t;
  std::vector<unsigned char> b(h.nbytes());
  if (!b.empty()) std::memcpy(b.data(), h.data(), b.size());
  return b;
}
inline std::vector<float> host_f32_values(const Tensor& t) {
  const std::vector<unsigned char> b = host_bytes(t);
  std::vector<float> v(b.size() / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// f32 values rounded to the 16-bit dtype dt, as raw codes (round to nearest even, as the kernels and the host codec).
inline std::vector<std::uint16_t> rounded_codes(const std::vector<float>& v, DType dt) {
  std::vector<std::uint16_t> c(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    c[i] = dt == DType::f16 ? float_to_f16(v[i]).bits : float_to_bf16(v[i]).bits;
  return c;
}
inline std::vector<std::uint16_t> codes16(const Tensor& t) {
  const std::vector<unsigned char> b = host_bytes(t);
  std::vector<std::uint16_t> c(b.size() / 2);
  if (!c.empty()) std::memcpy(c.data(), b.data(), b.size());
  return c;
}

inline void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  EXPECT_TRUE(host_bytes(got) == host_bytes(want)) << what << " differs bitwise";
}

// Element-wise: a == b exactly (NaN never expected here), reporting the first mismatch.
inline void expect_equal_floats(const std::vector<float>& got, const std::vector<float>& want,
                                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", expected " << want[i];
      return;
    }
}

// One weight whose gradient goes to a main_grad: its MoEWeights slot, shape and the plain backward's 16-bit
// gradient; after step 1 the fp32 sums it received, then the random start values of step 2 and what they must become.
struct MainGradTarget {
  const char* name;
  TensorView MoEWeights::*slot;
  std::vector<std::int64_t> shape;
  Tensor plain;
  std::vector<float> sums, start, want;
};

// The contract above for one forward's state. w: the weights on the context's device (no main_grads); d_out there.
// The router's main_grad too where w has a router (top-K routing). two_part: the backward in two parts
// (moe_backward_activations + moe_backward_weights) as well.
inline void expect_main_grad_contract(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                      const SavedState& saved, const TensorView& d_out, std::uint32_t seed,
                                      bool two_part = false) {
  const Device dev = ctx.device();
  const DType dt = x.dtype;
  const Gradients plain = moe_backward(ctx, x, w, saved, d_out, 0.5f);
  ASSERT_TRUE(plain.dw1.defined() && plain.dw2.defined());
  auto shape_of = [](const TensorView& t) {
    return std::vector<std::int64_t>(t.shape.begin(), t.shape.begin() + t.ndim);
  };
  std::vector<MainGradTarget> targets = {{"w1_main_grad", &MoEWeights::w1_main_grad, shape_of(w.w1), plain.dw1},
                                         {"w2_main_grad", &MoEWeights::w2_main_grad, shape_of(w.w2), plain.dw2}};
  if (w.router.given())
    targets.push_back({"router_main_grad", &MoEWeights::router_main_grad, shape_of(w.router), plain.drouter});
  // w with a fresh f32 buffer in each target's slot (kept alive in bufs): zeros, or the target's start values.
  auto with_buffers = [&](std::vector<Tensor>& bufs, bool zeros) {
    MoEWeights wm = w;
    bufs.clear();
    for (const MainGradTarget& t : targets) {
      Tensor b = Tensor::zeros(t.shape, DType::f32, dev);
      if (!zeros) {
        Tensor h = Tensor::empty(t.shape, DType::f32);
        if (!t.start.empty()) std::memcpy(h.data(), t.start.data(), t.start.size() * sizeof(float));
        b = dev.is_cuda() ? h.to(dev) : h;
      }
      bufs.push_back(b);
      wm.*(t.slot) = b;
    }
    return wm;
  };
  auto expect_buffers = [&](const std::vector<Tensor>& bufs, const std::string& when) {
    for (std::size_t i = 0; i < targets.size(); ++i)
      expect_equal_floats(host_f32_values(bufs[i]), targets[i].want, std::string(targets[i].name) + " " + when);
  };

  // 1. into zeros
  std::vector<Tensor> bufs;
  const Gradients g0 = moe_backward(ctx, x, with_buffers(bufs, true), saved, d_out, 0.5f);
  EXPECT_FALSE(g0.dw1.defined()) << "dw1 returned although w1_main_grad received it";
  EXPECT_FALSE(g0.dw2.defined()) << "dw2 returned although w2_main_grad received it";
  expect_same_bits(g0.dx, plain.dx, "dx");
  expect_same_bits(g0.db1, plain.db1, "db1");
  expect_same_bits(g0.db2, plain.db2, "db2");
  EXPECT_FALSE(g0.drouter.defined()) << "drouter returned although router_main_grad received it";
  expect_same_bits(g0.dscore, plain.dscore, "dscore");
  for (std::size_t i = 0; i < targets.size(); ++i) {
    targets[i].sums = host_f32_values(bufs[i]);
    EXPECT_TRUE(rounded_codes(targets[i].sums, dt) == codes16(targets[i].plain))
        << targets[i].name << " rounded differs from the plain backward's gradient";
  }

  // 2. into random values, 3. repeated
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (MainGradTarget& t : targets) {
    t.start.resize(t.sums.size());
    for (float& v : t.start) v = nd(rng);
    t.want.resize(t.sums.size());
    for (std::size_t i = 0; i < t.sums.size(); ++i) t.want[i] = t.start[i] + t.sums[i];
  }
  for (int rep = 0; rep < 2; ++rep) {
    const Gradients g = moe_backward(ctx, x, with_buffers(bufs, false), saved, d_out, 0.5f);
    expect_same_bits(g.dx, plain.dx, "dx (random main_grads)");
    expect_buffers(bufs, "after the add, rep " + std::to_string(rep));
    if (two_part && rep == 0) {  // the two-part backward adds the same values
      const MoEWeights wm = with_buffers(bufs, false);
      WeightGradOperands keep;
      const Gradients ga = moe_backward_activations(ctx, x, wm, saved, d_out, keep, 0.5f);
      const ExpertWeightGradients gw = moe_backward_weights(ctx, x, wm, saved, d_out, keep);
      expect_same_bits(ga.dx, plain.dx, "dx (two-part)");
      EXPECT_FALSE(ga.drouter.defined()) << "two-part: drouter returned beside router_main_grad";
      EXPECT_FALSE(gw.dw1.defined() || gw.dw2.defined()) << "two-part: dw1 / dw2 returned beside the main_grads";
      expect_buffers(bufs, "(two-part)");
    }
  }
}

}  // namespace sonicmoe::testing_util

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
  for (std::size_t i = 0; i < v.size(); ++i) c[i] = dt == DType::f16 ? float_to_f16(v[i]).bits : float_to_bf16(v[i]).bits;
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
inline void expect_equal_floats(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", expected " << want[i];
      return;
    }
}

// The contract above for one forward's state. w: the weights on the context's device (no main_grads); d_out there.
// two_part: the backward in two parts (moe_backward_activations + moe_backward_weights) as well.
inline void expect_main_grad_contract(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                      const SavedState& saved, const TensorView& d_out, std::uint32_t seed,
                                      bool two_part = false) {
  const Device dev = ctx.device();
  const DType dt = x.dtype;
  const Gradients plain = moe_backward(ctx, x, w, saved, d_out, 0.5f);
  ASSERT_TRUE(plain.dw1.defined() && plain.dw2.defined());
  const std::vector<std::int64_t> s1(w.w1.shape.begin(), w.w1.shape.begin() + w.w1.ndim),
      s2(w.w2.shape.begin(), w.w2.shape.begin() + w.w2.ndim);
  const bool router = w.router.given();  // its main_grad too (top-K routing)
  const std::vector<std::int64_t> sr = router ? std::vector<std::int64_t>{w.router.shape[0], w.router.shape[1]}
                                              : std::vector<std::int64_t>{};

  // 1. into zeros
  Tensor m1 = Tensor::zeros(s1, DType::f32, dev), m2 = Tensor::zeros(s2, DType::f32, dev), mr;
  MoEWeights wm = w;
  wm.w1_main_grad = m1;
  wm.w2_main_grad = m2;
  if (router) {
    mr = Tensor::zeros(sr, DType::f32, dev);
    wm.router_main_grad = mr;
  }
  const Gradients g0 = moe_backward(ctx, x, wm, saved, d_out, 0.5f);
  EXPECT_FALSE(g0.dw1.defined()) << "dw1 returned although w1_main_grad received it";
  EXPECT_FALSE(g0.dw2.defined()) << "dw2 returned although w2_main_grad received it";
  expect_same_bits(g0.dx, plain.dx, "dx");
  expect_same_bits(g0.db1, plain.db1, "db1");
  expect_same_bits(g0.db2, plain.db2, "db2");
  EXPECT_FALSE(g0.drouter.defined()) << "drouter returned although router_main_grad received it";
  expect_same_bits(g0.dscore, plain.dscore, "dscore");
  const std::vector<float> a1 = host_f32_values(m1), a2 = host_f32_values(m2);
  EXPECT_TRUE(rounded_codes(a1, dt) == codes16(plain.dw1)) << "w1_main_grad rounded differs from dw1";
  EXPECT_TRUE(rounded_codes(a2, dt) == codes16(plain.dw2)) << "w2_main_grad rounded differs from dw2";
  const std::vector<float> ar = router ? host_f32_values(mr) : std::vector<float>{};
  if (router) EXPECT_TRUE(rounded_codes(ar, dt) == codes16(plain.drouter)) << "router_main_grad rounded differs";

  // 2. into random values, 3. repeated
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> r1(a1.size()), r2(a2.size()), rr(ar.size());
  for (float& v : r1) v = nd(rng);
  for (float& v : r2) v = nd(rng);
  for (float& v : rr) v = nd(rng);
  std::vector<float> want1(r1.size()), want2(r2.size()), wantr(rr.size());
  for (std::size_t i = 0; i < r1.size(); ++i) want1[i] = r1[i] + a1[i];
  for (std::size_t i = 0; i < r2.size(); ++i) want2[i] = r2[i] + a2[i];
  for (std::size_t i = 0; i < rr.size(); ++i) wantr[i] = rr[i] + ar[i];
  auto filled = [&](const std::vector<std::int64_t>& shape, const std::vector<float>& v) {
    Tensor h = Tensor::empty(shape, DType::f32);
    if (!v.empty()) std::memcpy(h.data(), v.data(), v.size() * sizeof(float));
    return dev.is_cuda() ? h.to(dev) : h;
  };
  for (int rep = 0; rep < 2; ++rep) {
    Tensor n1 = filled(s1, r1), n2 = filled(s2, r2), nr;
    wm.w1_main_grad = n1;
    wm.w2_main_grad = n2;
    if (router) {
      nr = filled(sr, rr);
      wm.router_main_grad = nr;
    }
    const Gradients g = moe_backward(ctx, x, wm, saved, d_out, 0.5f);
    expect_same_bits(g.dx, plain.dx, "dx (random main_grads)");
    expect_equal_floats(host_f32_values(n1), want1, "w1_main_grad after the add, rep " + std::to_string(rep));
    expect_equal_floats(host_f32_values(n2), want2, "w2_main_grad after the add, rep " + std::to_string(rep));
    if (router)
      expect_equal_floats(host_f32_values(nr), wantr, "router_main_grad after the add, rep " + std::to_string(rep));
    if (two_part && rep == 0) {  // the two-part backward adds the same values
      Tensor t1 = filled(s1, r1), t2 = filled(s2, r2), tr;
      wm.w1_main_grad = t1;
      wm.w2_main_grad = t2;
      if (router) {
        tr = filled(sr, rr);
        wm.router_main_grad = tr;
      }
      WeightGradOperands keep;
      const Gradients ga = moe_backward_activations(ctx, x, wm, saved, d_out, keep, 0.5f);
      const ExpertWeightGradients gw = moe_backward_weights(ctx, x, wm, saved, d_out, keep);
      expect_same_bits(ga.dx, plain.dx, "dx (two-part)");
      EXPECT_FALSE(ga.drouter.defined()) << "two-part: drouter returned beside router_main_grad";
      EXPECT_FALSE(gw.dw1.defined() || gw.dw2.defined()) << "two-part: dw1 / dw2 returned beside the main_grads";
      expect_equal_floats(host_f32_values(t1), want1, "w1_main_grad (two-part)");
      expect_equal_floats(host_f32_values(t2), want2, "w2_main_grad (two-part)");
      if (router) expect_equal_floats(host_f32_values(tr), wantr, "router_main_grad (two-part)");
    }
  }
}

}  // namespace sonicmoe::testing_util

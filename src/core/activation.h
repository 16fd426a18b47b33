// Activation functions and their derivatives, shared by the CPU reference and the CUDA epilogues so the
// two compute the same function (fp32 in, fp32 out).
#pragma once

#include <cmath>
#include <type_traits>

#include "sonicmoe/types.h"

#if defined(__CUDACC__)
#define SONICMOE_HD __host__ __device__ __forceinline__
#else
#define SONICMOE_HD inline
#endif

namespace sonicmoe::act {

// On the GPU, sigmoid runs on the special-function unit: exp by ex2.approx and the reciprocal by rcp.approx
// (__expf, __fdividef), a few ulp from the exact value (relative error below 1e-5 on [-40, 40], checked by
// tests/cuda/test_activation_device.cu; bf16 outputs round at 4e-3), in ~5 instructions instead of ~20 for expf
// and an IEEE division. Every element of Z goes through it in the fused epilogues; on the H100 the fused dgated
// GEMM at short K (olmoe-like, small-k2) ran 20-25% faster with it (docs/notes/fast_sigmoid.md).
// Large |x| saturates like the exact form: 1 + exp(-x) >= 2^126 gives 0, exp(-x) = 0 gives 1; NaN stays NaN.
SONICMOE_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}
SONICMOE_HD float silu(float x) { return x * sigmoid(x); }
SONICMOE_HD float dsilu(float x) {
  float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
// Exact (erf) GELU.
SONICMOE_HD float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
SONICMOE_HD float dgelu(float x) {
  return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.39894228040143268f * expf(-0.5f * x * x);
}
// tanh GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), written as x * sigmoid(2u) (the same
// function: 1 + tanh(u) = 2 sigmoid(2u)) so that it runs on the fast sigmoid above (no tanhf; saturates like it).
// d/dx = s + x s (1 - s) 2u', s = sigmoid(2u), 2u' = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2).
SONICMOE_HD float gelu_tanh(float x) {
  return x * sigmoid(1.5957691216057308f * x * (1.0f + 0.044715f * x * x));
}
SONICMOE_HD float dgelu_tanh(float x) {
  const float x2 = x * x;
  const float s = sigmoid(1.5957691216057308f * x * (1.0f + 0.044715f * x2));
  return s + x * s * (1.0f - s) * (1.5957691216057308f * (1.0f + 0.134145f * x2));
}
SONICMOE_HD float relu(float x) { return x > 0.0f ? x : 0.0f; }
SONICMOE_HD float drelu(float x) { return x > 0.0f ? 1.0f : 0.0f; }
SONICMOE_HD float relu_sq(float x) { return x > 0.0f ? x * x : 0.0f; }
SONICMOE_HD float drelu_sq(float x) { return x > 0.0f ? 2.0f * x : 0.0f; }

// The gate nonlinearity f of a GLU kind, or the elementwise function of a plain kind (D = false), or its
// derivative f' (D = true): each kind's pair of functions named once.
template <Activation A, bool D>
SONICMOE_HD float f_or_df(float x) {
  if constexpr (A == Activation::swiglu || A == Activation::silu) return D ? dsilu(x) : silu(x);
  else if constexpr (A == Activation::geglu || A == Activation::gelu) return D ? dgelu(x) : gelu(x);
  else if constexpr (A == Activation::geglu_tanh || A == Activation::gelu_tanh) return D ? dgelu_tanh(x) : gelu_tanh(x);
  else if constexpr (A == Activation::reglu || A == Activation::relu) return D ? drelu(x) : relu(x);
  else return D ? drelu_sq(x) : relu_sq(x);
}
template <Activation A>
SONICMOE_HD float f(float x) { return f_or_df<A, false>(x); }
template <Activation A>
SONICMOE_HD float df(float x) { return f_or_df<A, true>(x); }

// GLU: a = f(gate) * up.  Given g = dL/da: dgate = f'(gate) * up * g, dup = f(gate) * g.
template <Activation A>
SONICMOE_HD float glu(float gate, float up) { return f<A>(gate) * up; }
template <Activation A>
SONICMOE_HD void dglu(float gate, float up, float g, float& dgate, float& dup) {
  dgate = df<A>(gate) * up * g;
  dup = f<A>(gate) * g;
}

// Runtime -> compile-time dispatch in one place: calls fn(std::integral_constant<Activation, A>{}).
template <typename Fn>
decltype(auto) dispatch(Activation a, Fn&& fn) {
  switch (a) {
    case Activation::swiglu: return fn(std::integral_constant<Activation, Activation::swiglu>{});
    case Activation::geglu: return fn(std::integral_constant<Activation, Activation::geglu>{});
    case Activation::reglu: return fn(std::integral_constant<Activation, Activation::reglu>{});
    case Activation::gelu: return fn(std::integral_constant<Activation, Activation::gelu>{});
    case Activation::relu: return fn(std::integral_constant<Activation, Activation::relu>{});
    case Activation::silu: return fn(std::integral_constant<Activation, Activation::silu>{});
    case Activation::geglu_tanh: return fn(std::integral_constant<Activation, Activation::geglu_tanh>{});
    case Activation::gelu_tanh: return fn(std::integral_constant<Activation, Activation::gelu_tanh>{});
    case Activation::relu_sq: break;
  }
  return fn(std::integral_constant<Activation, Activation::relu_sq>{});
}

}  // namespace sonicmoe::act

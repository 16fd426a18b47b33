// The instantiation files' switch from a runtime Activation to the kernel template of that activation, over one of
// the two families that an instance group compiles (one translation unit each).
#pragma once

#include <string>
#include <type_traits>

#include "sonicmoe/error.h"
#include "sonicmoe/types.h"

namespace sonicmoe::cuda::gemm::detail {

template <Activation... As>
struct Activations {
  static constexpr bool kGlu = (is_glu(As) && ...), kPlain = (!is_glu(As) && ...);
  static constexpr int kCount = sizeof...(As);
  // Calls f(std::integral_constant<Activation, A>{}) for the A of As that equals `act`; false if none does.
  template <class F>
  static bool call(Activation act, F&& f) {
    return ((act == As ? (f(std::integral_constant<Activation, As>{}), true) : false) || ...);
  }
};
struct GluActivations : Activations<Activation::swiglu, Activation::geglu, Activation::reglu, Activation::geglu_tanh> {
  static constexpr const char* kName = "glu";
};
struct PlainActivations
    : Activations<Activation::gelu, Activation::relu, Activation::silu, Activation::relu_sq, Activation::gelu_tanh> {
  static constexpr const char* kName = "plain";
};
static_assert(GluActivations::kGlu && PlainActivations::kPlain &&
                  GluActivations::kCount + PlainActivations::kCount == kNumActivations,
              "the two families split the activations by is_glu (sonicmoe/types.h)");

// Calls f(std::integral_constant<Activation, A>{}) for the A of Family that equals `act`; else throws "<fn>: not a
// <family> activation".
template <class Family, class F>
void with_activation(const char* fn, Activation act, F&& f) {
  if (!Family::call(act, f)) throw Error(std::string(fn) + ": not a " + Family::kName + " activation");
}

}  // namespace sonicmoe::cuda::gemm::detail

// The instantiation files' switch from a runtime Activation to the kernel template of that activation.
#pragma once

#include <type_traits>

#include "sonicmoe/error.h"
#include "sonicmoe/types.h"

namespace sonicmoe::cuda::gemm::detail {

// Calls f(std::integral_constant<Activation, A>{}) for the A of As that equals `act`; throws `not_one` if none does.
template <Activation... As, class F>
void with_activation(Activation act, const char* not_one, F&& f) {
  const bool called = ((act == As ? (f(std::integral_constant<Activation, As>{}), true) : false) || ...);
  if (!called) throw Error(not_one);
}

}  // namespace sonicmoe::cuda::gemm::detail

// W1Layout::separate: the gate / up pair as one view with a runtime part stride, and its address rule.
#include "moe/w1_layout.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "sonicmoe/error.h"

namespace sonicmoe {

namespace {

// TMA's global strides: unsigned multiples of 16 bytes below 2^40 (cuTensorMapEncodeTiled).
constexpr std::int64_t kStrideAlign = 16;
constexpr std::int64_t kStrideLimit = std::int64_t{1} << 40;

}  // namespace

bool w1_separate_addresses_ok(const void* gate, const void* up, Device device) {
  const auto g = reinterpret_cast<std::uintptr_t>(gate), u = reinterpret_cast<std::uintptr_t>(up);
  if (u <= g) return false;
  const std::uintptr_t d = u - g;
  return !device.is_cuda() || (d % kStrideAlign == 0 && d < static_cast<std::uintptr_t>(kStrideLimit));
}

TensorView w1_separate_view(const char* fn, const char* gate_name, const TensorView& gate, const char* up_name,
                            const TensorView& up) {
  check::Arg ag(fn, gate_name, gate);
  ag.given().float_dtype().contiguous();
  check::Arg au(fn, up_name, up);
  au.given().dtype(gate.dtype).on(gate.device).contiguous();
  SONICMOE_CHECK(up.ndim == gate.ndim && up.shape_str() == gate.shape_str(), "sonicmoe::", fn, ": w1_layout separate "
                 "needs '", gate_name, "' and '", up_name, "' of one shape, got ", gate.shape_str(), " and ",
                 up.shape_str());
  SONICMOE_CHECK(w1_separate_addresses_ok(gate.data, up.data, gate.device), "sonicmoe::", fn,
                 ": w1_layout separate reads '", gate_name, "' (at ", gate.data, ") and '", up_name,
                 "' (at ", up.data, ") as one [2, ", gate.shape_str().substr(1),
                 " view whose part stride is their distance: '", up_name, "' must lie above '", gate_name, "'",
                 gate.device.is_cuda() ? " by a multiple of 16 bytes below 2^40 (the TMA descriptor's stride rule)"
                                       : "",
                 " (e.g. the two halves of one [2, ", gate.shape_str().substr(1), " tensor)");
  // Overlapping halves would alias W1's gate and up rows, and the backward's dW1 writes through the same rule.
  SONICMOE_CHECK(static_cast<std::size_t>(static_cast<const char*>(up.data) - static_cast<const char*>(gate.data)) >=
                     gate.nbytes(),
                 "sonicmoe::", fn, ": w1_layout separate: '", up_name, "' (at ", up.data, ") overlaps '", gate_name,
                 "' (at ", gate.data, ", ", gate.nbytes(), " bytes); expected two disjoint tensors");
  SONICMOE_CHECK((static_cast<const char*>(up.data) - static_cast<const char*>(gate.data)) %
                         static_cast<std::ptrdiff_t>(dtype_size(gate.dtype)) == 0,
                 "sonicmoe::", fn, ": w1_layout separate: '", up_name, "' and '", gate_name,
                 "' lie a fraction of an element apart");
  std::vector<std::int64_t> shape{2}, stride{(static_cast<const char*>(up.data) - static_cast<const char*>(gate.data)) /
                                             static_cast<std::int64_t>(dtype_size(gate.dtype))};
  for (int d = 0; d < gate.ndim; ++d) {
    shape.push_back(gate.shape[d]);
    stride.push_back(gate.stride[d]);
  }
  return TensorView::strided(gate.data, gate.dtype, shape, stride, gate.device);
}

TensorView w1_part(const TensorView& v, int p) {
  std::vector<std::int64_t> shape(v.shape.begin() + 1, v.shape.begin() + v.ndim);
  char* base = static_cast<char*>(v.data) + p * v.stride[0] * static_cast<std::int64_t>(dtype_size(v.dtype));
  return TensorView(base, v.dtype, shape, v.device);
}

void check_w1_separate_operand(const char* fn, const char* name, const TensorView& v, const Context& ctx, DType dt,
                               std::initializer_list<std::int64_t> part_shape, const char* desc) {
  check::Arg a(fn, name, v);
  a.given().dtype(dt).on(ctx.device());
  SONICMOE_ARG_CHECK(a, v.ndim == static_cast<int>(part_shape.size()) + 1 && v.shape[0] == 2, "has shape ",
                     v.shape_str(), ", expected ", desc, " (w1_layout separate: gate and up parts)");
  int d = 1;
  for (std::int64_t s : part_shape) {
    SONICMOE_ARG_CHECK(a, s < 0 || v.shape[d] == s, "has shape ", v.shape_str(), ", expected ", desc);
    ++d;
  }
  const TensorView gate = w1_part(v, 0), up = w1_part(v, 1);
  std::int64_t s = 1;
  for (int k = v.ndim - 1; k >= 1; --k) {
    SONICMOE_ARG_CHECK(a, v.shape[k] == 1 || v.stride[k] == s, "must have row-major parts (w1_layout separate)");
    s *= v.shape[k];
  }
  SONICMOE_ARG_CHECK(a, w1_separate_addresses_ok(gate.data, up.data, v.device), "has part stride ", v.stride[0],
                     " elements: w1_layout separate needs a positive part stride",
                     v.device.is_cuda() ? " of a multiple of 16 bytes below 2^40 bytes" : "");
  SONICMOE_ARG_CHECK(a, v.stride[0] >= s, "has part stride ", v.stride[0], " elements, less than a part's ", s,
                     " elements: the gate and up parts overlap (w1_layout separate)");
  if (ctx.backend == Backend::cuda) check::Arg(fn, name, gate).aligned(16);
}

}  // namespace sonicmoe

// Argument validation shared by every entry point. Messages name the function, the argument and the
// expected value, e.g. "sonicmoe::up_projection: argument 'w1' has shape [4, 64, 32], expected [4, 64, 64]
// ([E, z_width, H])".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "sonicmoe/detail/host_util.h"  // checked_mul, checked_add
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/tensor.h"

namespace sonicmoe {


}  // namespace sonicmoe

namespace sonicmoe::check {

class Arg {
 public:
  Arg(const char* fn, const char* name, const TensorView& v) : fn_(fn), name_(name), v_(v) {}
  Arg& given();                 // must be present (ndim > 0)
  Arg& dtype(DType expected);
  Arg& float_dtype();           // bf16, f16 or f32
  Arg& ndim(int expected);
  // Expected sizes (-1: any); `desc` names the dimensions, e.g. "[E, z_width, H]".
  Arg& shape(std::initializer_list<std::int64_t> expected, const char* desc);
  Arg& on(Device expected);
  Arg& contiguous();
  Arg& aligned(std::size_t bytes);  // base pointer alignment (the GPU's 16-byte vector accesses)
  // Host-side checks of int32 contents (CPU tensors only): every value in [lo, hi); non-decreasing.
  Arg& values_in(std::int64_t lo, std::int64_t hi, const char* range_desc);
  Arg& non_decreasing();

  std::string prefix() const;  // "sonicmoe::fn: argument 'name'"

 private:
  const char* fn_;
  const char* name_;
  const TensorView v_;  // a copy: an Arg may be built from a temporary view (e.g. a Tensor converted on the fly)
};

// Backend::cuda needs a CUDA build and a visible device ctx.device_index; says which is missing.
void backend(const Context& ctx, const char* fn);

// Routing metadata for T tokens and E experts: its counts, offsets, pair, gather, rev and token_offsets are int32,
// contiguous, on ctx's device, of shapes [E], [E+1], [N] x 3 and [T+1] (N = m.num_pairs). Shapes only.
// On the host (cpu backend) also its values (routing_metadata_values) unless `values` is false (a caller that scans
// them itself with its own messages: validate_saved_state).
void routing_metadata(const char* fn, const Context& ctx, const RoutingMetadata& m, std::int64_t T, std::int64_t E,
                      bool values = true);
// The host arrays' values, O(T + E + N): offsets the scan of counts (>= 0) from 0 to at most N, token_offsets
// non-decreasing within [0, N] (from 0 in the layer's own metadata; a range of its tokens may start past 0), pair in
// [0, N) and gather in [0, T) over the rows [0, offsets[E]), rev in [-1, N). Error naming the first bad entry. Shapes
// must have been checked (routing_metadata).
void routing_metadata_values(const char* fn, const RoutingMetadata& m);

// Throws Error(prefix + message) when cond is false.
#define SONICMOE_ARG_CHECK(arg, cond, ...) SONICMOE_CHECK(cond, (arg).prefix(), " ", __VA_ARGS__)

}  // namespace sonicmoe::check

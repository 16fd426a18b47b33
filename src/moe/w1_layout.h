// W1Layout::separate on the stage side: a gate / up pair seen as one [2, ...] view whose part stride is up - gate
// (w1_separate_view, sonicmoe/moe.h; DESIGN.md section 2, "Other W1 layouts").
#pragma once

#include <cstdint>
#include <initializer_list>

#include "sonicmoe/moe.h"
#include "sonicmoe/tensor.h"

namespace sonicmoe {

// Part p (0 gate, 1 up) of a [2, ...] view with row-major parts: a contiguous view of shape v.shape[1:].
TensorView w1_part(const TensorView& v, int p);

// A stage's separate-layout operand: a [2, part_shape...] view of dtype dt on ctx's device whose parts are
// row-major and whose part stride satisfies w1_separate_addresses_ok (on the cuda backend each part also 16-byte
// aligned). `desc` names the dimensions, e.g. "[2, E, I, H]". Throws Error naming the argument.
void check_w1_separate_operand(const char* fn, const char* name, const TensorView& v, const Context& ctx, DType dt,
                               std::initializer_list<std::int64_t> part_shape, const char* desc);

}  // namespace sonicmoe

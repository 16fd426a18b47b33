// Size limits of the layer's entry points: the int32 index contract (kMaxIndex) and the host-memory guard of the
// cpu backend, both checked before anything is allocated. The public side is moe_memory_estimate (sonicmoe/moe.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "sonicmoe/detail/host_util.h"
#include "sonicmoe/moe.h"

namespace sonicmoe::limits {

// Upper bound of the (token, expert) pairs one forward makes: T*K (top-K), spec.token's length (general), the
// token-rounding bound of moe_memory_estimate. Throws Error when a product overflows or spec is unusable.
std::int64_t max_pairs(const MoEConfig& cfg, std::int64_t T, const RoutingSpec& spec);

// T and N within kMaxIndex (the kernels' int32 rows), and every [N, width] / [T, width] buffer's element count
// within int64. `n_desc` says where N comes from, e.g. "T*K".
void check_index_limits(const char* fn, const MoEConfig& cfg, std::int64_t T, std::int64_t N, const char* n_desc);

// How N follows from the routing mode, for messages ("T*K", ...).
const char* pairs_desc(RoutingMode mode);

// Bytes route() allocates for N pairs: logits, top-K, pair arrays, metadata (and token rounding's scratch).
std::size_t routing_bytes(const MoEConfig& cfg, std::int64_t T, std::int64_t N, RoutingMode mode);

// Peak bytes of `pass` for exactly N pairs (moe_memory_estimate with N known, e.g. from a saved state). reuse_z:
// the backward writes dZ over the saved Z (moe_backward's consuming overload), one [N, z_width] buffer less.
// fp8_backward_quantises (fp8_blockwise backward): the state holds no quantised weights and none were given, so the
// backward quantises W1 and W2 with both copies itself.
std::size_t layer_bytes(const MoEConfig& cfg, std::int64_t T, std::int64_t N, DType dtype, RoutingMode mode,
                        MemoryPass pass, bool reuse_z, bool fp8_backward_quantises = false);

// available_host_memory and check_host_memory (the host-memory guard, used by the tools too):
// sonicmoe/detail/host_util.h.

}  // namespace sonicmoe::limits

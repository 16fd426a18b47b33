// What the cuda backend supports, in one place: every capacity limit of its kernels, and the one function that
// checks a stage's sizes against them (called once per public stage entry, src/moe/stages.cpp, after the
// backend-independent validation). docs/STATUS.md's limits table points here. Host code; no CUDA headers.
#pragma once

#include <cstdint>

namespace sonicmoe::cuda {

// Experts: the routing metadata and token-rounding kernels keep a per-expert array in one block (two experts a
// thread of 256; token rounding's plan kernel is one block of kMaxExperts threads).
inline constexpr int kMaxExperts = 512;
// Experts of one grouped GEMM: the native scheduler keeps offsets and a tile prefix per expert in shared memory
// (kernel_sm90_varlen_m.cuh static_asserts its shared memory at this E). Above kMaxExperts, so the layer never
// meets it; a GEMM stage called with more raises an Error.
inline constexpr int kGemmMaxExperts = 1024;
// Top-K: the top-K kernel holds each token's K candidates in registers; the router backward likewise.
inline constexpr std::int64_t kMaxTopK = 16;
// Token rounding: the (token, expert) ranking indexes T * E cells with int32; tiles below 2^30.
inline constexpr std::int64_t kMaxRoundingCells = std::int64_t{1} << 31;
inline constexpr std::int64_t kMaxRoundingTile = std::int64_t{1} << 30;
// Group-limited routers: the per-token group scores are one warp's lanes.
inline constexpr std::int64_t kMaxRouterGroups = 32;
// GEMM widths (hidden_size, intermediate_size, z_width): 16-byte rows for TMA and the vector loads.
inline constexpr std::int64_t kWidthMultiple = 8;
// Rows (pairs N, tokens T) and widths: int32 in the kernels. The metadata builder keeps 4096 rows of headroom.
inline constexpr std::int64_t kMaxRows = (std::int64_t{1} << 31) - 4096;
inline constexpr std::int64_t kMaxWidth = (std::int64_t{1} << 31) - 1;

// The sizes a stage entry knows; -1 where the stage has no such size.
struct StageSizes {
  std::int64_t tokens = -1;       // T
  std::int64_t pairs = -1;        // N
  std::int64_t experts = -1;      // E
  std::int64_t top_k = -1;        // K
  std::int64_t router_groups = -1;  // RouterSpec::n_group
  std::int64_t rounding_tile = -1;  // token rounding: the tile (and T * E cells)
  // Widths of a GEMM (each a multiple of kWidthMultiple), with their names for the message.
  std::int64_t width[3] = {-1, -1, -1};
  const char* width_name[3] = {nullptr, nullptr, nullptr};
  bool gemm = false;  // the stage runs a grouped GEMM: experts <= kGemmMaxExperts
};

// Throws sonicmoe::Error naming `fn`, the size and the limit when a size is beyond the cuda backend's limits.
void check_limits(const char* fn, const StageSizes& s);

}  // namespace sonicmoe::cuda

// The shared-memory tile of the transposing quantisers (quant_transpose.cu) and which thread touches which part of
// it: plain integer functions, so tests/cuda/test_quant_layout.cpp checks on the host that the layout is a
// bijection, that every element is loaded and stored once, and how many bank conflicts each phase has.
//
// The tile holds kTileRows rows (M or N) x KT columns (K) of the input as fp32, k-major: tile row kk holds the 128
// values of column kk. The 16-byte group m / 4 of tile row kk sits at group (m / 4) ^ h(kk), h(kk) = (kk ^ kk / 8) % 8.
// Load phase: thread t's chunk c (16 bytes of one input row) is chunk index t + c * kTileThreads of the tile in
// row-major order. Store phase: in pass p, lane l of warp w owns column 4 (w + 8 p) + l % 4 and its values
// 16 (l / 4) .. 16 (l / 4) + 15.
#pragma once

#include "core/fp8_e4m3.h"

namespace sonicmoe::cuda::quant {

constexpr int kTileRows = 128, kTileThreads = 256, kTileWarps = kTileThreads / 32;

SONICMOE_FP8_HD constexpr int tile_offset(int kk, int m) {
  return kk * kTileRows + (((m >> 2) ^ ((kk ^ (kk >> 3)) & 7)) << 2) + (m & 3);
}

// Load phase: tile row (input row) and first column of thread t's chunk c; per_row = chunks in a tile row (KT / V).
SONICMOE_FP8_HD constexpr int load_row(int t, int c, int per_row) { return (t + c * kTileThreads) / per_row; }
SONICMOE_FP8_HD constexpr int load_col(int t, int c, int per_row, int v) { return (t + c * kTileThreads) % per_row * v; }

// Store phase: the column of thread t in pass p, and the first of its 16 values.
SONICMOE_FP8_HD constexpr int store_col(int t, int pass) { return 4 * (t / 32 + kTileWarps * pass) + (t % 32) % 4; }
SONICMOE_FP8_HD constexpr int store_first(int t) { return 16 * ((t % 32) / 4); }
// Store-phase passes for a tile of kt columns.
constexpr int store_passes(int kt) { return kt / (4 * kTileWarps); }

}  // namespace sonicmoe::cuda::quant

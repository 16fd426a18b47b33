// The shared tile of the transposing FP8 quantisers (src/cuda/quant/quant_tile.h), checked on the host (no GPU):
// the swizzled layout is a bijection, the load and store phases touch every element exactly once, the 8 lanes of a
// column are the ones the amax shuffles combine, and the bank conflicts of each phase are what the kernel's comment
// claims (none where it matters: bf16 loads and every 16-byte read).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "cuda/quant/quant_tile.h"

namespace {

using namespace sonicmoe::cuda::quant;

// Largest number of distinct 4-byte words that share a bank among `words` (one shared-memory wavefront).
int conflict_degree(const std::vector<int>& words) {
  std::vector<std::set<int>> bank(32);
  for (int w : words) bank[w % 32].insert(w);
  int d = 0;
  for (const auto& b : bank) d = std::max(d, static_cast<int>(b.size()));
  return d;
}

TEST(QuantTileLayout, SwizzleIsABijectionPerTile) {
  for (int kt : {64, 128}) {
    std::vector<int> seen(kt * kTileRows, 0);
    for (int kk = 0; kk < kt; ++kk)
      for (int m = 0; m < kTileRows; ++m) {
        const int o = tile_offset(kk, m);
        ASSERT_GE(o, kk * kTileRows);
        ASSERT_LT(o, (kk + 1) * kTileRows);  // stays in its tile row
        ++seen[o];
      }
    for (int n : seen) ASSERT_EQ(n, 1);
    for (int kk = 0; kk < kt; ++kk)
      for (int m = 0; m < kTileRows; m += 4) ASSERT_EQ(tile_offset(kk, m) % 4, 0);  // 16-byte groups stay whole
  }
}

struct LoadCase {
  int v, kt, max_degree;  // elements per 16-byte chunk (8 bf16, 4 f32), tile columns, worst bank conflict expected
};

TEST(QuantTileLayout, LoadPhaseCoversTheTileOnceAndItsConflicts) {
  for (LoadCase lc : {LoadCase{8, 64, 1}, LoadCase{4, 64, 2}, LoadCase{8, 128, 2}, LoadCase{4, 128, 4}}) {
    const int per_row = lc.kt / lc.v, count = kTileRows * per_row / kTileThreads;
    std::vector<int> seen(lc.kt * kTileRows, 0);
    int worst = 0;
    for (int c = 0; c < count; ++c)
      for (int warp = 0; warp < kTileWarps; ++warp)
        for (int e = 0; e < lc.v; ++e) {  // one scalar store instruction of the warp
          std::vector<int> words;
          for (int lane = 0; lane < 32; ++lane) {
            const int t = warp * 32 + lane, row = load_row(t, c, per_row), col = load_col(t, c, per_row, lc.v);
            ++seen[(col + e) * kTileRows + row];
            words.push_back(tile_offset(col + e, row));
          }
          worst = std::max(worst, conflict_degree(words));
        }
    for (int n : seen) ASSERT_EQ(n, 1) << "v " << lc.v << " kt " << lc.kt;
    EXPECT_EQ(worst, lc.max_degree) << "v " << lc.v << " kt " << lc.kt;
  }
}

TEST(QuantTileLayout, StorePhaseCoversEveryColumnOnceWithoutConflicts) {
  for (int kt : {64, 128}) {
    std::vector<int> seen(kt * kTileRows, 0);
    for (int pass = 0; pass < store_passes(kt); ++pass)
      for (int warp = 0; warp < kTileWarps; ++warp) {
        for (int lane = 0; lane < 32; ++lane) {
          const int t = warp * 32 + lane, kk = store_col(t, pass);
          ASSERT_LT(kk, kt);
          for (int j = 0; j < 16; ++j) ++seen[kk * kTileRows + store_first(t) + j];
          for (int x = 1; x < 8; ++x)  // the lanes the amax shuffles (xor 4, 8, 16) combine: the same column
            ASSERT_EQ(store_col(warp * 32 + (lane ^ (x << 2)), pass), kk);
        }
        for (int i = 0; i < 4; ++i)     // one 16-byte read instruction: four phases of 8 lanes
          for (int phase = 0; phase < 4; ++phase) {
            std::vector<int> words;
            for (int lane = 8 * phase; lane < 8 * phase + 8; ++lane) {
              const int t = warp * 32 + lane, o = tile_offset(store_col(t, pass), store_first(t) + 4 * i);
              for (int w = 0; w < 4; ++w) words.push_back(o + w);
            }
            ASSERT_EQ(conflict_degree(words), 1) << "kt " << kt << " pass " << pass << " warp " << warp;
          }
      }
    for (int n : seen) ASSERT_EQ(n, 1) << "kt " << kt;
  }
}

}  // namespace

// Persistent tile scheduler of the varlen-M GEMMs (DESIGN.md section 5): tiles are (expert, M-tile, N-tile)
// read from the device `offsets[E+1]`, so the grid never depends on host-known group sizes. Every CTA builds
// the per-expert tile prefix in shared memory once; every role (producer, consumers) then walks the same
// sequence t = blockIdx.x, blockIdx.x + gridDim.x, ... and decodes it alone, without talking to the others.
// Within an expert, tiles go M-tile major (consecutive CTAs share the rows of A, sweep the N-tiles of B[e]),
// or N-tile major with `raster_n` (consecutive CTAs share a panel of B[e], sweep the rows).
#pragma once

#include <cstdint>

namespace sonicmoe::cuda::gemm::sm90 {

struct VarlenTile {
  int expert;  // e
  int row0;    // first row of the tile (global row index, offsets[e] + m_tile * BM)
  int rows;    // valid rows in the tile, 1..BM
  int n_tile;  // N-tile index
};

template <int BM>
struct VarlenMScheduler {
  const int* offsets;  // shared memory copy of offsets[0..E]
  const int* prefix;   // shared memory: prefix[e] = tiles of experts < e; prefix[E] = all tiles
  int num_experts;
  int n_tiles;
  bool raster_n;

  __host__ __device__ __forceinline__ int total() const { return prefix[num_experts]; }

  __host__ __device__ __forceinline__ VarlenTile at(int t) const {
    int lo = 0, hi = num_experts;  // invariant: prefix[lo] <= t < prefix[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (prefix[mid] <= t) lo = mid;
      else hi = mid;
    }
    const int local = t - prefix[lo];
    VarlenTile tile;
    tile.expert = lo;
    int m_tile;
    if (raster_n) {
      const int m_tiles = (offsets[lo + 1] - offsets[lo] + BM - 1) / BM;
      tile.n_tile = local / m_tiles;
      m_tile = local - tile.n_tile * m_tiles;
    } else {
      m_tile = local / n_tiles;
      tile.n_tile = local - m_tile * n_tiles;
    }
    tile.row0 = offsets[lo] + m_tile * BM;
    const int left = offsets[lo + 1] - tile.row0;
    tile.rows = left < BM ? left : BM;
    return tile;
  }

  // Called by every thread of the block; ends with __syncthreads(). Offsets are clamped to [0, capacity] and
  // made non-decreasing, so corrupt offsets can never make the kernel write outside C.
  __device__ static void build(const std::int32_t* g_offsets, int num_experts, int n_tiles, int capacity, int* s_off,
                               int* s_prefix) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      int carry_tiles = 0;
      int carry_off = g_offsets[0];
      carry_off = carry_off < 0 ? 0 : (carry_off > capacity ? capacity : carry_off);
      if (lane == 0) {
        s_off[0] = carry_off;
        s_prefix[0] = 0;
      }
      for (int base = 0; base < num_experts; base += 32) {
        const int e = base + lane;
        int end = e < num_experts ? g_offsets[e + 1] : 0;
        end = end < 0 ? 0 : (end > capacity ? capacity : end);
        // running max over lanes keeps the offsets non-decreasing
        int run = end;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, run, o);
          if (lane >= o) run = run > v ? run : v;
        }
        run = run > carry_off ? run : carry_off;
        const int up = __shfl_up_sync(0xffffffffu, run, 1);  // every lane takes part in the shuffle
        const int start = lane == 0 ? carry_off : up;
        const int tiles = e < num_experts ? ((run - start) + BM - 1) / BM * n_tiles : 0;
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (e < num_experts) {
          s_off[e + 1] = run;
          s_prefix[e + 1] = carry_tiles + incl;
        }
        carry_tiles += __shfl_sync(0xffffffffu, incl, 31);
        carry_off = __shfl_sync(0xffffffffu, run, 31);
      }
    }
    __syncthreads();
  }
};

}  // namespace sonicmoe::cuda::gemm::sm90

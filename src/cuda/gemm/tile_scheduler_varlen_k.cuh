// Work units of the native varlen-K GEMM (kernel_sm90_varlen_k.cuh; DESIGN.md section 5): (expert, M tile, N tile),
// expert-major, then M tile, then N tile. Their number (E * m_tiles * n_tiles) is known on the host; each unit's K
// length, the expert's rows [offsets[e], offsets[e+1]), only on the device. Every role (producer, consumers) walks
// t = blockIdx.x, blockIdx.x + gridDim.x, ... and decodes it alone.
#pragma once

#include <cuda_runtime.h>

namespace sonicmoe::cuda::gemm::sm90 {

// Work unit t -> (expert, M tile, N tile) and the expert's row range.
struct VarlenKUnit {
  int expert, m_tile, n_tile, row_begin, row_end;
};
template <class Params>
__device__ __forceinline__ VarlenKUnit varlen_k_unit(const Params& p, int t) {
  VarlenKUnit u;
  const int per_expert = p.m_tiles * p.n_tiles;
  u.expert = t / per_expert;
  const int local = t - u.expert * per_expert;
  u.m_tile = local / p.n_tiles;
  u.n_tile = local - u.m_tile * p.n_tiles;
  int b = __ldg(p.offsets + u.expert), e = __ldg(p.offsets + u.expert + 1);
  b = b < 0 ? 0 : (b > p.rows ? p.rows : b);
  e = e < b ? b : (e > p.rows ? p.rows : e);
  u.row_begin = b;
  u.row_end = e;
  return u;
}

}  // namespace sonicmoe::cuda::gemm::sm90

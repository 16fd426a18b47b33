// The plain-store varlen-M kernel for one A layout (included by store_*.cu, one layout per file): B K-major
// (down-projection) or N-major (dXe), full tiles stored by TMA (epilogue_tma_store_sm90.cuh).
#pragma once

#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/native_instances.h"
#include "cuda/gemm/instances/instance_element.h"

namespace sonicmoe::cuda::gemm::detail {

template <class Cfg, class BknCfg>
void store_of(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale) {
  using namespace sm90;
  using Epi = EpiStoreTmaOf<typename Cfg::Element>;
  const auto ep = Epi::make_params(c, bias, row_scale, g.n, static_cast<int>(g.rows));
  if (g.b_kn) launch_varlen_m<BknCfg, Epi>(g, ep);
  else launch_varlen_m<Cfg, Epi>(g, ep);
}

}  // namespace sonicmoe::cuda::gemm::detail

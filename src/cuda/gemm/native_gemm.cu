// The one dispatch file of the native GEMMs: picks the instantiation (src/cuda/gemm/instances/) of each varlen-M
// epilogue and varlen-K variant by the heuristics of heuristics.h; and the small deterministic reduction that turns
// the dgated epilogue's per-N-tile row partials into the router-score gradient.
#include "cuda/gemm/native_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/cuda_check.h"
#include "cuda/elementwise/elementwise_common.cuh"
#include "cuda/gemm/heuristics.h"
#include "cuda/gemm/native_instances.h"
#include "cuda/launch_util.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"

namespace sonicmoe::cuda::gemm {
namespace {

// The f16 twin of an instance entry point where g.elem is f16 (native_instances.h).
#define SONICMOE_BY_ELEM(g, name) ((g).elem == DType::f16 ? detail::name##_f16 : detail::name)

// One warp per row: the N-tile partials in tile order, then <dO[t], b2[e]> with a fixed butterfly. T: the 16-bit
// type of d_out / b2 (__nv_bfloat16 or __half).
template <class T>
__global__ void dgated_score_reduce_kernel(const float* __restrict__ partial, int n_tiles, std::int64_t rows,
                                           const std::int32_t* __restrict__ pair,
                                           const std::int32_t* __restrict__ offsets, int E,
                                           const T* __restrict__ d_out,
                                           const std::int32_t* __restrict__ gather,
                                           const T* __restrict__ b2, std::int64_t H,
                                           float* __restrict__ dscore) {
  const int lane = threadIdx.x & 31;
  const std::int64_t total = __ldg(offsets + E);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < total;
       r += warps) {
    float bias_dot = 0.0f;
    if (b2 != nullptr) {
      const int e = ew::find_expert(offsets, E, static_cast<std::int32_t>(r));
      const T* o = d_out + static_cast<std::int64_t>(__ldg(gather + r)) * H;
      const T* b = b2 + static_cast<std::int64_t>(e) * H;
      for (std::int64_t h = lane * 8; h < H; h += 32 * 8) {
        float ov[8], bv[8];
        ew::load16<8>(o + h, ov);
        ew::load16<8>(b + h, bv);
#pragma unroll
        for (int i = 0; i < 8; ++i) bias_dot = fmaf(ov[i], bv[i], bias_dot);
      }
#pragma unroll
      for (int o2 = 16; o2 > 0; o2 >>= 1) bias_dot += __shfl_xor_sync(0xffffffffu, bias_dot, o2);
    }
    if (lane == 0) {
      float s = 0.0f;
      for (int nt = 0; nt < n_tiles; ++nt) s += __ldg(partial + nt * rows + r);
      dscore[__ldg(pair + r)] = s + bias_dot;
    }
  }
}

// Without b2: one thread per row, the N-tile partials in tile order (the same sums as the kernel above, whose
// warps would each leave 31 lanes idle: 58 us at 262144 rows on the H200).
__global__ void dgated_score_sum_kernel(const float* __restrict__ partial, int n_tiles, std::int64_t rows,
                                        const std::int32_t* __restrict__ pair,
                                        const std::int32_t* __restrict__ offsets, int E, float* __restrict__ dscore) {
  const std::int64_t total = __ldg(offsets + E);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; r < total; r += stride) {
    float s = 0.0f;
    for (int nt = 0; nt < n_tiles; ++nt) s += __ldg(partial + nt * rows + r);
    dscore[__ldg(pair + r)] = s;
  }
}

// D = P^T Q as D^T = Q^T P: the same arguments with the P and Q operands (and m, n) exchanged.
// The accumulating epilogue by TMA reduce-add (heuristics.h), unless SONICMOE_ACCUM_EPILOGUE says tma or direct.
bool accum_by_tma(std::int64_t rows, int num_experts) {
  static const int forced = [] {
    const char* v = std::getenv("SONICMOE_ACCUM_EPILOGUE");
    if (!v || !*v) return -1;
    return std::string(v) == "tma" ? 1 : std::string(v) == "direct" ? 0 : -1;
  }();
  if (forced >= 0) return forced == 1;
  return varlen_k_accum_by_tma(rows, num_experts);
}

NativeVarlenK swapped_operands(const NativeVarlenK& g) {
  NativeVarlenK t = g;
  std::swap(t.p, t.q);
  std::swap(t.p_rows, t.q_rows);
  std::swap(t.p_gather, t.q_gather);
  std::swap(t.m, t.n);
  return t;
}

}  // namespace

int current_sm_count() {
  static int cache[64] = {};
  int dev = 0;
  SONICMOE_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    int n = 0;
    SONICMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev] = n;
  }
  return std::max(1, cache[dev] - gemm_sm_margin());  // the SMs left to other streams (sonicmoe/moe.h)
}

bool native_raster_n(const NativeVarlenM& g, RasterRule rule) {
  static const int forced = [] {
    const char* v = std::getenv("SONICMOE_NATIVE_RASTER");
    if (!v || !*v) return -1;
    return (v[0] == 'n' || v[0] == 'N') ? 1 : 0;
  }();
  if (forced >= 0) return forced == 1;
  return raster_n_of(rule, g.rows, g.num_experts);
}

void native_varlen_m_store(const NativeVarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias,
                           const float* row_scale) {
  if (g.b_w1_concat) {  // dXe over W1 stored concatenated
    if (g.gather || !g.b_kn || bias || row_scale)
      throw Error("native_varlen_m_store: W1 in two parts is read only as dXe's B (contiguous A, B as "
                  "[E, k, n], no bias or row scale)");
    SONICMOE_BY_ELEM(g, native_store_contiguous_bkn_w1_concat)(g, c);
    return;
  }
  if (g.gather) SONICMOE_BY_ELEM(g, native_store_gathered)(g, c, bias, row_scale);
  else SONICMOE_BY_ELEM(g, native_store_contiguous)(g, c, bias, row_scale);
}

void native_varlen_m_activation(const NativeVarlenM& g, Activation act, const __nv_bfloat16* bias,
                                __nv_bfloat16* z, __nv_bfloat16* a_out, W1BiasStrides bias_strides) {
  if (!g.gather || g.b_kn) throw Error("native_varlen_m_activation: needs gathered A rows and B as [E, n, k]");
  if (g.b_w1_concat) {
    if (!is_glu(act)) throw Error("native_varlen_m_activation: W1 in two parts needs a glu activation");
    SONICMOE_BY_ELEM(g, native_activation_glu_w1_concat)(g, act, bias, z, a_out, bias_strides);
    return;
  }
  if (is_glu(act)) SONICMOE_BY_ELEM(g, native_activation_glu)(g, act, bias, z, a_out);
  else SONICMOE_BY_ELEM(g, native_activation_plain)(g, act, bias, z, a_out);
}

void native_varlen_m_dgated(const NativeVarlenM& g, Activation act, const __nv_bfloat16* z, const float* pair_score,
                            const std::int32_t* pair, __nv_bfloat16* dz, __nv_bfloat16* as, float* ds_partial) {
  if (!g.gather || !g.b_kn) throw Error("native_varlen_m_dgated: needs gathered A rows and B as [E, k, n]");
  const bool mma_gather = dgated_mma_gather(g.k);
  if (is_glu(act)) {
    if (mma_gather) SONICMOE_BY_ELEM(g, native_dgated_glu)(g, act, z, pair_score, pair, dz, as, ds_partial);
    else SONICMOE_BY_ELEM(g, native_dgated_glu_wide)(g, act, z, pair_score, pair, dz, as, ds_partial);
  } else {
    if (mma_gather) SONICMOE_BY_ELEM(g, native_dgated_plain)(g, act, z, pair_score, pair, dz, as, ds_partial);
    else SONICMOE_BY_ELEM(g, native_dgated_plain_wide)(g, act, z, pair_score, pair, dz, as, ds_partial);
  }
}

void native_varlen_k(const NativeVarlenK& args) {
  NativeVarlenK g = args;
  // No rows at all: every expert is written with zeros and P, Q are never read, but their TMA descriptors need an
  // address and a row.
  if (g.p_rows == 0) g.p_rows = 1;
  if (g.q_rows == 0) g.q_rows = 1;
  const __nv_bfloat16* some_d = g.d ? g.d : reinterpret_cast<const __nv_bfloat16*>(g.d_f32);
  if (!g.p) g.p = some_d;
  if (!g.q) g.q = some_d;
  // The kernel variant and whether it gets g swapped; then the store or the accumulating (d_f32) instance of it.
  enum class V { contiguous_p, gathered_p, gathered_p_tma_q, transposed, concat, concat_transposed } v;
  if (g.d_w1_concat) {  // dW1 written in two parts: the dW1 shape only, the same swap rule as interleaved
    if (g.p_gather || !g.q_gather || g.m % 2 != 0)
      throw Error("native_varlen_k: dW1 written in two parts needs P contiguous, Q gathered and an even m = 2I");
    v = varlen_k_swap_operands(false, true, g.rows, g.num_experts) ? V::concat_transposed : V::concat;
  } else if (g.p_gather && !g.q_gather) {
    v = V::gathered_p_tma_q;
  } else if (varlen_k_swap_operands(g.p_gather != nullptr, g.q_gather != nullptr, g.rows, g.num_experts)) {
    // D = P^T Q computed as D^T = Q^T P: the gathered operand on the M side (half the cp.async per k-tile)
    v = V::transposed;
  } else {
    v = g.p_gather ? V::gathered_p : V::contiguous_p;
  }
  if (v == V::transposed || v == V::concat_transposed) g = swapped_operands(g);
  const bool acc = g.d_f32 != nullptr;
  if (acc && reinterpret_cast<std::uintptr_t>(g.d_f32) % 16 != 0)
    throw Error("native_varlen_k: the f32 D (d_f32) must be 16-byte aligned");
  // accumulating: by TMA reduce-add or from registers (heuristics.h; SONICMOE_ACCUM_EPILOGUE=tma|direct forces one, a
  // knob for the benchmarks); always from registers: contiguous P (the layer's dW1 below the swap threshold, which is
  // the TMA one too), both operands gathered (no layer GEMM) and the two-part W1 layouts
  const bool tma = acc && accum_by_tma(g.rows, g.num_experts);
  switch (v) {
    case V::contiguous_p:
      if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_contiguous_p_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_contiguous_p)(g);
      break;
    case V::gathered_p:
      if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p)(g);
      break;
    case V::gathered_p_tma_q:
      if (tma) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_accum_tma)(g);
      else if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q)(g);
      break;
    case V::transposed:
      if (tma) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_transposed_accum_tma)(g);
      else if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_transposed_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_transposed)(g);
      break;
    case V::concat:
      if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_contiguous_p_w1_concat_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_contiguous_p_w1_concat)(g);
      break;
    case V::concat_transposed:
      if (acc) SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_transposed_w1_concat_accum)(g);
      else SONICMOE_BY_ELEM(g, native_varlen_k_gathered_p_tma_q_transposed_w1_concat)(g);
      break;
  }
}

void dgated_score_reduce(const float* ds_partial, int n_tiles, std::int64_t rows, const std::int32_t* pair,
                         const std::int32_t* offsets, int num_experts, const __nv_bfloat16* d_out,
                         const std::int32_t* gather, const __nv_bfloat16* b2, std::int64_t H, float* dscore,
                         cudaStream_t stream, DType elem) {
  if (rows <= 0) return;
  if (b2 != nullptr && (H % 8 != 0 || !d_out || !gather))
    throw Error("dgated_score_reduce: the b2 term needs d_out, gather and H a multiple of 8, got H = " +
                std::to_string(H));
  constexpr int kThreads = 256, kMaxBlocks = 4 * 132 * 8;
  if (b2 == nullptr) {
    const int grid = blocks_for(rows, kThreads, kMaxBlocks);
    dgated_score_sum_kernel<<<grid, kThreads, 0, stream>>>(ds_partial, n_tiles, rows, pair, offsets, num_experts,
                                                           dscore);
    SONICMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  const int grid = blocks_for(rows, kThreads / 32, kMaxBlocks);  // a warp per row
  if (elem == DType::f16)
    dgated_score_reduce_kernel<__half><<<grid, kThreads, 0, stream>>>(
        ds_partial, n_tiles, rows, pair, offsets, num_experts, reinterpret_cast<const __half*>(d_out), gather,
        reinterpret_cast<const __half*>(b2), H, dscore);
  else
    dgated_score_reduce_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(ds_partial, n_tiles, rows, pair, offsets,
                                                                             num_experts, d_out, gather, b2, H, dscore);
  SONICMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace sonicmoe::cuda::gemm

// Baseline: host side of the grouped GEMMs with a choice of kernel (grouped_gemm_cutlass.h): argument checks,
// workspace layout, and the small memory-bound kernels around the CUTLASS mainloops (row gather, bias / row-scale
// epilogue pass, zeros for empty experts). Schedule::native calls the library's kernels (cuda/gemm/native_gemm.h).
#include "baselines/grouped_gemm_cutlass.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "core/cuda_check.h"
#include "cuda/gemm/native_gemm.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"

namespace sonicmoe::baselines {

using namespace cuda::gemm;
namespace {

constexpr std::size_t kAlignBytes = 16;  // TMA and the 16-byte vector kernels

std::size_t round_up(std::size_t x) { return (x + 255) / 256 * 256; }

[[noreturn]] void fail(const char* fn, const std::string& what) {
  throw Error(std::string("sonicmoe::baselines::") + fn + ": " + what);
}

void check_ptr(const char* fn, const char* name, const void* p, bool required) {
  if (!p) {
    if (required) fail(fn, std::string(name) + " must not be null");
    return;
  }
  if (reinterpret_cast<std::uintptr_t>(p) % kAlignBytes != 0)
    fail(fn, std::string(name) + " must be 16-byte aligned");
}

void check_dim(const char* fn, const char* name, std::int64_t v, bool multiple_of_8) {
  if (v <= 0) fail(fn, std::string(name) + " must be positive, got " + std::to_string(v));
  if (v > std::numeric_limits<int>::max()) fail(fn, std::string(name) + " is too large for int32: " + std::to_string(v));
  if (multiple_of_8 && v % 8 != 0)
    fail(fn, std::string(name) + " must be a multiple of 8 elements (16-byte rows for TMA), got " + std::to_string(v));
}

int sm_count() {
  int dev = 0, n = 0;
  SONICMOE_CUDA_CHECK(cudaGetDevice(&dev));
  SONICMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return std::max(1, n - gemm_sm_margin());  // the SMs left to other streams (sonicmoe/moe.h)
}

// e such that offsets[e] <= r < offsets[e+1] (first non-empty such e), by binary search.
__device__ __forceinline__ int expert_of_row(const std::int32_t* offsets, int num_experts, int r) {
  int lo = 0, hi = num_experts;  // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (__ldg(offsets + mid) <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

__global__ void gather_rows_kernel(const uint4* __restrict__ src, const std::int32_t* __restrict__ idx,
                                   std::int64_t rows, int vec_per_row, const std::int32_t* valid_rows,
                                   uint4* __restrict__ dst) {
  const std::int64_t n_rows = valid_rows ? static_cast<std::int64_t>(*valid_rows) : rows;
  const std::int64_t total = n_rows * vec_per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / vec_per_row;
    const int v = static_cast<int>(i - r * vec_per_row);
    dst[i] = __ldg(src + static_cast<std::int64_t>(__ldg(idx + r)) * vec_per_row + v);
  }
}

// C[r, :] = scale[r] * (C[r, :] + bias[e(r), :]) for r < offsets[E]; 8 columns per thread.
__global__ void bias_scale_kernel(__nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale,
                                  const std::int32_t* offsets, int num_experts, int vec_per_row) {
  const std::int64_t n_rows = offsets[num_experts];
  const std::int64_t total = n_rows * vec_per_row;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(i / vec_per_row);
    const int v = static_cast<int>(i - static_cast<std::int64_t>(r) * vec_per_row);
    uint4 cv = reinterpret_cast<uint4*>(c)[i];
    __nv_bfloat162* ch = reinterpret_cast<__nv_bfloat162*>(&cv);
    float2 acc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = __bfloat1622float2(ch[j]);
    if (bias) {
      const int e = expert_of_row(offsets, num_experts, r);
      uint4 bv = __ldg(reinterpret_cast<const uint4*>(bias) + static_cast<std::int64_t>(e) * vec_per_row + v);
      const __nv_bfloat162* bh = reinterpret_cast<const __nv_bfloat162*>(&bv);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 b = __bfloat1622float2(bh[j]);
        acc[j].x += b.x;
        acc[j].y += b.y;
      }
    }
    if (row_scale) {
      const float s = __ldg(row_scale + r);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[j].x *= s;
        acc[j].y *= s;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) ch[j] = __float22bfloat162_rn(acc[j]);
    reinterpret_cast<uint4*>(c)[i] = cv;
  }
}

// D[e] = 0 for every expert e without rows (the grouped GEMM gives such groups an empty problem).
__global__ void zero_empty_experts_kernel(__nv_bfloat16* d, const std::int32_t* offsets, std::int64_t vec_per_expert) {
  const int e = blockIdx.y;
  if (offsets[e + 1] != offsets[e]) return;
  uint4* out = reinterpret_cast<uint4*>(d) + static_cast<std::int64_t>(e) * vec_per_expert;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < vec_per_expert;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

int grid_for(std::int64_t work, int block) {
  const std::int64_t g = (work + block - 1) / block;
  return static_cast<int>(g < 1 ? 1 : (g > 132 * 16 ? 132 * 16 : g));
}

// The native kernels' scheduler holds per-expert arrays in shared memory (cuda_limits.h).
void check_native_experts(const char* fn, Schedule s, std::int64_t num_experts) {
  if (is_native(s) && num_experts > kNativeMaxExperts)
    fail(fn, "num_experts = " + std::to_string(num_experts) + " exceeds the native kernels' limit of " +
                 std::to_string(kNativeMaxExperts));
}

// The sizes both families check: E, the two widths (multiples of 8) and the row capacity.
void check_sizes(const char* fn, std::int64_t num_experts,
                 std::initializer_list<std::pair<const char*, std::int64_t>> widths, std::int64_t rows) {
  check_dim(fn, "num_experts", num_experts, false);
  for (const auto& [name, v] : widths) check_dim(fn, name, v, true);
  if (rows < 0 || rows > std::numeric_limits<int>::max()) fail(fn, "rows out of range: " + std::to_string(rows));
}

void check_varlen_m(const VarlenMParams& p) {
  const char* fn = "varlen_m_gemm";
  check_sizes(fn, p.num_experts, {{"n", p.n}, {"k", p.k}}, p.rows);
  if (p.gather && p.a_rows <= 0) fail(fn, "a_rows must be positive with a gather index");
  // With no rows (e.g. token rounding down to zero tokens) the row operands may be empty (null).
  const bool rows = p.rows > 0;
  check_ptr(fn, "a", p.a, rows);
  check_ptr(fn, "b", p.b, true);
  check_ptr(fn, "c", p.c, rows);
  check_ptr(fn, "bias", p.bias, false);
  if (!p.offsets) fail(fn, "offsets must not be null");
  if (p.b_kn && p.schedule == Schedule::cutlass_pingpong) fail(fn, "b_kn is not supported by cutlass_pingpong");
  if (p.gather && p.a_rows > std::numeric_limits<int>::max()) fail(fn, "a_rows is too large for int32");
  check_native_experts(fn, p.schedule, p.num_experts);
}


void check_varlen_k(const VarlenKParams& p) {
  const char* fn = "varlen_k_gemm";
  check_sizes(fn, p.num_experts, {{"m", p.m}, {"n", p.n}}, p.rows);
  if (p.p_gather && p.p_rows <= 0) fail(fn, "p_rows must be positive with p_gather");
  if (p.q_gather && p.q_rows <= 0) fail(fn, "q_rows must be positive with q_gather");
  if (p.p_rows > std::numeric_limits<int>::max() || p.q_rows > std::numeric_limits<int>::max())
    fail(fn, "p_rows / q_rows are too large for int32");
  if (p.schedule == Schedule::cutlass_pingpong) fail(fn, "varlen-K runs native or cutlass_cooperative");
  check_native_experts(fn, p.schedule, p.num_experts);
  check_ptr(fn, "p", p.p, p.rows > 0);  // no rows: D is all zeros, P and Q may be empty (null)
  check_ptr(fn, "q", p.q, p.rows > 0);
  check_ptr(fn, "d", p.d, true);
  if (!p.offsets) fail(fn, "offsets must not be null");
}

void check_workspace(const char* fn, void* ws, std::size_t have, std::size_t need) {
  if (have < need)
    fail(fn, "workspace_bytes is " + std::to_string(have) + ", needs " + std::to_string(need));
  if (need > 0 && (!ws || reinterpret_cast<std::uintptr_t>(ws) % 256 != 0))
    fail(fn, "workspace must be non-null and 256-byte aligned");
}

}  // namespace

void gather_rows(const __nv_bfloat16* src, const std::int32_t* idx, std::int64_t rows, std::int64_t cols,
                 const std::int32_t* valid_rows, __nv_bfloat16* dst, cudaStream_t stream) {
  check_dim("gather_rows", "cols", cols, true);
  check_ptr("gather_rows", "src", src, true);
  check_ptr("gather_rows", "dst", dst, true);
  if (!idx) fail("gather_rows", "idx must not be null");
  if (rows <= 0) return;
  const int vpr = static_cast<int>(cols / 8);
  gather_rows_kernel<<<grid_for(rows * vpr, 256), 256, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), idx, rows, vpr, valid_rows, reinterpret_cast<uint4*>(dst));
  SONICMOE_CUDA_CHECK_LAUNCH();
}

namespace {

std::size_t varlen_m_gemm_workspace(const VarlenMParams& p, Schedule s, int sms) {
  const int g = static_cast<int>(p.num_experts);
  return round_up(p.b_kn ? detail::varlen_m_kn_cutlass_workspace(g, sms) : detail::varlen_m_cutlass_workspace(s, g, sms));
}

// The native kernel needs no workspace; the CUTLASS path needs its group arrays and the gathered rows of A.
std::size_t varlen_m_workspace_checked(const VarlenMParams& p) {
  check_varlen_m(p);
  const Schedule s = p.schedule;
  if (is_native(s)) return 0;
  std::size_t bytes = varlen_m_gemm_workspace(p, s, sm_count());
  if (p.gather) bytes += round_up(static_cast<std::size_t>(p.rows) * p.k * sizeof(__nv_bfloat16));
  return bytes;
}

}  // namespace

NativeVarlenM native_args(const VarlenMParams& p) {
  NativeVarlenM g;  // by name: the struct has fields (b_w1_concat) that a positional list would shift
  g.a = p.a;
  g.a_rows = p.gather ? p.a_rows : p.rows;
  g.gather = p.gather;
  g.b = p.b;
  g.b_kn = p.b_kn;
  g.offsets = p.offsets;
  g.rows = p.rows;
  g.num_experts = static_cast<int>(p.num_experts);
  g.n = static_cast<int>(p.n);
  g.k = static_cast<int>(p.k);
  g.stream = p.stream;
  return g;
}

std::size_t varlen_m_workspace_bytes(const VarlenMParams& p) { return varlen_m_workspace_checked(p); }

void varlen_m_gemm(const VarlenMParams& p) {
  const char* fn = "varlen_m_gemm";
  const std::size_t need = varlen_m_workspace_checked(p);
  check_workspace(fn, p.workspace, p.workspace_bytes, need);
  if (p.rows == 0) return;
  const Schedule sched = p.schedule;
  if (is_native(sched)) return native_varlen_m_store(native_args(p), p.c, p.bias, p.row_scale);
  const int sms = sm_count();
  const std::size_t gemm_ws = varlen_m_gemm_workspace(p, sched, sms);
  const __nv_bfloat16* a = p.a;
  if (p.gather) {
    auto* ga = reinterpret_cast<__nv_bfloat16*>(static_cast<char*>(p.workspace) + gemm_ws);
    gather_rows(p.a, p.gather, p.rows, p.k, p.offsets + p.num_experts, ga, p.stream);
    a = ga;
  }
  detail::GroupedArgs args{a, p.b, p.c, p.offsets, static_cast<int>(p.num_experts), 0, static_cast<int>(p.n),
                           static_cast<int>(p.k)};
  if (p.b_kn) detail::varlen_m_kn_run(args, p.workspace, sms, p.stream);
  else detail::varlen_m_run(sched, args, p.workspace, sms, p.stream);
  if (p.bias || p.row_scale) {
    const int vpr = static_cast<int>(p.n / 8);
    bias_scale_kernel<<<grid_for(p.rows * vpr, 256), 256, 0, p.stream>>>(p.c, p.bias, p.row_scale, p.offsets,
                                                                         static_cast<int>(p.num_experts), vpr);
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
}

std::size_t varlen_k_workspace_bytes(const VarlenKParams& p) {
  check_varlen_k(p);
  if (is_native(p.schedule)) return 0;
  std::size_t bytes = round_up(detail::varlen_k_cutlass_workspace(static_cast<int>(p.num_experts), sm_count()));
  if (p.p_gather) bytes += round_up(static_cast<std::size_t>(p.rows) * p.m * sizeof(__nv_bfloat16));
  if (p.q_gather) bytes += round_up(static_cast<std::size_t>(p.rows) * p.n * sizeof(__nv_bfloat16));
  return bytes;
}

void varlen_k_gemm(const VarlenKParams& p) {
  const char* fn = "varlen_k_gemm";
  check_varlen_k(p);
  if (is_native(p.schedule)) {
    NativeVarlenK g;  // by name: the struct has fields (d_w1_concat) that a positional list would shift
    g.p = p.p;
    g.p_rows = p.p_gather ? p.p_rows : p.rows;
    g.p_gather = p.p_gather;
    g.q = p.q;
    g.q_rows = p.q_gather ? p.q_rows : p.rows;
    g.q_gather = p.q_gather;
    g.d = p.d;
    g.offsets = p.offsets;
    g.rows = p.rows;
    g.num_experts = static_cast<int>(p.num_experts);
    g.m = static_cast<int>(p.m);
    g.n = static_cast<int>(p.n);
    g.stream = p.stream;
    return native_varlen_k(g);
  }
  const int sms = sm_count();
  const std::size_t gemm_ws = round_up(detail::varlen_k_cutlass_workspace(static_cast<int>(p.num_experts), sms));
  const std::size_t p_bytes = p.p_gather ? round_up(static_cast<std::size_t>(p.rows) * p.m * 2) : 0;
  const std::size_t q_bytes = p.q_gather ? round_up(static_cast<std::size_t>(p.rows) * p.n * 2) : 0;
  check_workspace(fn, p.workspace, p.workspace_bytes, gemm_ws + p_bytes + q_bytes);
  const std::int64_t vec_per_expert = p.m * p.n / 8;
  {
    dim3 grid(static_cast<unsigned>(grid_for(vec_per_expert, 256) > 64 ? 64 : grid_for(vec_per_expert, 256)),
              static_cast<unsigned>(p.num_experts));
    zero_empty_experts_kernel<<<grid, 256, 0, p.stream>>>(p.d, p.offsets, vec_per_expert);
    SONICMOE_CUDA_CHECK_LAUNCH();
  }
  if (p.rows == 0) return;
  const __nv_bfloat16* pp = p.p;
  const __nv_bfloat16* qq = p.q;
  char* ws = static_cast<char*>(p.workspace) + gemm_ws;
  if (p.p_gather) {
    auto* gp = reinterpret_cast<__nv_bfloat16*>(ws);
    gather_rows(p.p, p.p_gather, p.rows, p.m, p.offsets + p.num_experts, gp, p.stream);
    pp = gp;
  }
  if (p.q_gather) {
    auto* gq = reinterpret_cast<__nv_bfloat16*>(ws + p_bytes);
    gather_rows(p.q, p.q_gather, p.rows, p.n, p.offsets + p.num_experts, gq, p.stream);
    qq = gq;
  }
  detail::GroupedArgs args{pp, qq, p.d, p.offsets, static_cast<int>(p.num_experts), static_cast<int>(p.m),
                           static_cast<int>(p.n), 0};
  detail::varlen_k_run(args, p.workspace, sms, p.stream);
}

}  // namespace sonicmoe::baselines

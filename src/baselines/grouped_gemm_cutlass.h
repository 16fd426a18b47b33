// Baseline (not in the library; target sonicmoe_baselines, linked by tests and tools only): the grouped GEMMs on raw
// device pointers with a choice of kernel, so that tests and benchmarks run the library's native kernels
// (Schedule::native, through cuda/gemm/native_gemm.h) and CUTLASS's ptr-array grouped GEMM on the same arguments
// (DESIGN.md section 5). They validate sizes and alignment (sonicmoe::Error naming the argument), launch on
// `stream`, and never synchronise the host; group sizes are read on the device from `offsets[E+1]`.
// bf16 operands, fp32 accumulation, bf16 outputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/native_gemm.h"

namespace sonicmoe::baselines {

using cuda::gemm::NativeVarlenK;
using cuda::gemm::NativeVarlenM;

// Which persistent warp-specialised kernel runs the GEMM: the library's native kernel (src/cuda/gemm/
// kernel_sm90_varlen_m.cuh: device tile scheduler, TMA or cp.async-gathered A, epilogue warpgroup, no
// workspace) or CUTLASS's ptr-array grouped GEMM (per-group descriptors built on the device, gathered A
// materialised by a separate pass), the baseline the benchmarks measure against.
enum class Schedule { native, cutlass_cooperative, cutlass_pingpong };
inline bool is_native(Schedule s) { return s == Schedule::native; }

// varlen-M: C[r, :] = scale[r] * (A[g(r), :] . B[e(r)]^T + bias[e(r)])   (B[e(r)] without ^T when b_kn)   for r < offsets[E],
// g(r) = gather[r] (or r when no gather), e(r) the expert whose range [offsets[e], offsets[e+1]) holds r.
// Rows r >= offsets[E] of C are left untouched.
struct VarlenMParams {
  const __nv_bfloat16* a = nullptr;  // A_full [a_rows, k]
  std::int64_t a_rows = 0;
  const std::int32_t* gather = nullptr;  // optional [rows]: values in [0, a_rows)
  const __nv_bfloat16* b = nullptr;      // [num_experts, n, k] (the weight layout)
  const __nv_bfloat16* bias = nullptr;   // optional [num_experts, n]
  const float* row_scale = nullptr;      // optional [rows]
  __nv_bfloat16* c = nullptr;            // [rows, n]
  const std::int32_t* offsets = nullptr;  // device [num_experts + 1], offsets[E] <= rows
  std::int64_t rows = 0;                  // capacity of C (and of gather)
  std::int64_t num_experts = 0, n = 0, k = 0;
  bool b_kn = false;  // B stored [num_experts, k, n] instead of [E, n, k] (not with cutlass_pingpong)
  // native needs num_experts <= kGemmMaxExperts (src/cuda/cuda_limits.h).
  Schedule schedule = Schedule::native;
  void* workspace = nullptr;  // varlen_m_workspace_bytes(*this) bytes, 256-byte aligned
  std::size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

// varlen-K (weight gradients): D[e] (m x n) = sum over r in [offsets[e], offsets[e+1]) of P[gp(r), :]^T Q[gq(r), :],
// gp(r) = p_gather[r] (or r), gq likewise. Experts with no rows get zeros.
struct VarlenKParams {
  const __nv_bfloat16* p = nullptr;  // [p_rows, m]
  std::int64_t p_rows = 0;
  const std::int32_t* p_gather = nullptr;  // optional [rows]
  const __nv_bfloat16* q = nullptr;        // [q_rows, n]
  std::int64_t q_rows = 0;
  const std::int32_t* q_gather = nullptr;  // optional [rows]
  __nv_bfloat16* d = nullptr;            // [num_experts, m, n]
  const std::int32_t* offsets = nullptr;  // device [num_experts + 1]
  std::int64_t rows = 0;
  std::int64_t num_experts = 0, m = 0, n = 0;
  // native: kernel_sm90_varlen_k.cuh (gathers in its mainloop, no workspace; rows past offsets[E] are never
  // read into the sum). cutlass_cooperative: CUTLASS ptr-array on gathered copies.
  Schedule schedule = Schedule::native;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

std::size_t varlen_m_workspace_bytes(const VarlenMParams& p);
// The arguments of the native kernel for these parameters (no checks).
NativeVarlenM native_args(const VarlenMParams& p);
void varlen_m_gemm(const VarlenMParams& p);

std::size_t varlen_k_workspace_bytes(const VarlenKParams& p);
void varlen_k_gemm(const VarlenKParams& p);

// Row gather with 16-byte vectors: dst[r, :] = src[idx[r], :] for r < *valid_rows (all `rows` when null).
void gather_rows(const __nv_bfloat16* src, const std::int32_t* idx, std::int64_t rows, std::int64_t cols,
                 const std::int32_t* valid_rows, __nv_bfloat16* dst, cudaStream_t stream);

namespace detail {
// One grouped CUTLASS kernel over per-expert problems built on the device from `offsets`.
// varlen-M: A [*, k] rows offsets[e].., B [E, n, k], D [*, n].  varlen-K: A^T with A [*, m], B [*, n], D [E, m, n].
struct GroupedArgs {
  const void* a;
  const void* b;
  void* d;
  const std::int32_t* offsets;
  int groups;
  int m, n, k;  // varlen-M: n, k used; varlen-K: m, n used
};
std::size_t varlen_m_cutlass_workspace(Schedule s, int groups, int sm_count);
void varlen_m_run(Schedule s, const GroupedArgs& args, void* workspace, int sm_count, cudaStream_t stream);
std::size_t varlen_m_kn_cutlass_workspace(int groups, int sm_count);
void varlen_m_kn_run(const GroupedArgs& args, void* workspace, int sm_count, cudaStream_t stream);
std::size_t varlen_k_cutlass_workspace(int groups, int sm_count);
void varlen_k_run(const GroupedArgs& args, void* workspace, int sm_count, cudaStream_t stream);
}  // namespace detail

}  // namespace sonicmoe::baselines

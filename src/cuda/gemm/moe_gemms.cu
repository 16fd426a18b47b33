// The cuda backend's GEMM stages (DESIGN.md steps 4, 5, 7, 8, 9, 10a) on the grouped GEMM engine:
// up_projection (X rows gathered in the mainloop, Z and A = act(Z) written by the epilogue), down_projection,
// dgated (dO rows gathered in the mainloop, A recomputed from Z, dZ, s*A and the per-row <G, A> partials in the
// epilogue, then a deterministic per-row reduce), weight_grad_w1 / weight_grad_w2 (bias gradients by a
// per-expert column reduction), expert_input_grad. The three that touch W1 (steps 4, 9, 10a) read / write it in the
// caller's W1Layout without a copy (w1_layout_sm90.cuh): concatenated and separate are one descriptor with runtime
// part / expert strides (separate: the [2, E, I, H] view of w1_separate_view, part stride up - gate).
// Each stage fills the one argument struct of its kernel family (gemm::NativeVarlenM / NativeVarlenK, native_gemm.h)
// and calls its entry; sizes arrive checked against cuda_limits.h (src/moe/stages.cpp). bf16 or f16 storage (one type
// per call: the kernels instantiated for each, NativeVarlenM::elem); f32 refused.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "core/cuda_check.h"
#include "cuda/cuda_backend.h"
#include "cuda/elementwise/expert_bias_grad.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/launch_util.h"
#include "moe/w1_layout.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

using bf = __nv_bfloat16;

// A tensor argument and its name in error messages.
struct Named {
  const char* name;
  const TensorView& t;
};

// t in the 16-bit type dt (the call's first tensor's: bf16 or f16), contiguous.
void require_16bit(const char* fn, const char* name, const TensorView& t, DType dt) {
  if (!is_16bit_float(t.dtype))
    throw Error(std::string("sonicmoe::") + fn + ": the cuda backend supports bf16 or f16 storage; " + name + " is " +
                dtype_name(t.dtype));
  if (t.dtype != dt)
    throw Error(std::string("sonicmoe::") + fn + ": " + name + " is " + dtype_name(t.dtype) + ", expected " +
                dtype_name(dt) + " like the call's other tensors");
  if (!t.is_contiguous()) throw Error(std::string("sonicmoe::") + fn + ": " + name + " must be contiguous");
}

// The required tensors in order, then the optional ones that are given; all in the first one's 16-bit type, which
// is returned (the element type of the call's kernels).
DType require_16bit(const char* fn, std::initializer_list<Named> required, std::initializer_list<Named> optional = {}) {
  const DType dt = required.begin()->t.dtype;
  for (const Named& a : required) require_16bit(fn, a.name, a.t, dt);
  for (const Named& a : optional)
    if (a.t.given()) require_16bit(fn, a.name, a.t, dt);
  return dt;
}

// The bias-gradient reduction (expert_bias_grad.h) in the storage type dt.
void bias_grad(DType dt, const TensorView& src, const std::int32_t* idx, const float* scale, const std::int32_t* pair,
               std::int64_t rows, std::int64_t C, const std::int32_t* offsets, int E, const TensorView& db,
               cudaStream_t stream, BiasGradOut out = {}) {
  if (dt == DType::f16)
    expert_bias_grad(src.ptr<const __half>(), idx, scale, pair, rows, C, offsets, E, db.ptr<__half>(), stream, out);
  else
    expert_bias_grad(src.ptr<const bf>(), idx, scale, pair, rows, C, offsets, E, db.ptr<bf>(), stream, out);
}

template <class T>
T* ptr_or_null(const TensorView& t) {
  return t.given() ? t.ptr<T>() : nullptr;
}

const std::int32_t* offsets_of(const RoutingMetadata& m) { return m.offsets.ptr<const std::int32_t>(); }

// A W1-shaped operand (w1, b1, dw1, db1) in the layout l: of the call's 16-bit type dt and contiguous, or under
// separate a [2, ...] view of two contiguous parts (stages.cpp checked the part stride).
void require_w1_16bit(const char* fn, const char* name, const TensorView& t, W1Layout l, DType dt) {
  if (!t.given()) return;
  if (l != W1Layout::separate) return require_16bit(fn, name, t, dt);
  require_16bit(fn, name, w1_part(t, 0), dt);
  require_16bit(fn, name, w1_part(t, 1), dt);
}
// The part and expert strides (elements) of a W1-shaped operand in two parts; {0, 0} (the concatenated default of
// the kernels, w1_layout_sm90.cuh) unless separate, whose [2, E, ...] view carries them.
std::pair<std::int64_t, std::int64_t> w1_part_strides(const TensorView& t, W1Layout l) {
  if (l != W1Layout::separate || !t.given()) return {0, 0};
  return {t.stride[0], t.stride[1]};
}

// How a row operand is read: through meta.gather (the token's rows, [T, .]) or row by row ([N, .]).
enum class Rows { gathered, contiguous };
// How B (the weight) is stored per expert: [n, k] (the weight layout) or [k, n] (read transposed).
enum class BLayout { nk, kn };

// The varlen-M GEMM over the routing's rows r < N: C[r] = A[g(r)] B[e(r)]^T, C [N, n], k = A's columns. The one
// argument struct of the family, read by the launcher (kernel_sm90_varlen_m.cuh); the epilogue's outputs are the
// entry's own arguments (native_gemm.h).
gemm::NativeVarlenM varlen_m_args(const Context& ctx, const RoutingMetadata& meta, const TensorView& a, Rows a_rows,
                                  const TensorView& b, BLayout b_layout, std::int64_t n) {
  const bool gathered = a_rows == Rows::gathered;
  gemm::NativeVarlenM g;
  g.elem = a.dtype;
  g.a = a.ptr<const bf>();
  g.a_rows = gathered ? a.shape[0] : meta.num_pairs;
  g.gather = gathered ? meta.gather.ptr<const std::int32_t>() : nullptr;
  g.b = b.ptr<const bf>();
  g.b_kn = b_layout == BLayout::kn;
  g.offsets = offsets_of(meta);
  g.rows = meta.num_pairs;
  g.num_experts = static_cast<int>(meta.num_experts);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(a.shape[1]);
  g.stream = stream_of(ctx);
  return g;
}

// The varlen-K GEMM over the routing's rows: D[e] = sum over rows r of e of P[gp(r)]^T Q[gq(r)], D [E, m, n] with m,
// n the columns of P and Q (d_write accumulate: D f32, D[e] += it). The one argument struct of the family (kernel_sm90_varlen_k.cuh).
gemm::NativeVarlenK varlen_k_args(const Context& ctx, const RoutingMetadata& meta, const TensorView& p_op,
                                  Rows p_rows, const TensorView& q_op, Rows q_rows, const TensorView& d,
                                  GradWrite d_write) {
  const bool p_gathered = p_rows == Rows::gathered, q_gathered = q_rows == Rows::gathered;
  gemm::NativeVarlenK g;
  g.elem = p_op.dtype;
  g.p = p_op.ptr<const bf>();
  g.p_rows = p_gathered ? p_op.shape[0] : meta.num_pairs;
  g.p_gather = p_gathered ? meta.gather.ptr<const std::int32_t>() : nullptr;
  g.q = q_op.ptr<const bf>();
  g.q_rows = q_gathered ? q_op.shape[0] : meta.num_pairs;
  g.q_gather = q_gathered ? meta.gather.ptr<const std::int32_t>() : nullptr;
  if (d_write == GradWrite::accumulate) g.d_f32 = d.ptr<float>();  // D += P^T Q in fp32
  else g.d = d.ptr<bf>();
  g.offsets = offsets_of(meta);
  g.rows = meta.num_pairs;
  g.num_experts = static_cast<int>(meta.num_experts);
  g.m = static_cast<int>(p_op.shape[1]);
  g.n = static_cast<int>(q_op.shape[1]);
  g.stream = stream_of(ctx);
  return g;
}

}  // namespace

// Step 4: Z = X[gather] W1[e]^T (+ b1), A = act(Z), both written by the epilogue.
// Under W1Layout::concatenated or separate W1 (and b1) are read in the interleaved order through the 4-mode TMA
// descriptor (w1_layout_sm90.cuh): Z comes out interleaved, bitwise as from the interleaved W1.
void up_projection(const Context& ctx, Activation act, const TensorView& x, const TensorView& w1,
                   const TensorView& b1, const RoutingMetadata& meta, const TensorView& z, const TensorView& a,
                   W1Layout w1_layout) {
  const char* fn = "up_projection";
  const DType dt = require_16bit(fn, {{"x", x}, {"z", z}, {"a", a}});
  require_w1_16bit(fn, "w1", w1, w1_layout, dt);
  require_w1_16bit(fn, "b1", b1, w1_layout, dt);
  if (meta.num_pairs == 0) return;
  gemm::NativeVarlenM g = varlen_m_args(ctx, meta, x, Rows::gathered, w1, BLayout::nk, /*n=*/z.shape[1]);
  g.b_w1_concat = w1_layout != W1Layout::interleaved;
  std::tie(g.b_w1_part_stride, g.b_w1_expert_stride) = w1_part_strides(w1, w1_layout);
  gemm::W1BiasStrides bs;
  std::tie(bs.part, bs.expert) = w1_part_strides(b1, w1_layout);
  gemm::native_varlen_m_activation(g, act, ptr_or_null<const bf>(b1), z.ptr<bf>(), a.ptr<bf>(), bs);
}

// Step 5: Y = A W2[e]^T (+ b2).
void down_projection(const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y) {
  const char* fn = "down_projection";
  require_16bit(fn, {{"a", a}, {"w2", w2}, {"y", y}}, {{"b2", b2}});
  if (meta.num_pairs == 0) return;
  gemm::native_varlen_m_store(varlen_m_args(ctx, meta, a, Rows::contiguous, w2, BLayout::nk, y.shape[1]), y.ptr<bf>(),
                              ptr_or_null<const bf>(b2), /*row_scale=*/nullptr);
}

// Step 10a: dXe = dZ W1[e], W1[e] read as [k = z_width, n = H].
void expert_input_grad(const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe, W1Layout w1_layout) {
  const char* fn = "expert_input_grad";
  const DType dt = require_16bit(fn, {{"dz", dz}, {"dxe", dxe}});
  require_w1_16bit(fn, "w1", w1, w1_layout, dt);
  if (meta.num_pairs == 0) return;
  gemm::NativeVarlenM g = varlen_m_args(ctx, meta, dz, Rows::contiguous, w1, BLayout::kn, dxe.shape[1]);
  g.b_w1_concat = w1_layout != W1Layout::interleaved;  // W1 in two parts, read in dZ's interleaved order
  std::tie(g.b_w1_part_stride, g.b_w1_expert_stride) = w1_part_strides(w1, w1_layout);
  gemm::native_varlen_m_store(g, dxe.ptr<bf>(), /*bias=*/nullptr, /*row_scale=*/nullptr);
}

namespace {
// Step 7: G = dO[gather] W2[e] (W2[e] is [H, I] = [k, n]) never reaches global memory (bf16 through shared
// memory to the epilogue warps), which write dZ, s*A and
// per-(row, N tile) partials of <G, A>, reduced per row (+ <dO, b2>) into dscore[pair[r]] in a fixed order.
void dgated_fused(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                  const TensorView& b2, const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta,
                  const TensorView& dz, const TensorView& as, const TensorView& dscore) {
  const std::int64_t N = meta.num_pairs, H = d_out.shape[1], I = w2.shape[2];
  const gemm::NativeVarlenM g = varlen_m_args(ctx, meta, d_out, Rows::gathered, w2, BLayout::kn, I);
  const int n_tiles = gemm::native_dgated_n_tiles(static_cast<int>(I));
  Tensor partial = Tensor::empty({n_tiles, N}, DType::f32, ctx.device(), ctx.allocator, ctx.stream);
  gemm::native_varlen_m_dgated(g, act, z.ptr<const bf>(), pair_score.ptr<const float>(),
                               meta.pair.ptr<const std::int32_t>(), dz.ptr<bf>(), ptr_or_null<bf>(as),
                               partial.ptr<float>());
  gemm::dgated_score_reduce(partial.ptr<const float>(), n_tiles, N, meta.pair.ptr<const std::int32_t>(),
                            offsets_of(meta), static_cast<int>(meta.num_experts),
                            b2.given() ? d_out.ptr<const bf>() : nullptr,
                            b2.given() ? meta.gather.ptr<const std::int32_t>() : nullptr, ptr_or_null<const bf>(b2),
                            H, dscore.ptr<float>(), stream_of(ctx), d_out.dtype);
}

}  // namespace

void dgated(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2, const TensorView& b2,
            const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,
            const TensorView& as, const TensorView& dscore) {
  require_16bit("dgated", {{"d_out", d_out}, {"w2", w2}, {"z", z}, {"dz", dz}, {"as", as}}, {{"b2", b2}});
  if (meta.num_pairs == 0) return;
  dgated_fused(ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
}

// Step 9: dW1[e] = sum over rows r of e of dZ[r]^T X[gather[r]] (X's rows gathered in the mainloop); db1 from dZ.
// Under W1Layout::concatenated or separate dW1 and db1 are written in that layout (the varlen-K epilogue's store twin
// of the two-part W1 descriptor; the bias reduction's column remap): the interleaved values, in other places.
void weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1, W1Layout w1_layout, GradWrite dw_write) {
  const DType dt = require_16bit("weight_grad_w1", {{"dz", dz}, {"x", x}});
  const bool accumulate = dw_write == GradWrite::accumulate;  // dw1 f32 (checked by the stage), added into
  if (!accumulate) require_w1_16bit("weight_grad_w1", "dw1", dw1, w1_layout, dt);
  require_w1_16bit("weight_grad_w1", "db1", db1, w1_layout, dt);
  gemm::NativeVarlenK g = varlen_k_args(ctx, meta, dz, Rows::contiguous, x, Rows::gathered, dw1, dw_write);
  g.d_w1_concat = w1_layout != W1Layout::interleaved;
  // (accumulate: interleaved or concatenated, whose strides the kernel derives; w1_part_strides reads 16-bit ones)
  if (!accumulate) std::tie(g.d_w1_part_stride, g.d_w1_expert_stride) = w1_part_strides(dw1, w1_layout);
  gemm::native_varlen_k(g);
  if (db1.given()) {
    const std::int64_t ZW = dz.shape[1];
    BiasGradOut out;  // interleaved: {0, 0}; concatenated: halves of ZW / 2; separate: the [2, E, I] view's strides
    if (w1_layout == W1Layout::concatenated) out = {ZW / 2, ZW};
    else if (w1_layout == W1Layout::separate) out = {db1.stride[0], db1.stride[1]};
    bias_grad(dt, dz, nullptr, nullptr, nullptr, meta.num_pairs, ZW, offsets_of(meta),
              static_cast<int>(meta.num_experts), db1, stream_of(ctx), out);
  }
}

// Step 8: dW2[e] = sum over rows r of e of dO[gather[r]]^T As[r] (the rows of dO gathered in the mainloop);
// db2 from dO through the gather.
void weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2, GradWrite dw_write) {
  const DType dt = dw_write == GradWrite::accumulate  // dw2 f32 (checked by the stage), added into
                       ? require_16bit("weight_grad_w2", {{"d_out", d_out}, {"as", as}}, {{"db2", db2}})
                       : require_16bit("weight_grad_w2", {{"d_out", d_out}, {"as", as}, {"dw2", dw2}}, {{"db2", db2}});
  gemm::native_varlen_k(varlen_k_args(ctx, meta, d_out, Rows::gathered, as, Rows::contiguous, dw2, dw_write));
  if (db2.given())
    bias_grad(dt, d_out, meta.gather.ptr<const std::int32_t>(), pair_score.ptr<const float>(),
              meta.pair.ptr<const std::int32_t>(), meta.num_pairs, d_out.shape[1], offsets_of(meta),
              static_cast<int>(meta.num_experts), db2, stream_of(ctx));
}

}  // namespace sonicmoe::cuda

// The cuda backend's GEMM stages (DESIGN.md steps 4, 5, 7, 8, 9, 10a) on the grouped GEMM engine:
// up_projection (X rows gathered in the mainloop, Z and A = act(Z) written by the epilogue), down_projection,
// dgated (dO rows gathered in the mainloop, A recomputed from Z, dZ, s*A and the per-row <G, A> partials in the
// epilogue, then a deterministic per-row reduce), weight_grad_w1 / weight_grad_w2 (bias gradients by a
// per-expert column reduction), expert_input_grad.
// bf16 only; workspaces come from the context's allocator, stream-ordered, freed after the launches.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <utility>

#include "core/cuda_check.h"
#include "cuda/cuda_backend.h"
#include "cuda/elementwise/moe_elementwise.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/launch_util.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda {
namespace {

using bf = __nv_bfloat16;

void require_bf16(const char* fn, const char* name, const TensorView& t) {
  if (t.dtype != DType::bf16)
    throw Error(std::string("sonicmoe::") + fn + ": the cuda backend supports bf16 only; " + name + " is f32");
  if (!t.is_contiguous()) throw Error(std::string("sonicmoe::") + fn + ": " + name + " must be contiguous");
}

// Device scratch for one call, returned to the allocator (stream-ordered) when it goes out of scope.
Tensor scratch(const Context& ctx, std::size_t bytes) {
  return Tensor::empty({static_cast<std::int64_t>((bytes + 3) / 4)}, DType::i32, ctx.device(), ctx.allocator,
                       ctx.stream);
}

const std::int32_t* offsets_of(const RoutingMetadata& m) { return m.offsets.ptr<const std::int32_t>(); }

void run_varlen_m(const Context& ctx, gemm::VarlenMParams p) {
  p.stream = stream_of(ctx);
  const std::size_t bytes = gemm::varlen_m_workspace_bytes(p);  // 0 on the native kernel
  Tensor ws = bytes ? scratch(ctx, bytes) : Tensor();
  p.workspace = bytes ? ws.data() : nullptr;
  p.workspace_bytes = bytes;
  gemm::varlen_m_gemm(p);
}

void run_varlen_k(const Context& ctx, gemm::VarlenKParams p) {
  p.stream = stream_of(ctx);
  const std::size_t bytes = gemm::varlen_k_workspace_bytes(p);  // 0 on the native kernel
  Tensor ws = bytes ? scratch(ctx, bytes) : Tensor();
  p.workspace = bytes ? ws.data() : nullptr;
  p.workspace_bytes = bytes;
  gemm::varlen_k_gemm(p);
}

// The fused stages run only on the native kernel, whose scheduler holds per-expert arrays in shared memory.
void check_native(const char* fn, const gemm::VarlenMParams& p) {
  if (p.num_experts > gemm::kNativeMaxExperts)
    throw Error(std::string("sonicmoe::") + fn + ": num_experts = " + std::to_string(p.num_experts) +
                " exceeds the cuda backend's limit of " + std::to_string(gemm::kNativeMaxExperts));
  (void)gemm::varlen_m_workspace_bytes(p);  // shape / alignment checks (the native kernel needs no workspace)
}

}  // namespace

void up_projection(const Context& ctx, Activation act, const TensorView& x, const TensorView& w1,
                   const TensorView& b1, const RoutingMetadata& meta, const TensorView& z, const TensorView& a) {
  const char* fn = "up_projection";
  require_bf16(fn, "x", x);
  require_bf16(fn, "w1", w1);
  require_bf16(fn, "z", z);
  require_bf16(fn, "a", a);
  if (b1.given()) require_bf16(fn, "b1", b1);
  gemm::VarlenMParams p;
  p.a = x.ptr<const bf>();
  p.a_rows = x.shape[0];
  p.gather = meta.gather.ptr<const std::int32_t>();
  p.b = w1.ptr<const bf>();
  p.c = z.ptr<bf>();
  p.offsets = offsets_of(meta);
  p.rows = meta.num_pairs;
  p.num_experts = meta.num_experts;
  p.n = z.shape[1];
  p.k = x.shape[1];
  p.stream = stream_of(ctx);
  check_native(fn, p);
  if (meta.num_pairs == 0) return;
  gemm::native_varlen_m_activation(gemm::native_args(p), act, b1.given() ? b1.ptr<const bf>() : nullptr, z.ptr<bf>(),
                                   a.ptr<bf>());
}

void down_projection(const Context& ctx, const TensorView& a, const TensorView& w2, const TensorView& b2,
                     const RoutingMetadata& meta, const TensorView& y) {
  const char* fn = "down_projection";
  require_bf16(fn, "a", a);
  require_bf16(fn, "w2", w2);
  require_bf16(fn, "y", y);
  if (b2.given()) require_bf16(fn, "b2", b2);
  gemm::VarlenMParams p;
  p.a = a.ptr<const bf>();
  p.a_rows = meta.num_pairs;
  p.b = w2.ptr<const bf>();
  p.bias = b2.given() ? b2.ptr<const bf>() : nullptr;
  p.c = y.ptr<bf>();
  p.offsets = offsets_of(meta);
  p.rows = meta.num_pairs;
  p.num_experts = meta.num_experts;
  p.n = y.shape[1];
  p.k = a.shape[1];
  run_varlen_m(ctx, p);
}

void expert_input_grad(const Context& ctx, const TensorView& dz, const TensorView& w1, const RoutingMetadata& meta,
                       const TensorView& dxe) {
  const char* fn = "expert_input_grad";
  require_bf16(fn, "dz", dz);
  require_bf16(fn, "w1", w1);
  require_bf16(fn, "dxe", dxe);
  gemm::VarlenMParams p;
  p.a = dz.ptr<const bf>();
  p.a_rows = meta.num_pairs;
  p.b = w1.ptr<const bf>();
  p.b_kn = true;  // W1[e] is [z_width, H] = [k, n]
  p.c = dxe.ptr<bf>();
  p.offsets = offsets_of(meta);
  p.rows = meta.num_pairs;
  p.num_experts = meta.num_experts;
  p.n = dxe.shape[1];
  p.k = dz.shape[1];
  run_varlen_m(ctx, p);
}

namespace {
// Step 7: G = dO[gather] W2[e] (W2[e] is [H, I] = [k, n]) never reaches global memory (bf16 through shared
// memory to the epilogue warps), which write dZ, s*A and
// per-(row, N tile) partials of <G, A>, reduced per row (+ <dO, b2>) into dscore[pair[r]] in a fixed order.
void dgated_fused(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                  const TensorView& b2, const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta,
                  const TensorView& dz, const TensorView& as, const TensorView& dscore) {
  const std::int64_t N = meta.num_pairs, H = d_out.shape[1], I = w2.shape[2];
  gemm::VarlenMParams p;
  p.a = d_out.ptr<const bf>();
  p.a_rows = d_out.shape[0];
  p.gather = meta.gather.ptr<const std::int32_t>();
  p.b = w2.ptr<const bf>();
  p.b_kn = true;
  p.c = dz.ptr<bf>();  // no C is written; the shape / alignment checks of check_native see dz in its place
  p.offsets = offsets_of(meta);
  p.rows = N;
  p.num_experts = meta.num_experts;
  p.n = I;
  p.k = H;
  p.stream = stream_of(ctx);
  check_native("dgated", p);
  const int n_tiles = gemm::native_dgated_n_tiles(static_cast<int>(I));
  Tensor partial = Tensor::empty({n_tiles, N}, DType::f32, ctx.device(), ctx.allocator, ctx.stream);
  gemm::native_varlen_m_dgated(gemm::native_args(p), act, z.ptr<const bf>(), pair_score.ptr<const float>(),
                               meta.pair.ptr<const std::int32_t>(), dz.ptr<bf>(), as.given() ? as.ptr<bf>() : nullptr,
                               partial.ptr<float>());
  gemm::dgated_score_reduce(partial.ptr<const float>(), n_tiles, N, meta.pair.ptr<const std::int32_t>(),
                            offsets_of(meta), static_cast<int>(meta.num_experts),
                            b2.given() ? d_out.ptr<const bf>() : nullptr,
                            b2.given() ? meta.gather.ptr<const std::int32_t>() : nullptr,
                            b2.given() ? b2.ptr<const bf>() : nullptr, H, dscore.ptr<float>(), stream_of(ctx));
}

}  // namespace

void dgated(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2, const TensorView& b2,
            const TensorView& z, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,
            const TensorView& as, const TensorView& dscore) {
  const char* fn = "dgated";
  for (auto [name, t] : {std::pair{"d_out", &d_out}, {"w2", &w2}, {"z", &z}, {"dz", &dz}, {"as", &as}})
    require_bf16(fn, name, *t);
  if (b2.given()) require_bf16(fn, "b2", b2);
  if (meta.num_pairs == 0) return;
  dgated_fused(ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
}

// Steps 7 and 8: both GEMMs gather the rows of dO inside their mainloops.
void dgated_and_weight_grad_w2(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                               const TensorView& b2, const TensorView& z, const TensorView& pair_score,
                               const RoutingMetadata& meta, const TensorView& dz, const TensorView& as,
                               const TensorView& dscore, const TensorView& dw2, const TensorView& db2) {
  cuda::dgated(ctx, act, d_out, w2, b2, z, pair_score, meta, dz, as, dscore);
  cuda::weight_grad_w2(ctx, d_out, as, pair_score, meta, dw2, db2);
}

void weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                    const TensorView& dw1, const TensorView& db1) {
  const char* fn = "weight_grad_w1";
  require_bf16(fn, "dz", dz);
  require_bf16(fn, "x", x);
  require_bf16(fn, "dw1", dw1);
  if (db1.given()) require_bf16(fn, "db1", db1);
  gemm::VarlenKParams p;
  p.p = dz.ptr<const bf>();
  p.p_rows = meta.num_pairs;
  p.q = x.ptr<const bf>();
  p.q_rows = x.shape[0];
  p.q_gather = meta.gather.ptr<const std::int32_t>();
  p.d = dw1.ptr<bf>();
  p.offsets = offsets_of(meta);
  p.rows = meta.num_pairs;
  p.num_experts = meta.num_experts;
  p.m = dz.shape[1];
  p.n = x.shape[1];
  run_varlen_k(ctx, p);
  if (db1.given())
    expert_bias_grad(dz.ptr<const bf>(), nullptr, nullptr, nullptr, meta.num_pairs, dz.shape[1], offsets_of(meta),
                     static_cast<int>(meta.num_experts), db1.ptr<bf>(), stream_of(ctx));
}

void weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as, const TensorView& pair_score,
                    const RoutingMetadata& meta, const TensorView& dw2, const TensorView& db2) {
  const char* fn = "weight_grad_w2";
  require_bf16(fn, "d_out", d_out);
  require_bf16(fn, "as", as);
  require_bf16(fn, "dw2", dw2);
  if (db2.given()) require_bf16(fn, "db2", db2);
  // Step 8: dW2[e] = sum over rows r of e of dO[gather[r]]^T As[r] (the rows of dO gathered in the mainloop);
  // db2 from dO through the gather.
  gemm::VarlenKParams p;
  p.p = d_out.ptr<const bf>();
  p.p_rows = d_out.shape[0];
  p.p_gather = meta.gather.ptr<const std::int32_t>();
  p.q = as.ptr<const bf>();
  p.q_rows = meta.num_pairs;
  p.d = dw2.ptr<bf>();
  p.offsets = offsets_of(meta);
  p.rows = meta.num_pairs;
  p.num_experts = meta.num_experts;
  p.m = d_out.shape[1];
  p.n = as.shape[1];
  run_varlen_k(ctx, p);
  if (db2.given())
    expert_bias_grad(d_out.ptr<const bf>(), meta.gather.ptr<const std::int32_t>(), pair_score.ptr<const float>(),
                     meta.pair.ptr<const std::int32_t>(), meta.num_pairs, d_out.shape[1], offsets_of(meta),
                     static_cast<int>(meta.num_experts), db2.ptr<bf>(), stream_of(ctx));
}

}  // namespace sonicmoe::cuda

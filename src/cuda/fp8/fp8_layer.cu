// The FP8 blockwise layer's expert part on the cuda backend (src/cuda/fp8/fp8_layer.h): DESIGN.md steps 4-10 under
// precision fp8_blockwise, mirroring the CPU reference's stages (src/reference/fp8_stages_ref.cpp) one call each.
// Operands: X quantised 1x128 into the routing's row order (each token's codes written to its rows; or once per
// token, the GEMM gathering its rows: heuristics.h fp8_up_in_place), dO once per token (the gathered GEMM rows read
// their token's codes and scale);
// W1 / W2 128x128 (their transposed copies and transposed scale grids for steps 7 and 10a: made in the training
// forward's quantisation pass and kept in the saved state, or the caller's pre-quantised ones); A, Z and dZ
// quantised 1x128. Where the GPU rounds differently from the reference (docs/ALGORITHM.md, "The FP8 layer on the GPU"):
// Z, A and dZ are quantised from their bf16 values (Z and dZ in the epilogues of the GEMMs that make them, A by the
// 1x128 quantiser; the reference quantises the fp32 epilogue values), and the bias term <dO, b2> of dscore reads the
// unquantised dO. Every buffer comes from the context's allocator on its stream and is dropped after its last use.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "core/context_alloc.h"
#include "moe/grad_buffers.h"
#include "cuda/fp8/fp8_layer.h"
#include "cuda/fp8/fp8_weight_grads.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/heuristics.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/launch_util.h"
#include "cuda/quant/quant.h"
#include "moe/fp8_weights.h"
#include "sonicmoe/error.h"
#include "sonicmoe/stages.h"

namespace sonicmoe::cuda {

namespace {

using bf = __nv_bfloat16;


template <class T>
const T* ptr_or_null(const TensorView& t) {
  return t.given() ? t.ptr<const T>() : nullptr;
}

// An activation operand quantised 1x128: codes [M, C] and scales [M, C / 128].
struct Rows1x128 {
  Tensor q, scale;
};
Rows1x128 quantize_rows(const Context& ctx, const TensorView& x) {
  const std::int64_t M = x.shape[0], C = x.shape[1];
  Rows1x128 r{alloc_on(ctx, {M, C}, DType::f8e4m3), alloc_on(ctx, {M, fp8_num_blocks(C)}, DType::f32)};
  cuda::fp8_quantize_rows(ctx, x, TensorView(), r.q, r.scale);
  return r;
}

// X [T, H] quantised 1x128 into the routing's row order: [N, H] codes, row r holding token gather[r]'s blocks
// (fp8_quantize_rows_scatter: each token read once, its codes written to its rows).
Rows1x128 quantize_rows_in_place(const Context& ctx, const TensorView& x, const RoutingMetadata& meta) {
  const std::int64_t N = meta.num_pairs, C = x.shape[1];
  Rows1x128 r{alloc_on(ctx, {N, C}, DType::f8e4m3), alloc_on(ctx, {N, fp8_num_blocks(C)}, DType::f32)};
  cuda::fp8_quantize_rows_scatter(ctx, x, meta.token_offsets, meta.rev, r.q, r.scale);
  return r;
}

// The FP8 varlen-M GEMM over the routing's rows: C[r] = A[g(r)] B[e(r)]^T, A's rows gathered by meta.gather
// (a [T, k] operand quantised once per token) or read row by row ([N, k]); B [E, n, k] with scales [E, n/128, k/128].
gemm::Fp8VarlenM fp8_params(const Context& ctx, const RoutingMetadata& meta, const Fp8Rows& a, bool gathered,
                            const Tensor& b, const Tensor& b_scale) {
  gemm::Fp8VarlenM g;
  g.a = a.q.ptr<const std::uint8_t>();
  g.a_scale = a.scale.ptr<const float>();
  g.a_rows = gathered ? a.q.size(0) : meta.num_pairs;
  g.gather = gathered ? meta.gather.ptr<const std::int32_t>() : nullptr;
  g.b = b.ptr<const std::uint8_t>();
  g.b_scale = b_scale.ptr<const float>();
  g.offsets = meta.offsets.ptr<const std::int32_t>();
  g.rows = meta.num_pairs;
  g.num_experts = static_cast<int>(meta.num_experts);
  g.n = static_cast<int>(b.size(1));
  g.k = static_cast<int>(a.q.size(1));
  g.stream = stream_of(ctx);
  return g;
}
gemm::Fp8VarlenM fp8_params(const Context& ctx, const RoutingMetadata& meta, const Rows1x128& a, bool gathered,
                            const Tensor& b, const Tensor& b_scale) {
  return fp8_params(ctx, meta, Fp8Rows{a.q.view(), a.scale.view()}, gathered, b, b_scale);
}

// The bf16 dgated GEMM's arguments (MoEConfig::dgated_precision bf16): dO [T, H] rows gathered, W2 [E, H, I] as
// [E, k, n].
gemm::NativeVarlenM bf16_dgated_params(const Context& ctx, const RoutingMetadata& meta, const TensorView& d_out,
                                       const TensorView& w2) {
  gemm::NativeVarlenM g;
  g.a = d_out.ptr<const bf>();
  g.a_rows = d_out.shape[0];
  g.gather = meta.gather.ptr<const std::int32_t>();
  g.b = w2.ptr<const bf>();
  g.b_kn = true;
  g.offsets = meta.offsets.ptr<const std::int32_t>();
  g.rows = meta.num_pairs;
  g.num_experts = static_cast<int>(meta.num_experts);
  g.n = static_cast<int>(w2.shape[2]);
  g.k = static_cast<int>(d_out.shape[1]);
  g.stream = stream_of(ctx);
  return g;
}

// What this backend's FP8 layer cannot take, as an Error naming it (the shapes themselves are the layer's checks).
void check_supported(const char* fn, const MoEConfig& cfg, const TensorView& x) {
  if (x.dtype != DType::bf16)
    throw Error(std::string("sonicmoe::") + fn + ": the cuda backend supports bf16 only; x is " + dtype_name(x.dtype));
  if (cfg.num_experts > gemm::kNativeMaxExperts)
    throw Error(std::string("sonicmoe::") + fn + ": num_experts = " + std::to_string(cfg.num_experts) +
                " exceeds the cuda backend's limit of " + std::to_string(gemm::kNativeMaxExperts));
}

}  // namespace

Tensor fp8_experts_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                           const Routing& r, SavedState* saved, const Fp8Rows* xq_given) {
  const char* fn = saved ? "moe_forward" : "moe_inference";
  check_supported(fn, cfg, x);
  const RoutingMetadata& meta = r.meta;
  const std::int64_t T = x.shape[0], H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  const std::int64_t N = meta.num_pairs;
  // The caller's pre-quantised weights, or each weight quantised here just before its GEMM: with its transposed
  // copy in a training forward where the backward reads it (one pass writes both; the copies go into the saved state
  // for the backward).
  const bool own = !w.fp8, keep_t = own && saved != nullptr;
  Fp8ExpertWeights wq;
  if (own) fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/true, keep_t, wq);
  else wq = fp8_layer_weights(fn, ctx, cfg, w, /*transposed=*/false);
  Tensor y;
  {
    Rows1x128 aq;
    {
      Tensor a = alloc_on(ctx, {N, I}, DType::bf16), z;
      // The saved Z (none in inference): 1x128 FP8 from the GEMM's epilogue, or bf16 quantised after it (z_pass)
      gemm::Fp8ZOut zout;
      const bool z_pass = saved && !gemm::fp8_z_in_epilogue();  // heuristics.h
      if (z_pass) {
        z = alloc_on(ctx, {N, ZW}, DType::bf16);
        zout.z = z.ptr<bf>();
      } else if (saved) {
        saved->z_fp8 = alloc_on(ctx, {N, ZW}, DType::f8e4m3);
        saved->z_scale = alloc_on(ctx, {N, fp8_num_blocks(ZW)}, DType::f32);
        zout.q = saved->z_fp8.ptr<std::uint8_t>();
        zout.scale = saved->z_scale.ptr<float>();
      }
      {
        // X quantised straight into the routing's row order for the GEMM's wide tile (heuristics.h,
        // fp8_up_in_place), or once per token (or the caller's quantised rows) with the GEMM gathering its rows
        const bool in_place = xq_given == nullptr && gemm::fp8_up_in_place(ZW);
        Rows1x128 own_xq;
        if (in_place) own_xq = quantize_rows_in_place(ctx, x, meta);
        else if (xq_given == nullptr) own_xq = quantize_rows(ctx, x);
        const Fp8Rows xq = xq_given ? *xq_given : Fp8Rows{own_xq.q.view(), own_xq.scale.view()};
        if (N > 0)  // step 4: Z = Xq W1q^T (+ b1) as zout asks, A = act(Z) bf16
          gemm::fp8_varlen_m_activation(fp8_params(ctx, meta, xq, /*gathered=*/!in_place, wq.w1, wq.w1_scale),
                                        cfg.activation, ptr_or_null<bf>(w.b1), zout, a.ptr<bf>());
      }
      wq.w1 = wq.w1_scale = Tensor();  // W1 is done
      if (z_pass) {
        Rows1x128 zq = quantize_rows(ctx, z);
        saved->z_fp8 = zq.q;
        saved->z_scale = zq.scale;
        z = Tensor();
      }
      aq = quantize_rows(ctx, a);  // the down-projection's operand
    }
    if (own) fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/false, keep_t, wq);  // W2^T where the backward reads it
    y = alloc_on(ctx, {N, H}, DType::bf16);
    if (N > 0)  // step 5: Y = Aq W2q^T (+ b2)
      gemm::fp8_varlen_m_store(fp8_params(ctx, meta, aq, /*gathered=*/false, wq.w2, wq.w2_scale), y.ptr<bf>(),
                               ptr_or_null<bf>(w.b2), nullptr);
    wq.w2 = wq.w2_scale = Tensor();  // W2 is done
  }
  if (keep_t) {  // the backward's operands, quantised once
    saved->w1_t_fp8 = wq.w1_t;
    saved->w1_t_scale = wq.w1_scale_t;
    saved->w2_t_fp8 = wq.w2_t;
    saved->w2_t_scale = wq.w2_scale_t;
  }
  wq = Fp8ExpertWeights();
  Tensor out = alloc_on(ctx, {T, H}, DType::bf16);
  sonicmoe::aggregate(ctx, y, r.pair_score, meta, out);  // step 6, as under bf16
  return out;
}

void fp8_experts_backward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const SavedState& saved, const TensorView& d_out, Gradients& g, bool reuse_z) {
  const char* fn = "moe_backward";
  check_supported(fn, cfg, x);
  const Routing& r = saved.routing;
  const RoutingMetadata& meta = r.meta;
  const std::int64_t H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width(), N = meta.num_pairs;
  // W1^T and W2^T: the caller's, the forward's kept copies, or quantised here.
  Fp8ExpertWeights wq = fp8_backward_weights(fn, ctx, cfg, w, saved);
  const DType dt = x.dtype;
  // Steps 8 and 9 with FP8 operands (fp8_weight_grads.h) or bf16 ones (the bf16 layer's stages).
  const bool fp8_wgrad = cfg.weight_grad_precision == Precision::fp8_blockwise;
  const cuda::Fp8Segments seg = fp8_wgrad ? cuda::fp8_weight_grad_segments(ctx, meta) : cuda::Fp8Segments{};
  // dZ from the dgated epilogue, which reads the saved FP8 Z itself: bf16 for the weight gradient dW1 (and db1), 1x128
  // codes and scales for dXe's GEMM (step 10a), over the saved Z's when the caller gave Z up (reuse_z).
  Tensor dz = alloc_on(ctx, {N, ZW}, DType::bf16);
  Rows1x128 dzq = reuse_z ? Rows1x128{saved.z_fp8, saved.z_scale}
                          : Rows1x128{alloc_on(ctx, {N, ZW}, DType::f8e4m3),
                                      alloc_on(ctx, {N, fp8_num_blocks(ZW)}, DType::f32)};
  {
    Tensor as = alloc_on(ctx, {N, I}, DType::bf16);
    if (N > 0) {  // step 7: G = dO W2^T (FP8 or bf16 operands), dZ, As, dscore
      const bool fp8_dgated = cfg.dgated_precision == Precision::fp8_blockwise;
      const int n_tiles = fp8_dgated ? gemm::fp8_dgated_n_tiles(static_cast<int>(I))
                                     : gemm::native_dgated_n_tiles(static_cast<int>(I));
      Tensor partial = alloc_on(ctx, {n_tiles, N}, DType::f32);
      const gemm::Fp8ZIn zin{saved.z_fp8.ptr<const std::uint8_t>(), saved.z_scale.ptr<const float>()};
      const bool dz_epilogue = gemm::fp8_dz_in_epilogue();  // else the quantiser after the GEMM (heuristics.h)
      const gemm::Fp8ZOut dzout = dz_epilogue
                                      ? gemm::Fp8ZOut{dz.ptr<bf>(), dzq.q.ptr<std::uint8_t>(), dzq.scale.ptr<float>()}
                                      : gemm::Fp8ZOut{dz.ptr<bf>()};
      if (fp8_dgated) {
        // dO once per token (the GEMM gathers its rows), W2's transposed copy [E, I, H]
        const Rows1x128 doq = quantize_rows(ctx, d_out);
        gemm::fp8_varlen_m_dgated(fp8_params(ctx, meta, doq, /*gathered=*/true, wq.w2_t, wq.w2_scale_t),
                                  cfg.activation, zin, r.pair_score.ptr<const float>(),
                                  meta.pair.ptr<const std::int32_t>(), dzout, as.ptr<bf>(), partial.ptr<float>());
      } else {  // the stored dO (rows gathered) and W2 [E, H, I] read as [E, k, n]
        gemm::bf16_varlen_m_dgated_fp8z(bf16_dgated_params(ctx, meta, d_out, w.w2), cfg.activation, zin,
                                        r.pair_score.ptr<const float>(), meta.pair.ptr<const std::int32_t>(), dzout,
                                        as.ptr<bf>(), partial.ptr<float>());
      }
      if (!dz_epilogue) cuda::fp8_quantize_rows(ctx, dz, TensorView(), dzq.q, dzq.scale);
      const bool bias = w.b2.given();
      gemm::dgated_score_reduce(partial.ptr<const float>(), n_tiles, N, meta.pair.ptr<const std::int32_t>(),
                                meta.offsets.ptr<const std::int32_t>(), static_cast<int>(meta.num_experts),
                                bias ? d_out.ptr<const bf>() : nullptr,
                                bias ? meta.gather.ptr<const std::int32_t>() : nullptr, ptr_or_null<bf>(w.b2), H,
                                g.dscore.ptr<float>(), stream_of(ctx));
    }
    const DwTarget d2 = alloc_dw2(ctx, cfg, dt, w, g);  // step 8
    if (fp8_wgrad) cuda::fp8_weight_grad_w2(ctx, d_out, as, r.pair_score, meta, seg, d2.view, g.db2, d2.write);
    else sonicmoe::weight_grad_w2(ctx, d_out, as, r.pair_score, meta, d2.view, g.db2, d2.write);
  }
  g.dx = alloc_on(ctx, {x.shape[0], H}, dt);
  {
    Tensor dxe = alloc_on(ctx, {N, H}, DType::bf16);
    if (N > 0)  // step 10a: dXe = dZq W1q (W1's transposed copy [E, H, z_width])
      gemm::fp8_varlen_m_store(fp8_params(ctx, meta, dzq, /*gathered=*/false, wq.w1_t, wq.w1_scale_t), dxe.ptr<bf>(),
                               nullptr, nullptr);
    dzq = Rows1x128();
    sonicmoe::aggregate(ctx, dxe, TensorView(), meta, g.dx);  // step 10b
  }
  const DwTarget d1 = alloc_dw1(ctx, cfg, dt, w, g);  // after dXe is gone; step 9
  if (fp8_wgrad) cuda::fp8_weight_grad_w1(ctx, dz, x, meta, seg, d1.view, g.db1, d1.write);
  else sonicmoe::weight_grad_w1(ctx, dz, x, meta, d1.view, g.db1, W1Layout::interleaved, d1.write);
}

}  // namespace sonicmoe::cuda

// fp8_quantize_expert_weights (sonicmoe/quant.h) and the check of pre-quantised weights (src/moe/fp8_weights.h).
#include "moe/fp8_weights.h"

#include <array>
#include <string>

#include "core/check.h"
#include "core/context_alloc.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/quant/dequant.h"
#endif

namespace sonicmoe {

namespace {

using check::Arg;


// s_t[e, j, i] = s[e, i, j] on ctx's backend.
void transpose_scales(const Context& ctx, const Tensor& s, const Tensor& s_t) {
#ifdef SONICMOE_WITH_CUDA
  if (ctx.backend == Backend::cuda) {
    cuda::fp8_transpose_scales(ctx, s, s_t);
    return;
  }
#else
  (void)ctx;
#endif
  const std::int64_t E = s.size(0), R = s.size(1), C = s.size(2);
  const float* a = s.ptr<const float>();
  float* b = s_t.ptr<float>();
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < R; ++i)
      for (std::int64_t j = 0; j < C; ++j) b[(e * C + j) * R + i] = a[(e * R + i) * C + j];
}

// One weight W [E, N, K]: codes, scales and, when wanted, the transposed copy and its scales.
void quantize_weight(const Context& ctx, const TensorView& w, bool transposed, Tensor& q, Tensor& q_t, Tensor& s,
                     Tensor& s_t) {
  const std::int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  q = alloc_on(ctx, {E, N, K}, DType::f8e4m3);
  s = alloc_on(ctx, {E, fp8_num_blocks(N), fp8_num_blocks(K)}, DType::f32);
  if (transposed) q_t = alloc_on(ctx, {E, K, N}, DType::f8e4m3);
  fp8_quantize_blocks(ctx, w, q, transposed ? TensorView(q_t) : TensorView(), s);
  if (!transposed) return;
  s_t = alloc_on(ctx, {E, fp8_num_blocks(K), fp8_num_blocks(N)}, DType::f32);
  transpose_scales(ctx, s, s_t);
}

void check_codes(const char* fn, const Context& ctx, const char* name, const Tensor& t,
                 std::initializer_list<std::int64_t> shape, const char* desc, DType dt) {
  Arg a(fn, name, t);
  a.given().dtype(dt).shape(shape, desc).on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cuda) a.aligned(16);
}

// The transposed copies W1^T [E, H, z_width] and W2^T [E, I, H] (codes) with their scale grids, named by `names` in
// that order (`codes_note` follows the codes' shapes in the message); W2^T only where the backward reads it
// (fp8_backward_reads_w2_t).
void check_transposed(const char* fn, const Context& ctx, const MoEConfig& cfg, const std::array<const char*, 4>& names,
                      const std::array<const Tensor*, 4>& t, const char* codes_note) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  const std::int64_t hb = H / kFp8BlockSize, ib = I / kFp8BlockSize, zb = ZW / kFp8BlockSize;
  check_codes(fn, ctx, names[0], *t[0], {E, H, ZW}, (std::string("[E, H, z_width]") + codes_note).c_str(), DType::f8e4m3);
  check_codes(fn, ctx, names[1], *t[1], {E, hb, zb}, "[E, H/128, z_width/128]", DType::f32);
  if (!fp8_backward_reads_w2_t(cfg)) return;
  check_codes(fn, ctx, names[2], *t[2], {E, I, H}, (std::string("[E, I, H]") + codes_note).c_str(), DType::f8e4m3);
  check_codes(fn, ctx, names[3], *t[3], {E, ib, hb}, "[E, I/128, H/128]", DType::f32);
}

}  // namespace

void fp8_quantize_layer_weight(const Context& ctx, const MoEConfig& cfg, const MoEWeights& w, bool w1,
                               bool transposed, Fp8ExpertWeights& q) {
  // (the caller has checked w1 / w2 against cfg)
  if (w1) quantize_weight(ctx, w.w1, transposed, q.w1, q.w1_t, q.w1_scale, q.w1_scale_t);
  else quantize_weight(ctx, w.w2, transposed && fp8_backward_reads_w2_t(cfg), q.w2, q.w2_t, q.w2_scale, q.w2_scale_t);
}

Fp8ExpertWeights fp8_quantize_expert_weights(const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                             bool transposed) {
  const char* fn = "fp8_quantize_expert_weights";
  check::backend(ctx, fn);
  validate_config(cfg);
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  for (auto [name, v] : {std::pair{"hidden_size", H}, {"intermediate_size", I}})
    SONICMOE_CHECK(v % kFp8BlockSize == 0, "sonicmoe::", fn, ": config.", name, " = ", v,
                   " cannot be quantised: it must be a multiple of ", kFp8BlockSize, " (the FP8 block size)");
  { Arg a(fn, "w1", w.w1); a.given().float_dtype().shape({E, ZW, H}, "[E, z_width, H]").on(ctx.device()).contiguous(); }
  { Arg a(fn, "w2", w.w2); a.given().float_dtype().shape({E, H, I}, "[E, H, I]").on(ctx.device()).contiguous(); }
  Fp8ExpertWeights q;
  fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/true, transposed, q);
  fp8_quantize_layer_weight(ctx, cfg, w, /*w1=*/false, transposed, q);
  return q;
}

Fp8ExpertWeights fp8_layer_weights(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                   bool transposed) {
  if (!w.fp8) return fp8_quantize_expert_weights(ctx, cfg, w, transposed);
  const Fp8ExpertWeights& q = *w.fp8;
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  const std::int64_t hb = H / kFp8BlockSize, ib = I / kFp8BlockSize, zb = ZW / kFp8BlockSize;
  const DType f8 = DType::f8e4m3, f32 = DType::f32;
  check_codes(fn, ctx, "w.fp8->w1", q.w1, {E, ZW, H}, "[E, z_width, H]", f8);
  check_codes(fn, ctx, "w.fp8->w1_scale", q.w1_scale, {E, zb, hb}, "[E, z_width/128, H/128]", f32);
  check_codes(fn, ctx, "w.fp8->w2", q.w2, {E, H, I}, "[E, H, I]", f8);
  check_codes(fn, ctx, "w.fp8->w2_scale", q.w2_scale, {E, hb, ib}, "[E, H/128, I/128]", f32);
  if (transposed)
    check_transposed(fn, ctx, cfg, {"w.fp8->w1_t", "w.fp8->w1_scale_t", "w.fp8->w2_t", "w.fp8->w2_scale_t"},
                     {&q.w1_t, &q.w1_scale_t, &q.w2_t, &q.w2_scale_t}, " (made with transposed = true)");
  return q;
}

bool fp8_backward_reads_w2_t(const MoEConfig& cfg) { return cfg.dgated_precision == Precision::fp8_blockwise; }

bool fp8_backward_quantises(const MoEWeights& w, const SavedState& saved) {
  return !w.fp8 && !saved.w1_t_fp8.defined();
}

Fp8ExpertWeights fp8_backward_weights(const char* fn, const Context& ctx, const MoEConfig& cfg, const MoEWeights& w,
                                      const SavedState& saved) {
  Fp8ExpertWeights q;
  if (w.fp8) {
    q = fp8_layer_weights(fn, ctx, cfg, w, /*transposed=*/true);
  } else if (saved.w1_t_fp8.defined()) {  // the forward's own quantisation, kept for this backward
    check_transposed(fn, ctx, cfg, {"saved.w1_t_fp8", "saved.w1_t_scale", "saved.w2_t_fp8", "saved.w2_t_scale"},
                     {&saved.w1_t_fp8, &saved.w1_t_scale, &saved.w2_t_fp8, &saved.w2_t_scale}, "");
    q.w1_t = saved.w1_t_fp8;
    q.w1_scale_t = saved.w1_t_scale;
    q.w2_t = saved.w2_t_fp8;
    q.w2_scale_t = saved.w2_t_scale;
  } else {
    q = fp8_quantize_expert_weights(ctx, cfg, w, /*transposed=*/true);
  }
  q.w1 = q.w1_scale = q.w2 = q.w2_scale = Tensor();  // the backward reads the transposed copies only
  if (!fp8_backward_reads_w2_t(cfg)) q.w2_t = q.w2_scale_t = Tensor();  // and W2^T only for FP8 dgated operands
  return q;
}

}  // namespace sonicmoe

// The FP8 layer's stages on the CPU reference backend (src/reference/fp8_layer_ref.h): FP8 operands dequantised
// exactly to fp32, then the bf16 reference stage of src/reference/expert_ref.cpp on them; FP8 outputs quantised
// from the fp32 values.
#include <cstring>
#include <numeric>

#include "reference/fp8_layer_ref.h"
#include "reference/fp8_ref.h"
#include "reference/matrix.h"
#include "reference/reference.h"

namespace sonicmoe::ref {

namespace {

std::vector<std::int64_t> dims(const TensorView& v) { return {v.shape.begin(), v.shape.begin() + v.ndim}; }
Tensor f32_like(const TensorView& v) { return Tensor::empty(dims(v), DType::f32); }

// The metadata of the gathered operand: the same rows and experts, gather = identity (row r reads row r).
RoutingMetadata identity_gather(const RoutingMetadata& meta) {
  RoutingMetadata m = meta;
  m.num_tokens = meta.num_pairs;
  m.gather = Tensor::empty({meta.num_pairs}, DType::i32);
  std::iota(m.gather.ptr<std::int32_t>(), m.gather.ptr<std::int32_t>() + meta.num_pairs, 0);
  return m;
}

// Rows of v [*, C] in sorted-row order (gathered by meta.gather when `gathered`), each expert's rows quantised
// 128x1 along the row (token) dimension by the transposed-copy quantiser, and dequantised: f32 [N, C].
Tensor fake_quant_cols_per_expert(const Context& ctx, const TensorView& v, const RoutingMetadata& meta,
                                  bool gathered) {
  const std::int64_t N = meta.num_pairs, C = v.shape[1];
  const std::int32_t* off = meta.offsets.ptr<const std::int32_t>();
  Tensor out = Tensor::empty({N, C}, DType::f32);
  for (std::int64_t e = 0; e < meta.num_experts; ++e) {
    const std::int64_t row0 = off[e], rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    Tensor seg = Tensor::empty({rows, C}, DType::f32);
    store_rows(seg, 0, load_rows(v, row0, rows, gathered ? meta.gather.ptr<const std::int32_t>() + row0 : nullptr));
    Fp8Tensor t{Tensor::empty({C, rows}, DType::f8e4m3), Tensor::empty({C, fp8_num_blocks(rows)}, DType::f32), 1,
                static_cast<int>(kFp8BlockSize)};
    ref::fp8_quantize_cols_transposed(ctx, seg, t.q, t.scale);
    store_rows(out, row0, MatF(load_rows(t.dequantize(), 0, C).transpose()));
  }
  return out;
}

}  // namespace

Tensor Fp8Tensor::dequantize() const { return fp8_dequantize(q, scale, block_rows, block_cols); }

Fp8Tensor fp8_quant_rows(const TensorView& x) {
  const std::int64_t M = x.shape[0], C = x.shape[1];
  Fp8Tensor t{Tensor::empty({M, C}, DType::f8e4m3), Tensor::empty({M, fp8_num_blocks(C)}, DType::f32), 1,
              static_cast<int>(kFp8BlockSize)};
  ref::fp8_quantize_rows(Context{}, x, TensorView(), t.q, t.scale);
  return t;
}

Fp8Tensor fp8_rows_copy(const Fp8Rows& rows) {
  const std::int64_t M = rows.q.shape[0], C = rows.q.shape[1];
  Fp8Tensor t{Tensor::empty({M, C}, DType::f8e4m3), Tensor::empty({M, fp8_num_blocks(C)}, DType::f32), 1,
              static_cast<int>(kFp8BlockSize)};
  std::memcpy(t.q.data(), rows.q.data, rows.q.nbytes());
  std::memcpy(t.scale.data(), rows.scale.data, rows.scale.nbytes());
  return t;
}

Fp8Tensor fp8_quant_weight(const TensorView& w) {
  const std::int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  const int b = static_cast<int>(kFp8BlockSize);
  Fp8Tensor t{Tensor::empty({E, N, K}, DType::f8e4m3),
              Tensor::empty({E, fp8_num_blocks(N), fp8_num_blocks(K)}, DType::f32), b, b};
  ref::fp8_quantize_blocks(Context{}, w, t.q, TensorView(), t.scale);
  return t;
}

void fp8_up_projection(const Context& ctx, Activation act, const Fp8Tensor& xq, const Fp8Tensor& w1q,
                       const TensorView& b1, const RoutingMetadata& meta, Fp8Tensor* z_out, Fp8Tensor& a_out) {
  const std::int64_t N = meta.num_pairs, ZW = w1q.q.size(1);
  Tensor z = Tensor::empty({N, ZW}, DType::f32), a = Tensor::empty({N, is_glu(act) ? ZW / 2 : ZW}, DType::f32);
  // fp32 epilogue values
  ref::up_projection(ctx, act, xq.dequantize(), w1q.dequantize(), b1, meta, z, a, W1Layout::interleaved);
  if (z_out) *z_out = fp8_quant_rows(z);
  a_out = fp8_quant_rows(a);
}

void fp8_down_projection(const Context& ctx, const Fp8Tensor& aq, const Fp8Tensor& w2q, const TensorView& b2,
                         const RoutingMetadata& meta, const TensorView& y) {
  ref::down_projection(ctx, aq.dequantize(), w2q.dequantize(), b2, meta, y);
}

// Step 7 on d_out and w2 as given (the stored tensors; fp8_dgated passes its dequantised operands) and the saved Z
// dequantised: the bf16 stage's formulas, dZ quantised 1x128 from its fp32 values.
void bf16_dgated_fp8_z(const Context& ctx, Activation act, const TensorView& d_out, const TensorView& w2,
                       const TensorView& b2, const Fp8Tensor& zq, const TensorView& pair_score,
                       const RoutingMetadata& meta, const TensorView& dz, Fp8Tensor& dz_out, const TensorView& as,
                       const TensorView& dscore) {
  Tensor dz32 = f32_like(dz);
  ref::dgated(ctx, act, d_out, w2, b2, zq.dequantize(), pair_score, meta, dz32, as, dscore);
  dz_out = fp8_quant_rows(dz32);
  store_rows(dz, 0, load_rows(dz32, 0, dz32.size(0)));  // rounded to dz's dtype
}

void fp8_dgated(const Context& ctx, Activation act, const Fp8Tensor& doq, const Fp8Tensor& w2q, const TensorView& b2,
                const Fp8Tensor& zq, const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dz,
                Fp8Tensor& dz_out, const TensorView& as, const TensorView& dscore) {
  const Tensor d_out = doq.dequantize(), w2 = w2q.dequantize();
  bf16_dgated_fp8_z(ctx, act, d_out, w2, b2, zq, pair_score, meta, dz, dz_out, as, dscore);
}

void fp8_expert_input_grad(const Context& ctx, const Fp8Tensor& dzq, const Fp8Tensor& w1q,
                           const RoutingMetadata& meta, const TensorView& dxe) {
  ref::expert_input_grad(ctx, dzq.dequantize(), w1q.dequantize(), meta, dxe, W1Layout::interleaved);
}

namespace {

// The bias gradients read the unquantised operands, summed as the bf16 stages sum them (bias_sum): db[e] = sum over
// rows r of e of (pair_score ? s[pair[r]] : 1) * v[gather ? gather[r] : r].
void bias_grad_unquantised(const TensorView& v, const std::int32_t* gather, const TensorView& pair_score,
                           const RoutingMetadata& meta, const TensorView& db) {
  const std::int32_t* off = meta.offsets.ptr<const std::int32_t>();
  const std::int32_t* pair = meta.pair.ptr<const std::int32_t>();
  const float* score = pair_score.given() ? pair_score.ptr<const float>() : nullptr;
  for (std::int64_t e = 0; e < meta.num_experts; ++e) {
    const std::int64_t row0 = off[e], rows = off[e + 1] - off[e];
    const MatF m = load_rows(v, gather ? 0 : row0, rows, gather ? gather + row0 : nullptr);
    store_rows(db, e, bias_sum(m, score, pair + row0));
  }
}

}  // namespace

void fp8_weight_grad_w2(const Context& ctx, const TensorView& d_out, const TensorView& as,
                        const TensorView& pair_score, const RoutingMetadata& meta, const TensorView& dw2,
                        const TensorView& db2, GradWrite dw_write) {
  ref::weight_grad_w2(ctx, fake_quant_cols_per_expert(ctx, d_out, meta, /*gathered=*/true),
                      fake_quant_cols_per_expert(ctx, as, meta, false), pair_score, identity_gather(meta), dw2,
                      TensorView(), dw_write);
  if (db2.given()) bias_grad_unquantised(d_out, meta.gather.ptr<const std::int32_t>(), pair_score, meta, db2);
}

void fp8_weight_grad_w1(const Context& ctx, const TensorView& dz, const TensorView& x, const RoutingMetadata& meta,
                        const TensorView& dw1, const TensorView& db1, GradWrite dw_write) {
  ref::weight_grad_w1(ctx, fake_quant_cols_per_expert(ctx, dz, meta, false),
                      fake_quant_cols_per_expert(ctx, x, meta, /*gathered=*/true), identity_gather(meta), dw1,
                      TensorView(), W1Layout::interleaved, dw_write);
  if (db1.given()) bias_grad_unquantised(dz, nullptr, TensorView(), meta, db1);
}

}  // namespace sonicmoe::ref

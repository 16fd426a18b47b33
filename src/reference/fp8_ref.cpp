// CPU reference of the FP8 blockwise quantisers (docs/ALGORITHM.md, "FP8 blockwise recipe"). Every quantiser is the
// one 2-D core below with a block shape; transposed copies are the transpose of the codes and scales (a code
// depends only on its value and its block's scale).
#include "reference/fp8_ref.h"

#include <algorithm>
#include <vector>

#include "core/fp8_e4m3.h"
#include "sonicmoe/error.h"

namespace sonicmoe::ref {

namespace {

// x (bf16 or f32, contiguous) as fp32.
std::vector<float> to_f32(const TensorView& x, std::int64_t offset, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  if (x.dtype == DType::bf16)
    for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(x.ptr<const bf16>()[offset + i]);
  else
    std::copy_n(x.ptr<const float>() + offset, n, out.begin());
  return out;
}

template <typename T>
void transpose(const T* in, std::int64_t R, std::int64_t C, T* out) {
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) out[c * R + r] = in[r * C + c];
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace

void fp8_quantize_2d(const float* x, std::int64_t R, std::int64_t C, int block_rows, int block_cols, std::uint8_t* q,
                     float* scale) {
  const std::int64_t nbr = ceil_div(R, block_rows), nbc = ceil_div(C, block_cols);
#pragma omp parallel for collapse(2) if (R * C > (1 << 16))
  for (std::int64_t br = 0; br < nbr; ++br)
    for (std::int64_t bc = 0; bc < nbc; ++bc) {
      const std::int64_t r0 = br * block_rows, r1 = std::min(R, r0 + block_rows);
      const std::int64_t c0 = bc * block_cols, c1 = std::min(C, c0 + block_cols);
      std::uint32_t amax = 0;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, fp8::abs_bits(x[r * C + c]));
      const fp8::BlockScale s = fp8::block_scale(amax);
      scale[br * nbc + bc] = s.scale;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c)
          q[r * C + c] = s.finite ? fp8::e4m3_encode(x[r * C + c] * s.inv) : fp8::kE4m3NaN;
    }
}

void fp8_dequantize_2d(const std::uint8_t* q, const float* scale, std::int64_t R, std::int64_t C, int block_rows,
                       int block_cols, float* out) {
  const std::int64_t nbc = ceil_div(C, block_cols);
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c)
      out[r * C + c] = fp8::e4m3_decode(q[r * C + c]) * scale[(r / block_rows) * nbc + c / block_cols];
}

void fp8_fake_quant_2d(float* x, std::int64_t R, std::int64_t C, int block_rows, int block_cols) {
  std::vector<std::uint8_t> q(static_cast<std::size_t>(R * C));
  std::vector<float> s(static_cast<std::size_t>(ceil_div(R, block_rows) * ceil_div(C, block_cols)));
  fp8_quantize_2d(x, R, C, block_rows, block_cols, q.data(), s.data());
  fp8_dequantize_2d(q.data(), s.data(), R, C, block_rows, block_cols, x);
}

void fp8_quantize_rows(const Context&, const TensorView& x, const TensorView& rows, const TensorView& q,
                       const TensorView& scale) {
  const std::int64_t K = x.shape[1], M = q.shape[0];
  std::vector<float> xr(static_cast<std::size_t>(M * K));
  for (std::int64_t i = 0; i < M; ++i) {
    const std::int64_t src = rows.given() ? rows.ptr<const std::int32_t>()[i] : i;
    const std::vector<float> row = to_f32(x, src * K, K);
    std::copy(row.begin(), row.end(), xr.begin() + i * K);
  }
  fp8_quantize_2d(xr.data(), M, K, 1, fp8::kBlock, q.ptr<std::uint8_t>(), scale.ptr<float>());
}

void fp8_quantize_cols_transposed(const Context&, const TensorView& x, const TensorView& q_t,
                                  const TensorView& scale_t) {
  const std::int64_t M = x.shape[0], K = x.shape[1];
  // The 1x128 quantisation of x^T.
  std::vector<float> xt(static_cast<std::size_t>(M * K));
  transpose(to_f32(x, 0, M * K).data(), M, K, xt.data());
  fp8_quantize_2d(xt.data(), K, M, 1, fp8::kBlock, q_t.ptr<std::uint8_t>(), scale_t.ptr<float>());
}

void fp8_quantize_blocks(const Context&, const TensorView& w, const TensorView& q, const TensorView& q_t,
                         const TensorView& scale) {
  const std::int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  const std::int64_t ns = fp8_num_blocks(N) * fp8_num_blocks(K);
  for (std::int64_t e = 0; e < E; ++e) {
    std::uint8_t* qe = q.ptr<std::uint8_t>() + e * N * K;
    fp8_quantize_2d(to_f32(w, e * N * K, N * K).data(), N, K, fp8::kBlock, fp8::kBlock, qe,
                    scale.ptr<float>() + e * ns);
    if (q_t.given()) transpose(qe, N, K, q_t.ptr<std::uint8_t>() + e * N * K);
  }
}

namespace {
// Leading dimensions of [..., R, C] multiplied out, and R, C.
void matrices(const TensorView& v, const char* fn, std::int64_t& B, std::int64_t& R, std::int64_t& C) {
  SONICMOE_CHECK(v.ndim >= 2 && !v.device.is_cuda() && v.is_contiguous(), "sonicmoe::ref::", fn,
                 ": expected a contiguous host tensor of at least 2 dimensions, got ", v.shape_str());
  B = 1;
  for (int d = 0; d + 2 < v.ndim; ++d) B *= v.shape[d];
  R = v.shape[v.ndim - 2];
  C = v.shape[v.ndim - 1];
}
std::vector<std::int64_t> dims(const TensorView& v) { return {v.shape.begin(), v.shape.begin() + v.ndim}; }
}  // namespace

Tensor fp8_fake_quant(const TensorView& x, int block_rows, int block_cols) {
  std::int64_t B, R, C;
  matrices(x, "fp8_fake_quant", B, R, C);
  SONICMOE_CHECK(x.dtype == DType::bf16 || x.dtype == DType::f32, "sonicmoe::ref::fp8_fake_quant: dtype ",
                 dtype_name(x.dtype), ", expected bf16 or f32");
  Tensor out = Tensor::empty(dims(x), DType::f32);
  for (std::int64_t b = 0; b < B; ++b) {
    const std::vector<float> m = to_f32(x, b * R * C, R * C);
    float* o = out.ptr<float>() + b * R * C;
    std::copy(m.begin(), m.end(), o);
    fp8_fake_quant_2d(o, R, C, block_rows, block_cols);
  }
  return out;
}

Tensor fp8_dequantize(const TensorView& q, const TensorView& scale, int block_rows, int block_cols) {
  std::int64_t B, R, C, Bs, Rs, Cs;
  matrices(q, "fp8_dequantize", B, R, C);
  matrices(scale, "fp8_dequantize", Bs, Rs, Cs);
  SONICMOE_CHECK(q.dtype == DType::f8e4m3 && scale.dtype == DType::f32 && Bs == B &&
                     Rs == ceil_div(R, block_rows) && Cs == ceil_div(C, block_cols),
                 "sonicmoe::ref::fp8_dequantize: q ", dtype_name(q.dtype), " ", q.shape_str(), " and scale ",
                 dtype_name(scale.dtype), " ", scale.shape_str(), " do not match blocks of ", block_rows, "x",
                 block_cols);
  Tensor out = Tensor::empty(dims(q), DType::f32);
  for (std::int64_t b = 0; b < B; ++b)
    fp8_dequantize_2d(q.ptr<const std::uint8_t>() + b * R * C, scale.ptr<const float>() + b * Rs * Cs, R, C,
                      block_rows, block_cols, out.ptr<float>() + b * R * C);
  return out;
}

}  // namespace sonicmoe::ref

// Public FP8 quantisation entries (include/sonicmoe/quant.h): validate every argument, then run the context's
// backend (src/reference/fp8_ref.cpp or src/cuda/quant/).
#include "sonicmoe/quant.h"

#include <type_traits>

#include "core/check.h"
#include "sonicmoe/detail/quant_list.h"
#include "reference/fp8_ref.h"
#include "reference/matrix.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/quant/dequant.h"
#include "cuda/quant/quant.h"
#endif

namespace sonicmoe {

// The documented declarations of quant.h are the list (sonicmoe/detail/quant_list.h) both backends declare from.
#define SONICMOE_CHECK_PUBLIC_QUANT(ret, name, params)                    \
  static_assert(std::is_same_v<decltype(&sonicmoe::name), ret(*) params>, \
                "include/sonicmoe/quant.h: " #name " differs from the quantiser list");
SONICMOE_QUANT_LIST(SONICMOE_CHECK_PUBLIC_QUANT)
#undef SONICMOE_CHECK_PUBLIC_QUANT

namespace {

using check::Arg;

#ifdef SONICMOE_WITH_CUDA
#define SONICMOE_QUANT_DISPATCH(ctx, fn, ...) \
  ((ctx).backend == Backend::cuda ? cuda::fn(__VA_ARGS__) : ref::fn(__VA_ARGS__))
#else
#define SONICMOE_QUANT_DISPATCH(ctx, fn, ...) ref::fn(__VA_ARGS__)
#endif

// Every tensor: given, on the context's device, contiguous; on the GPU 16-byte aligned (vector loads and stores).
Arg& tensor_arg(Arg& a, const Context& ctx) {
  a.given().on(ctx.device()).contiguous();
  if (ctx.backend == Backend::cuda) a.aligned(16);
  return a;
}

// The input: bf16 or f32 (f16 refused) of `ndim` dimensions; below 2^31 elements per matrix (the kernels' int32 row arithmetic).
void check_input(const char* fn, const Context& ctx, const char* name, const TensorView& x, int ndim) {
  check::backend(ctx, fn);
  Arg a(fn, name, x);
  a.given().float_dtype().ndim(ndim);
  SONICMOE_ARG_CHECK(a, x.dtype != DType::f16, "has dtype f16; the FP8 quantisers take bf16 or f32");
  tensor_arg(a, ctx);
  for (int d = 0; d < ndim; ++d)
    SONICMOE_ARG_CHECK(a, x.shape[d] < (std::int64_t{1} << 31), "has size ", x.shape[d], " in dimension ", d,
                       ", expected below 2^31");
}

// On the GPU a dimension that is the contiguous one of an FP8 output must be a multiple of 16 (16-byte rows).
void check_fp8_row(const char* fn, const Context& ctx, const char* what, std::int64_t n) {
  if (ctx.backend != Backend::cuda) return;
  SONICMOE_CHECK(n % 16 == 0, "sonicmoe::", fn, ": ", what, " = ", n,
                 " is not a multiple of 16, which the cuda backend needs (16-byte rows of the FP8 output)");
}

void check_q(const char* fn, const Context& ctx, const char* name, const TensorView& q,
             std::initializer_list<std::int64_t> shape, const char* desc) {
  Arg a(fn, name, q);
  a.given().dtype(DType::f8e4m3);
  tensor_arg(a, ctx).shape(shape, desc);
}
void check_scale(const char* fn, const Context& ctx, const char* name, const TensorView& s,
                 std::initializer_list<std::int64_t> shape, const char* desc) {
  Arg a(fn, name, s);
  a.given().dtype(DType::f32);
  tensor_arg(a, ctx).shape(shape, desc);
}

}  // namespace

void fp8_quantize_rows(const Context& ctx, const TensorView& x, const TensorView& rows, const TensorView& q,
                       const TensorView& scale) {
  const char* fn = "fp8_quantize_rows";
  check_input(fn, ctx, "x", x, 2);
  const std::int64_t T = x.shape[0], K = x.shape[1];
  std::int64_t M = T;
  if (rows.given()) {
    Arg a(fn, "rows", rows);
    a.dtype(DType::i32).ndim(1).on(ctx.device()).contiguous().values_in(0, T, "[0, T)");
    M = rows.shape[0];
  }
  check_fp8_row(fn, ctx, "K (x's row length)", K);
  check_q(fn, ctx, "q", q, {M, K}, rows.given() ? "[M, K], M = rows" : "[T, K]");
  check_scale(fn, ctx, "scale", scale, {M, fp8_num_blocks(K)}, "[M, ceil(K/128)]");
  SONICMOE_QUANT_DISPATCH(ctx, fp8_quantize_rows, ctx, x, rows, q, scale);
}

void fp8_dequantize_rows(const Context& ctx, const TensorView& q, const TensorView& scale, const TensorView& out) {
  const char* fn = "fp8_dequantize_rows";
  check::backend(ctx, fn);
  { Arg a(fn, "q", q); a.given().dtype(DType::f8e4m3).ndim(2); tensor_arg(a, ctx); }
  const std::int64_t M = q.shape[0], K = q.shape[1];
  check_fp8_row(fn, ctx, "K (q's row length)", K);
  check_scale(fn, ctx, "scale", scale, {M, fp8_num_blocks(K)}, "[M, ceil(K/128)]");
  Arg a(fn, "out", out);
  a.given().shape({M, K}, "[M, K]");
  tensor_arg(a, ctx);
  if (ctx.backend == Backend::cpu) {
    SONICMOE_ARG_CHECK(a, out.dtype == DType::bf16 || out.dtype == DType::f32, "has dtype ", dtype_name(out.dtype),
                       ", expected bf16 or f32");
    const Tensor f = ref::fp8_dequantize(q, scale, 1, static_cast<int>(kFp8BlockSize));
    ref::store_rows(out, 0, ref::load_rows(f.view(), 0, M));
    return;
  }
  a.dtype(DType::bf16);
#ifdef SONICMOE_WITH_CUDA
  cuda::fp8_dequantize_rows_bf16(ctx, q, scale, out);
#endif
}

void fp8_quantize_cols_transposed(const Context& ctx, const TensorView& x, const TensorView& q_t,
                                  const TensorView& scale_t) {
  const char* fn = "fp8_quantize_cols_transposed";
  check_input(fn, ctx, "x", x, 2);
  const std::int64_t M = x.shape[0], K = x.shape[1];
  check_fp8_row(fn, ctx, "M (q_t's row length)", M);
  check_fp8_row(fn, ctx, "K (x's row length)", K);
  check_q(fn, ctx, "q_t", q_t, {K, M}, "[K, M]");
  check_scale(fn, ctx, "scale_t", scale_t, {K, fp8_num_blocks(M)}, "[K, ceil(M/128)]");
  SONICMOE_QUANT_DISPATCH(ctx, fp8_quantize_cols_transposed, ctx, x, q_t, scale_t);
}

void fp8_quantize_blocks(const Context& ctx, const TensorView& w, const TensorView& q, const TensorView& q_t,
                         const TensorView& scale) {
  const char* fn = "fp8_quantize_blocks";
  check_input(fn, ctx, "w", w, 3);
  const std::int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  check_fp8_row(fn, ctx, "K (w's row length)", K);
  check_q(fn, ctx, "q", q, {E, N, K}, "[E, N, K]");
  if (q_t.given()) {
    check_fp8_row(fn, ctx, "N (q_t's row length)", N);
    check_q(fn, ctx, "q_t", q_t, {E, K, N}, "[E, K, N]");
  }
  check_scale(fn, ctx, "scale", scale, {E, fp8_num_blocks(N), fp8_num_blocks(K)}, "[E, ceil(N/128), ceil(K/128)]");
  SONICMOE_QUANT_DISPATCH(ctx, fp8_quantize_blocks, ctx, w, q, q_t, scale);
}

}  // namespace sonicmoe

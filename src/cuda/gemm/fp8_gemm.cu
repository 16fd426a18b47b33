// Host entries of the FP8 varlen-M GEMM (fp8_gemm.h): the two shape requirements of the kernel, then the
// instantiation group (fp8_instances.h). Everything else is validated by the callers.
#include "cuda/gemm/fp8_gemm.h"

#include "cuda/gemm/fp8_instances.h"
#include "sonicmoe/error.h"

namespace sonicmoe::cuda::gemm {
namespace {

// k: whole 128-deep k-blocks (one scale each, no K tail in the promoted loop); n: 16-byte rows of e4m3 B for TMA and
// of bf16 C for the epilogue.
void check_shape(const char* entry, const Fp8VarlenM& g) {
  SONICMOE_CHECK(g.k > 0 && g.k % 128 == 0, entry, ": k must be a positive multiple of 128, got ", g.k);
  SONICMOE_CHECK(g.n > 0 && g.n % 16 == 0, entry, ": n must be a positive multiple of 16, got ", g.n);
}

// The FP8 dgated epilogue's Z and dZ (EpiDgatedFp8, on either mainloop): whole 1x128 blocks of Z, its codes and
// scales, the bf16 dZ, and dZ's codes with their scales or neither.
void check_dgated_z(const char* entry, Activation act, int n, const Fp8ZIn& z, const Fp8ZOut& dz) {
  const int zw = is_glu(act) ? 2 * n : n;
  SONICMOE_CHECK(zw % 128 == 0, entry, ": Z in 1x128 blocks needs z_width a multiple of 128, got ", zw);
  SONICMOE_CHECK(z.q != nullptr && z.scale != nullptr, entry, ": Z's codes and scales are required");
  SONICMOE_CHECK(dz.z != nullptr && (dz.q == nullptr) == (dz.scale == nullptr), entry,
                 ": needs the bf16 dZ, and dZ's codes with their scales or neither");
}

}  // namespace

// One partial per 128-column tile (VarlenMFp8Config::BN).
int fp8_dgated_n_tiles(int n) { return (n + 127) / 128; }

void fp8_varlen_m_store(const Fp8VarlenM& g, __nv_bfloat16* c, const __nv_bfloat16* bias, const float* row_scale) {
  check_shape("fp8_varlen_m_store", g);
  if (g.gather) detail::fp8_store_gathered(g, c, bias, row_scale);
  else detail::fp8_store_contiguous(g, c, bias, row_scale);
}

void fp8_varlen_m_activation(const Fp8VarlenM& g, Activation act, const __nv_bfloat16* bias, const Fp8ZOut& z,
                             __nv_bfloat16* a_out) {
  check_shape("fp8_varlen_m_activation", g);
  const int I = is_glu(act) ? g.n / 2 : g.n;
  SONICMOE_CHECK(I % 8 == 0, "fp8_varlen_m_activation: the activation width must be a multiple of 8, got ", I);
  SONICMOE_CHECK(z.q == nullptr || (g.n % 128 == 0 && z.scale != nullptr),
                 "fp8_varlen_m_activation: FP8 Z needs n a multiple of 128 (got ", g.n, ") and its scales");
  if (g.gather) {
    if (is_glu(act)) detail::fp8_activation_glu(g, act, bias, z, a_out);
    else detail::fp8_activation_plain(g, act, bias, z, a_out);
  } else {
    if (is_glu(act)) detail::fp8_activation_glu_contiguous(g, act, bias, z, a_out);
    else detail::fp8_activation_plain_contiguous(g, act, bias, z, a_out);
  }
}

void fp8_varlen_m_dgated(const Fp8VarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                         const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  check_shape("fp8_varlen_m_dgated", g);
  SONICMOE_CHECK(g.gather != nullptr, "fp8_varlen_m_dgated: needs gathered A rows");
  check_dgated_z("fp8_varlen_m_dgated", act, g.n, z, dz);
  if (is_glu(act)) detail::fp8_dgated_glu(g, act, z, pair_score, pair, dz, as, ds_partial);
  else detail::fp8_dgated_plain(g, act, z, pair_score, pair, dz, as, ds_partial);
}

void bf16_varlen_m_dgated_fp8z(const NativeVarlenM& g, Activation act, const Fp8ZIn& z, const float* pair_score,
                               const std::int32_t* pair, const Fp8ZOut& dz, __nv_bfloat16* as, float* ds_partial) {
  const char* fn = "bf16_varlen_m_dgated_fp8z";
  SONICMOE_CHECK(g.elem == DType::bf16 && g.gather != nullptr && g.b_kn && !g.b_w1_concat, fn,
                 ": needs bf16 operands, gathered A rows and B as [E, k, n]");
  check_dgated_z(fn, act, g.n, z, dz);
  if (is_glu(act)) detail::bf16_dgated_fp8z_glu(g, act, z, pair_score, pair, dz, as, ds_partial);
  else detail::bf16_dgated_fp8z_plain(g, act, z, pair_score, pair, dz, as, ds_partial);
}

}  // namespace sonicmoe::cuda::gemm

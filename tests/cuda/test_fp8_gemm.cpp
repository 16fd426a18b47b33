// The FP8 blockwise varlen-M GEMM (src/cuda/gemm/fp8_gemm.h): store (contiguous and gathered A, bias, row scale),
// activation (every activation) and dgated (every activation; Z in and dZ out as 1x128 FP8) against fp64 loops on the
// dequantised operands. The operands are random non-zero values whose magnitude varies by row, expert and 128-block
// (so a wrong scale index shows), quantised by the library's CPU quantiser (ref::fp8_quantize_2d, bitwise the CUDA
// one) and copied to the device. Awkward sizes: rows not a multiple of 128, empty experts, E = 1, 3, 60, 128,
// n = 128 j + 64 and n < 128 (a partial last block), k = 128 and 1152. Outputs NaN-poisoned before every run; rows
// past offsets[E] untouched; bitwise repeat; CUDA-graph replay with new offsets. Tolerance: the fp32 accumulation (a
// few ulp of sum |a_i b_i|) plus the bf16 rounding of the output (2^-8 relative) per element, and the relative norm of
// the error. Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/activation.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/heuristics.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/gpu_test_util.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/error.h"

namespace {

using namespace sonicmoe;
namespace g8 = sonicmoe::cuda::gemm;
using bf = __nv_bfloat16;

#define CK(x) ASSERT_EQ((x), cudaSuccess)

template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  Dev() = default;
  explicit Dev(std::size_t count) { alloc(count); }
  Dev(const std::vector<T>& h) { upload(h); }
  void alloc(std::size_t count) {
    n = count;
    if (cudaMalloc(&p, (count ? count : 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  void upload(const std::vector<T>& h) {
    alloc(h.size());
    if (p && !h.empty()) cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  void poison() { cudaMemset(p, 0xFF, n * sizeof(T)); }  // 0xFFFF: a bf16 NaN; 0xFFFFFFFF: an f32 NaN
};

// Unsets an environment variable (a tuning override a test sets) when the test leaves.
struct UnsetOnExit {
  const char* name;
  ~UnsetOnExit() { unsetenv(name); }
};

double f(bf x) { return static_cast<double>(__bfloat162float(x)); }
float bf_round(float x) { return __bfloat162float(__float2bfloat16(x)); }

std::vector<int> make_offsets(const std::vector<int>& counts) {
  std::vector<int> off(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

// An FP8 operand: codes, scales and the dequantised values (what the GEMM multiplies).
struct Q8 {
  std::vector<std::uint8_t> q;
  std::vector<float> scale, deq;
};

// R x C values, non-zero, magnitude 2^((r / rb + c / 128) % 7 - 3 + shift) times U(0.5, 1) with a random sign: every
// block of the quantiser gets its own scale.
std::vector<float> varied(std::int64_t R, std::int64_t C, int rb, int shift, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(0.5f, 1.0f);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> v(static_cast<std::size_t>(R * C));
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = 0; c < C; ++c) {
      const int e = static_cast<int>((r / rb + c / 128) % 7) - 3 + shift;
      v[static_cast<std::size_t>(r * C + c)] = std::ldexp(d(rng), e) * (sign(rng) ? -1.0f : 1.0f);
    }
  return v;
}

// Activations [R, K] in 1x128 blocks.
Q8 quant_rows(std::int64_t R, std::int64_t K, std::mt19937& rng) {
  Q8 o;
  const std::vector<float> x = varied(R, K, 1, 0, rng);
  o.q.resize(x.size());
  o.scale.resize(static_cast<std::size_t>(R * fp8_num_blocks(K)));
  o.deq.resize(x.size());
  ref::fp8_quantize_2d(x.data(), R, K, 1, 128, o.q.data(), o.scale.data());
  ref::fp8_dequantize_2d(o.q.data(), o.scale.data(), R, K, 1, 128, o.deq.data());
  return o;
}

// Weights [E, N, K] in 128x128 blocks (scales [E, ceil(N/128), K/128]).
Q8 quant_blocks(int E, std::int64_t N, std::int64_t K, std::mt19937& rng) {
  Q8 o;
  const std::size_t per = static_cast<std::size_t>(N * K), sper = static_cast<std::size_t>(fp8_num_blocks(N) * fp8_num_blocks(K));
  o.q.resize(per * E);
  o.scale.resize(sper * E);
  o.deq.resize(per * E);
  for (int e = 0; e < E; ++e) {
    const std::vector<float> w = varied(N, K, 128, e % 5 - 2, rng);
    ref::fp8_quantize_2d(w.data(), N, K, 128, 128, o.q.data() + per * e, o.scale.data() + sper * e);
    ref::fp8_dequantize_2d(o.q.data() + per * e, o.scale.data() + sper * e, N, K, 128, 128, o.deq.data() + per * e);
  }
  return o;
}

// One problem: routing (offsets, capacity, gather), operands on the host and the device.
struct Problem {
  int E = 0, n = 0, k = 0, rows = 0, valid = 0, a_rows = 0;
  bool gathered = false;
  std::vector<int> off, gather;
  Q8 a, b;
  std::vector<bf> bias;
  std::vector<float> row_scale;
  Dev<std::uint8_t> da, db;
  Dev<float> das, dbs, drs;
  Dev<int> doff, dgather;
  Dev<bf> dbias;

  Problem(const std::vector<int>& counts, int extra_rows, int n_, int k_, bool gathered_, unsigned seed)
      : E(static_cast<int>(counts.size())), n(n_), k(k_), gathered(gathered_) {
    std::mt19937 rng(seed);
    off = make_offsets(counts);
    valid = off[E];
    rows = valid + extra_rows;
    a_rows = gathered ? rows / 2 + 3 : rows;
    a = quant_rows(a_rows, k, rng);
    b = quant_blocks(E, n, k, rng);
    bias = sonicmoe::testing::random_nonzero_bf16<bf>(static_cast<std::size_t>(E) * n, rng, -1.0f, 1.0f,
                                                     [](float x) { return __float2bfloat16(x); });
    std::uniform_real_distribution<float> sd(0.25f, 2.0f);
    std::uniform_int_distribution<int> gd(0, std::max(a_rows - 1, 0));
    row_scale.resize(rows);
    gather.resize(rows);
    for (int r = 0; r < rows; ++r) {
      row_scale[r] = sd(rng);
      gather[r] = gd(rng);
    }
    da.upload(a.q);
    db.upload(b.q);
    das.upload(a.scale);
    dbs.upload(b.scale);
    drs.upload(row_scale);
    doff.upload(off);
    dgather.upload(gather);
    dbias.upload(bias);
  }
  g8::Fp8VarlenM args(cudaStream_t s = nullptr) const {
    g8::Fp8VarlenM g;
    g.a = da.p;
    g.a_scale = das.p;
    g.a_rows = a_rows;
    g.gather = gathered ? dgather.p : nullptr;
    g.b = db.p;
    g.b_scale = dbs.p;
    g.offsets = doff.p;
    g.rows = rows;
    g.num_experts = E;
    g.n = n;
    g.k = k;
    g.stream = s;
    return g;
  }
  int expert_of(int r) const {
    int e = 0;
    while (off[e + 1] <= r) ++e;
    return e;
  }
  // sum_k A[g(r), k] B[e, j, k] in fp64 on the dequantised operands; *mag = sum |terms|.
  double dot(int r, int e, int j, double* mag) const {
    const float* ar = a.deq.data() + static_cast<std::size_t>(gathered ? gather[r] : r) * k;
    const float* br = b.deq.data() + (static_cast<std::size_t>(e) * n + j) * k;
    double s = 0, m = 0;
    for (int q = 0; q < k; ++q) {
      const double t = static_cast<double>(ar[q]) * br[q];
      s += t;
      m += std::fabs(t);
    }
    *mag = m;
    return s;
  }
};

// |got - want| within the bf16 rounding of want (2^-8 relative, two roundings' worth) plus the accumulation error,
// relative to the terms' magnitude mag = sum |a_i b_i|: the FP8 wgmma sums a 128-deep k-block with fewer than fp32's
// bits (about 14, DeepSeek-V3 report, hence the promotion every k-block), a few truncations a block: 2^-11 of mag.
// The aggregate check (ErrNorm) holds the whole output to the bf16 rounding.
constexpr int kAccBits = 11;
bool close(double got, double want, double mag) {
  return std::isfinite(got) &&
         std::fabs(got - want) <= std::ldexp(std::fabs(want), -8) + std::ldexp(mag, -kAccBits) + 1e-30;
}
// ||got - want|| / ||want|| over the compared entries (non-finite: +inf).
struct ErrNorm {
  double num = 0, den = 0;
  bool finite = true;
  void add(double got, double want) {
    finite = finite && std::isfinite(got);
    num += (got - want) * (got - want);
    den += want * want;
  }
  double rel() const { return finite ? std::sqrt(num / (den > 0 ? den : 1)) : INFINITY; }
};
constexpr double kNormTol = 5e-3;  // bf16 rounding alone: ~1.1e-3

struct StoreCase {
  std::vector<int> counts;
  int extra_rows, n, k;
  bool gather, bias, scale;
};

std::vector<bf> run_store(const Problem& pb, const StoreCase& c, Dev<bf>& out) {
  out.poison();
  g8::fp8_varlen_m_store(pb.args(), out.p, c.bias ? pb.dbias.p : nullptr, c.scale ? pb.drs.p : nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.host();
}

void check_store(const StoreCase& c, unsigned seed) {
  SCOPED_TRACE("E " + std::to_string(c.counts.size()) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k) +
               (c.gather ? " gathered" : " contiguous") + (c.bias ? " bias" : "") + (c.scale ? " row_scale" : ""));
  const Problem pb(c.counts, c.extra_rows, c.n, c.k, c.gather, seed);
  Dev<bf> out(static_cast<std::size_t>(pb.rows) * c.n);
  const std::vector<bf> got = run_store(pb, c, out);
  int bad = 0;
  ErrNorm norm;
  for (int r = 0; r < pb.valid; ++r) {
    const int e = pb.expert_of(r);
    for (int j = 0; j < c.n; ++j) {
      double mag;
      double want = pb.dot(r, e, j, &mag);
      if (c.bias) want += f(pb.bias[static_cast<std::size_t>(e) * c.n + j]);
      if (c.scale) {
        want *= pb.row_scale[r];
        mag *= pb.row_scale[r];
      }
      const double v = f(got[static_cast<std::size_t>(r) * c.n + j]);
      norm.add(v, want);
      if (!close(v, want, mag) && ++bad <= 5)
        ADD_FAILURE() << "C[" << r << ", " << j << "] = " << v << ", want " << want << " (expert " << e << ")";
    }
  }
  EXPECT_EQ(bad, 0) << "entries out of tolerance";
  EXPECT_LT(norm.rel(), kNormTol);
  for (std::size_t i = static_cast<std::size_t>(pb.valid) * c.n; i < got.size(); ++i)
    ASSERT_TRUE(std::isnan(f(got[i]))) << "row " << i / c.n << " past offsets[E] was written";
  // Deterministic: a second run is bitwise the first.
  const std::vector<bf> again = run_store(pb, c, out);
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * sizeof(bf)), 0) << "second run differs";
}

TEST(CudaFp8Gemm, StoreContiguousUnevenAndEmptyExperts) {
  SONICMOE_REQUIRE_GPU();
  check_store({{130, 0, 257, 1}, 37, 320, 128, false, false, false}, 1);
  check_store({{130, 0, 257, 1}, 37, 320, 1152, false, true, true}, 2);
}

TEST(CudaFp8Gemm, StoreGathered) {
  SONICMOE_REQUIRE_GPU();
  check_store({{200, 0, 77}, 20, 192, 1152, true, false, false}, 3);
  check_store({{200, 0, 77}, 20, 192, 128, true, true, true}, 4);
}

TEST(CudaFp8Gemm, StoreSingleExpert) {
  SONICMOE_REQUIRE_GPU();
  check_store({{300}, 0, 128, 1152, false, true, false}, 5);
  check_store({{300}, 5, 64, 256, true, false, true}, 6);  // n < 128: one partial block
}

TEST(CudaFp8Gemm, StoreManyExperts) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  std::vector<int> c60(60), c128(128);
  std::uniform_int_distribution<int> d60(0, 40), d128(0, 12);
  for (auto& x : c60) x = d60(rng) < 8 ? 0 : d60(rng);
  for (auto& x : c128) x = d128(rng) < 3 ? 0 : d128(rng);
  check_store({c60, 9, 144, 256, true, true, true}, 8);
  check_store({c60, 0, 144, 128, false, false, false}, 9);
  check_store({c128, 3, 80, 128, true, false, false}, 10);
}

// ---- activation --------------------------------------------------------------------------------------------
constexpr Activation kAll[] = {Activation::swiglu, Activation::geglu, Activation::reglu,   Activation::geglu_tanh,
                               Activation::gelu,   Activation::relu,  Activation::silu,    Activation::relu_sq,
                               Activation::gelu_tanh};

float act_value(Activation act, float gate, float up) {
  return act::dispatch(act, [&](auto a) {
    constexpr Activation A = decltype(a)::value;
    if constexpr (is_glu(A))
      return act::glu<A>(gate, up);
    else
      return act::f<A>(gate);
  });
}

void check_activation(Activation act, bool bias, unsigned seed) {
  SCOPED_TRACE(std::string(activation_name(act)) + (bias ? " bias" : ""));
  const bool glu = is_glu(act);
  const int n = glu ? 320 : 208, I = glu ? n / 2 : n, k = 256;
  const Problem pb({150, 0, 90}, 11, n, k, true, seed);
  Dev<bf> z(static_cast<std::size_t>(pb.rows) * n), a(static_cast<std::size_t>(pb.rows) * I);
  z.poison();
  a.poison();
  g8::fp8_varlen_m_activation(pb.args(), act, bias ? pb.dbias.p : nullptr, g8::Fp8ZOut{z.p}, a.p);
  CK(cudaDeviceSynchronize());
  const std::vector<bf> zg = z.host(), ag = a.host();
  int bad = 0;
  ErrNorm norm;
  for (int r = 0; r < pb.valid; ++r) {
    const int e = pb.expert_of(r);
    for (int j = 0; j < n; ++j) {
      double mag;
      double want = pb.dot(r, e, j, &mag);
      if (bias) want += f(pb.bias[static_cast<std::size_t>(e) * n + j]);
      const double v = f(zg[static_cast<std::size_t>(r) * n + j]);
      norm.add(v, want);
      if (!close(v, want, mag) && ++bad <= 5) ADD_FAILURE() << "Z[" << r << ", " << j << "] = " << v << ", want " << want;
    }
    // A from the kernel's own Z (the activation math is test_cuda_activation's): one bf16 rounding apart.
    for (int j = 0; j < I; ++j) {
      const std::size_t zr = static_cast<std::size_t>(r) * n;
      const float want = glu ? act_value(act, __bfloat162float(zg[zr + 2 * j]), __bfloat162float(zg[zr + 2 * j + 1]))
                             : act_value(act, __bfloat162float(zg[zr + j]), 0.0f);
      const double v = f(ag[static_cast<std::size_t>(r) * I + j]);
      // Absolute part: gelu's 1 + erf(x) cancels in fp32 for x << 0 (device and host erff differ by a few 1e-7
      // there), and the GLU multiplies that by the up value.
      const double up = glu ? std::fabs(f(zg[zr + 2 * j + 1])) : 0.0;
      if (!(std::fabs(v - want) <= std::ldexp(std::fabs(want), -7) + 2e-6 * (1.0 + up)) && ++bad <= 5)
        ADD_FAILURE() << "A[" << r << ", " << j << "] = " << v << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_LT(norm.rel(), kNormTol) << "Z";
  for (std::size_t i = static_cast<std::size_t>(pb.valid) * n; i < zg.size(); ++i)
    ASSERT_TRUE(std::isnan(f(zg[i]))) << "Z row " << i / n << " past offsets[E] was written";
  for (std::size_t i = static_cast<std::size_t>(pb.valid) * I; i < ag.size(); ++i)
    ASSERT_TRUE(std::isnan(f(ag[i]))) << "A row " << i / I << " past offsets[E] was written";
}

// check(act, flag, seed) for every activation, flag = first then !first, on seeds seed, seed + 1, ...
void for_every_activation(void (*check)(Activation, bool, unsigned), bool first, unsigned seed) {
  for (Activation act : kAll) {
    check(act, first, seed++);
    check(act, !first, seed++);
  }
}

TEST(CudaFp8Gemm, ActivationEveryActivation) {
  SONICMOE_REQUIRE_GPU();
  for_every_activation(check_activation, /*bias first=*/false, 100);
}

// The kernel's 1x128 codes qg and scales sg of a [rows, cols] output whose first `valid` rows hold the bf16 values
// `vals`: bitwise the library's quantiser (ref::fp8_quantize_2d, bitwise the CUDA one) on those values, and the
// NaN-poisoned rows past `valid` untouched.
void expect_quantised_rows(const char* what, const std::vector<bf>& vals, int valid, int cols,
                           const std::vector<std::uint8_t>& qg, const std::vector<float>& sg) {
  const int nb = cols / 128;
  std::vector<float> vf(static_cast<std::size_t>(valid) * cols);
  for (std::size_t i = 0; i < vf.size(); ++i) vf[i] = __bfloat162float(vals[i]);
  std::vector<std::uint8_t> want_q(vf.size());
  std::vector<float> want_s(static_cast<std::size_t>(valid) * nb);
  ref::fp8_quantize_2d(vf.data(), valid, cols, 1, 128, want_q.data(), want_s.data());
  int bad = 0;
  for (std::size_t i = 0; i < want_q.size(); ++i)
    if (qg[i] != want_q[i] && ++bad <= 5)
      ADD_FAILURE() << what << " code [" << i / cols << ", " << i % cols << "] = " << int(qg[i]) << ", want "
                    << int(want_q[i]);
  for (std::size_t i = 0; i < want_s.size(); ++i)
    if (std::memcmp(&sg[i], &want_s[i], sizeof(float)) != 0 && ++bad <= 5)
      ADD_FAILURE() << what << " scale [" << i / nb << ", " << i % nb << "] = " << sg[i] << ", want " << want_s[i];
  EXPECT_EQ(bad, 0);
  for (std::size_t i = want_q.size(); i < qg.size(); ++i)
    ASSERT_EQ(qg[i], 0xFF) << what << " code row " << i / cols << " past offsets[E] was written";
  for (std::size_t i = want_s.size(); i < sg.size(); ++i)
    ASSERT_TRUE(std::isnan(sg[i])) << what << " scale row " << i / nb << " past offsets[E] was written";
}

// ---- dgated ------------------------------------------------------------------------------------------------
// G = A B^T (n = I) from FP8 operands, then the bf16 dgated epilogue's formulas (native_gemm.h): with s =
// pair_score[pair[r]] and Z's (gate, up) pairs (GLU) or values: dZ = act'(Z) applied to s G, as = s act(Z),
// ds_partial[t * rows + r] = sum over N tile t (128 columns) of G act(Z). Z comes in as 1x128 codes and scales (the
// reference's formulas take the dequantised values); with `full`, as and dZ's 1x128 codes and scales are written too,
// the latter bitwise the library's quantiser (ref::fp8_quantize_2d, bitwise the CUDA one) applied to the kernel's bf16
// dZ. GLU n = 192: a last N tile of 64 columns (one 1x128 block of dZ).
// The dgated GEMM's inputs (Z's codes and scales, scores, pairs) and NaN-poisoned outputs on the device.
struct DgatedRun {
  bool glu;
  int n, zw, nb;
  Problem pb;
  std::vector<std::uint8_t> zq;
  std::vector<float> zs, zd, score;
  std::vector<int> pair;
  DgatedRun(Activation act, const std::vector<int>& counts, int k, unsigned seed)
      : glu(is_glu(act)), n(glu ? 192 : 256), zw(glu ? 2 * n : n), nb(zw / 128), pb(counts, 11, n, k, true, seed) {
    std::mt19937 rng(seed + 1000);
    const std::size_t zn = static_cast<std::size_t>(pb.rows) * zw, sn = static_cast<std::size_t>(pb.rows) * nb;
    zq.resize(zn);
    zs.resize(sn);
    zd.resize(zn);
    std::vector<float> z0 = varied(pb.rows, zw, 1, -2, rng);
    ref::fp8_quantize_2d(z0.data(), pb.rows, zw, 1, 128, zq.data(), zs.data());
    ref::fp8_dequantize_2d(zq.data(), zs.data(), pb.rows, zw, 1, 128, zd.data());
    score.resize(pb.rows + 7);
    pair.resize(pb.rows);
    std::uniform_real_distribution<float> sd(0.1f, 1.0f);
    for (auto& s : score) s = sd(rng);
    for (int r = 0; r < pb.rows; ++r) pair[r] = (r * 7 + 3) % static_cast<int>(score.size());
  }
  // Every output of one launch (as, dZ's codes and scales only with `full`), copied back.
  struct Out {
    std::vector<bf> dz, as;
    std::vector<float> part, dzs;
    std::vector<std::uint8_t> dzq;
  };
  Out run(Activation act, bool full) const {
    const std::size_t zn = static_cast<std::size_t>(pb.rows) * zw, sn = static_cast<std::size_t>(pb.rows) * nb;
    const int tiles = g8::fp8_dgated_n_tiles(n);
    Dev<std::uint8_t> dzq_in(zq), dzq(zn);
    Dev<float> dzs_in(zs), dzs(sn);
    Dev<bf> dz(zn), as(static_cast<std::size_t>(pb.rows) * n);
    Dev<float> dscore(score), part(static_cast<std::size_t>(tiles) * pb.rows);
    Dev<int> dpair(pair);
    dz.poison();
    as.poison();
    part.poison();
    dzq.poison();
    dzs.poison();
    g8::fp8_varlen_m_dgated(pb.args(), act, g8::Fp8ZIn{dzq_in.p, dzs_in.p}, dscore.p, dpair.p,
                            g8::Fp8ZOut{dz.p, full ? dzq.p : nullptr, full ? dzs.p : nullptr}, full ? as.p : nullptr,
                            part.p);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return Out{dz.host(), as.host(), part.host(), dzs.host(), dzq.host()};
  }
};

void check_dgated(Activation act, bool full, unsigned seed) {
  SCOPED_TRACE(std::string(activation_name(act)) + (full ? " as + dZ codes" : ""));
  const DgatedRun dr(act, {150, 0, 90}, 384, seed);
  const bool glu = dr.glu;
  const int n = dr.n, zw = dr.zw;
  const Problem& pb = dr.pb;
  const std::vector<float>& score = dr.score;
  const std::vector<int>& pair = dr.pair;
  const std::size_t zn = static_cast<std::size_t>(pb.rows) * zw;
  std::vector<bf> z(zn);  // the dequantised Z (e4m3 values times powers of two: exact in bf16)
  for (std::size_t i = 0; i < zn; ++i) z[i] = __float2bfloat16(dr.zd[i]);
  const int tiles = g8::fp8_dgated_n_tiles(n);
  ASSERT_EQ(tiles, (n + 127) / 128);
  const DgatedRun::Out out = dr.run(act, full);
  const std::vector<bf>& dzg = out.dz;
  const std::vector<bf>& asg = out.as;
  const std::vector<float>& pg = out.part;
  int bad = 0;
  auto check = [&](const char* what, int r, int j, double v, double want, double mag) {
    if (!close(v, want, mag) && ++bad <= 5) ADD_FAILURE() << what << "[" << r << ", " << j << "] = " << v << ", want " << want;
  };
  for (int r = 0; r < pb.valid; ++r) {
    const int e = pb.expert_of(r);
    const float s = score[pair[r]];
    std::vector<double> tile_dot(tiles, 0.0), tile_mag(tiles, 0.0);
    for (int j = 0; j < n; ++j) {
      double mag;
      const double gx = pb.dot(r, e, j, &mag);
      const float gv = bf_round(static_cast<float>(gx));  // the kernel rounds G to bf16 before the epilogue
      // G's own error propagates linearly into every output below: the kernel's fp32 G may round to the other
      // neighbour (one bf16 ulp, <= 2^-7 relative) and carries the accumulation error.
      const double gerr = std::ldexp(std::fabs(gx), -7) + std::ldexp(mag, -kAccBits);
      const std::size_t zr = static_cast<std::size_t>(r) * zw;
      float av, d0, d1 = 0.0f, dd0, dd1 = 0.0f;  // dd: |d dz / d g| for the tolerance
      act::dispatch(act, [&](auto ac) {
        constexpr Activation A = decltype(ac)::value;
        if constexpr (is_glu(A)) {
          const float z0 = __bfloat162float(z[zr + 2 * j]), z1 = __bfloat162float(z[zr + 2 * j + 1]);
          act::dglu<A>(z0, z1, s * gv, d0, d1);
          act::dglu<A>(z0, z1, s, dd0, dd1);
          av = act::glu<A>(z0, z1);
        } else {
          const float z0 = __bfloat162float(z[zr + j]);
          d0 = act::df<A>(z0) * s * gv;
          dd0 = act::df<A>(z0) * s;
          av = act::f<A>(z0);
        }
      });
      if (glu) {
        check("dZ", r, 2 * j, f(dzg[zr + 2 * j]), d0, std::ldexp(std::fabs(dd0) * gerr, kAccBits));
        check("dZ", r, 2 * j + 1, f(dzg[zr + 2 * j + 1]), d1, std::ldexp(std::fabs(dd1) * gerr, kAccBits));
      } else {
        check("dZ", r, j, f(dzg[zr + j]), d0, std::ldexp(std::fabs(dd0) * gerr, kAccBits));
      }
      if (full) check("as", r, j, f(asg[static_cast<std::size_t>(r) * n + j]), s * av, 0.0);
      tile_dot[j / 128] += static_cast<double>(gv) * av;
      tile_mag[j / 128] += std::fabs(static_cast<double>(gv) * av) + std::ldexp(std::fabs(av) * gerr, kAccBits);
    }
    for (int t = 0; t < tiles; ++t)
      check("ds_partial", r, t, pg[static_cast<std::size_t>(t) * pb.rows + r], tile_dot[t], tile_mag[t]);
  }
  EXPECT_EQ(bad, 0);
  for (std::size_t i = static_cast<std::size_t>(pb.valid) * zw; i < dzg.size(); ++i)
    ASSERT_TRUE(std::isnan(f(dzg[i]))) << "dZ row " << i / zw << " past offsets[E] was written";
  const std::vector<std::uint8_t>& qg = out.dzq;
  const std::vector<float>& sg = out.dzs;
  if (!full) {
    for (bf x : asg) ASSERT_TRUE(std::isnan(f(x))) << "as written though null";
    for (std::uint8_t c : qg) ASSERT_EQ(c, 0xFF) << "dZ codes written though null";
    return;
  }
  // dZ's codes and scales: the quantiser on the kernel's own bf16 dZ
  expect_quantised_rows("dZ", dzg, pb.valid, zw, qg, sg);
}

// Z as 1x128 FP8 from the epilogue (EpiActivationFp8Z, the FP8 layer's saved Z): with the bf16 Z in the same call,
// the codes and scales are bitwise the library's quantiser (ref::fp8_quantize_2d, bitwise the CUDA one) applied to
// that bf16 Z; alone, and with neither (inference), the same codes, scales and A. Partial M tiles, an empty expert,
// n a multiple of 128 with a bias or not.
void check_activation_fp8_z(Activation act, bool bias, unsigned seed) {
  SCOPED_TRACE(std::string(activation_name(act)) + (bias ? " bias" : ""));
  const bool glu = is_glu(act);
  const int n = glu ? 384 : 256, I = glu ? n / 2 : n, nb = n / 128, k = 256;
  const Problem pb({150, 0, 90}, 11, n, k, true, seed);
  const std::size_t zn = static_cast<std::size_t>(pb.rows) * n, an = static_cast<std::size_t>(pb.rows) * I;
  const bf* b1 = bias ? pb.dbias.p : nullptr;
  Dev<bf> z(zn), a(an), a2(an), a3(an);
  Dev<std::uint8_t> q(zn), q2(zn);
  Dev<float> sc(static_cast<std::size_t>(pb.rows) * nb), sc2(static_cast<std::size_t>(pb.rows) * nb);
  for (auto* d : {&z, &a, &a2, &a3}) d->poison();
  for (auto* d : {&q, &q2}) d->poison();
  sc.poison();
  sc2.poison();
  g8::fp8_varlen_m_activation(pb.args(), act, b1, g8::Fp8ZOut{z.p, q.p, sc.p}, a.p);
  g8::fp8_varlen_m_activation(pb.args(), act, b1, g8::Fp8ZOut{nullptr, q2.p, sc2.p}, a2.p);
  g8::fp8_varlen_m_activation(pb.args(), act, b1, g8::Fp8ZOut{}, a3.p);
  CK(cudaDeviceSynchronize());
  const std::vector<bf> zg = z.host();
  const std::vector<std::uint8_t> qg = q.host();
  const std::vector<float> sg = sc.host();
  expect_quantised_rows("Z", zg, pb.valid, n, qg, sg);
  // the same codes, scales and A without the bf16 Z, and A alone
  EXPECT_EQ(q2.host(), qg);
  const std::vector<float> sg2 = sc2.host();
  EXPECT_EQ(std::memcmp(sg2.data(), sg.data(), sg.size() * sizeof(float)), 0);
  const std::vector<bf> ag = a.host(), ag2 = a2.host(), ag3 = a3.host();
  EXPECT_EQ(std::memcmp(ag2.data(), ag.data(), an * sizeof(bf)), 0);
  EXPECT_EQ(std::memcmp(ag3.data(), ag.data(), an * sizeof(bf)), 0);
}

TEST(CudaFp8Gemm, ActivationFp8ZIsTheQuantisedBf16Z) {
  SONICMOE_REQUIRE_GPU();
  for_every_activation(check_activation_fp8_z, false, 900);
}

// The consumer warps' share of the up-projection's epilogue (EpiActivationFp8Z::Params::consumer_rows,
// SONICMOE_FP8_Z_CONSUMER_ROWS): Z's codes and scales, A and the bf16 Z bitwise the epilogue warps' alone, with and
// without the bf16 Z (the layer's case), on tiles of 1 to 128 rows.
TEST(CudaFp8Gemm, ActivationFp8ZConsumerRowsAreBitwiseTheEpilogueWarps) {
  SONICMOE_REQUIRE_GPU();
  const UnsetOnExit restore{"SONICMOE_FP8_Z_CONSUMER_ROWS"};
  for (Activation act : {Activation::swiglu, Activation::relu_sq}) {
    const bool glu = is_glu(act);
    const int n = glu ? 384 : 256, I = glu ? n / 2 : n, nb = n / 128;
    const Problem pb({1, 150, 0, 17, 128, 90, 256}, 11, n, 256, true, 77);
    const std::size_t zn = static_cast<std::size_t>(pb.rows) * n, an = static_cast<std::size_t>(pb.rows) * I;
    for (bool with_z : {true, false}) {
      SCOPED_TRACE(std::string(activation_name(act)) + (with_z ? " with bf16 Z" : " codes only"));
      struct Out {
        std::vector<bf> z, a;
        std::vector<std::uint8_t> q;
        std::vector<float> sc;
      };
      auto run = [&](const char* rows) {
        setenv("SONICMOE_FP8_Z_CONSUMER_ROWS", rows, 1);
        Dev<bf> z(zn), a(an);
        Dev<std::uint8_t> q(zn);
        Dev<float> sc(static_cast<std::size_t>(pb.rows) * nb);
        z.poison();
        a.poison();
        q.poison();
        sc.poison();
        g8::fp8_varlen_m_activation(pb.args(), act, nullptr, g8::Fp8ZOut{with_z ? z.p : nullptr, q.p, sc.p}, a.p);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        return Out{z.host(), a.host(), q.host(), sc.host()};
      };
      const Out want = run("0");
      for (const char* rows : {"2", "6", "8", "16"}) {
        const Out got = run(rows);
        EXPECT_EQ(std::memcmp(got.z.data(), want.z.data(), zn * sizeof(bf)), 0) << "Z, consumer rows " << rows;
        EXPECT_EQ(std::memcmp(got.a.data(), want.a.data(), an * sizeof(bf)), 0) << "A, consumer rows " << rows;
        EXPECT_EQ(got.q, want.q) << "Z codes, consumer rows " << rows;
        EXPECT_EQ(std::memcmp(got.sc.data(), want.sc.data(), want.sc.size() * sizeof(float)), 0)
            << "Z scales, consumer rows " << rows;
      }
    }
  }
}

TEST(CudaFp8Gemm, ActivationFp8ZNeedsBlocksOf128) {
  SONICMOE_REQUIRE_GPU();
  const Problem pb({40, 30}, 0, 320, 128, true, 17);
  Dev<bf> a(static_cast<std::size_t>(pb.rows) * 160);
  Dev<std::uint8_t> q(static_cast<std::size_t>(pb.rows) * 320);
  Dev<float> sc(static_cast<std::size_t>(pb.rows) * 3);
  EXPECT_THROW(g8::fp8_varlen_m_activation(pb.args(), Activation::swiglu, nullptr, g8::Fp8ZOut{nullptr, q.p, sc.p}, a.p),
               sonicmoe::Error);
}

TEST(CudaFp8Gemm, DgatedEveryActivation) {
  SONICMOE_REQUIRE_GPU();
  for_every_activation(check_dgated, /*full first=*/true, 200);
}

// The consumer warps' share of the epilogue (EpiDgatedFp8::Params::consumer_rows, SONICMOE_FP8_DGATED_CONSUMER_ROWS)
// moves rows between warps, never the arithmetic: every output bitwise the epilogue warps' alone, for shares that
// split the 16-row groups evenly or not, all of them, and on tiles of 1 to 128 rows (partial tiles, an empty expert).
TEST(CudaFp8Gemm, DgatedConsumerRowsAreBitwiseTheEpilogueWarps) {
  SONICMOE_REQUIRE_GPU();
  const UnsetOnExit restore{"SONICMOE_FP8_DGATED_CONSUMER_ROWS"};
  for (Activation act : {Activation::swiglu, Activation::relu_sq}) {
    SCOPED_TRACE(activation_name(act));
    const DgatedRun dr(act, {1, 150, 0, 17, 128, 90, 256}, 1152, 4242);
    setenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS", "0", 1);
    const DgatedRun::Out want = dr.run(act, true);
    for (const char* c : {"2", "6", "8", "16"}) {
      SCOPED_TRACE(std::string("consumer rows ") + c);
      setenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS", c, 1);
      const DgatedRun::Out got = dr.run(act, true);
      EXPECT_EQ(std::memcmp(got.dz.data(), want.dz.data(), want.dz.size() * sizeof(bf)), 0) << "dZ";
      EXPECT_EQ(std::memcmp(got.as.data(), want.as.data(), want.as.size() * sizeof(bf)), 0) << "as";
      EXPECT_EQ(std::memcmp(got.part.data(), want.part.data(), want.part.size() * sizeof(float)), 0) << "ds partials";
      EXPECT_EQ(got.dzq, want.dzq) << "dZ codes";
      EXPECT_EQ(std::memcmp(got.dzs.data(), want.dzs.data(), want.dzs.size() * sizeof(float)), 0) << "dZ scales";
    }
  }
}

// dgated on bf16 operands with the FP8 epilogue (bf16_varlen_m_dgated_fp8z: the FP8 layer's step 7 under
// MoEConfig::dgated_precision bf16) against the native bf16 dgated kernel (native_varlen_m_dgated) on the same operands
// and the dequantised Z (exact in bf16): dZ, as and the ds partials bitwise, dZ's codes and scales bitwise the
// quantiser on that dZ; both kernel layouts (K below 3072 and from it), a GLU and a plain activation, the consumer
// warps taking none, 6 or 8 of their rows (SONICMOE_BF16_DGATED_CONSUMER_ROWS), partial tiles, an empty expert, rows
// past offsets[E] untouched.
TEST(CudaFp8Gemm, Bf16DgatedOnFp8ZIsTheNativeDgatedOnTheDequantisedZ) {
  SONICMOE_REQUIRE_GPU();
  ASSERT_TRUE(!g8::dgated_mma_gather(384) && g8::dgated_mma_gather(3072)) << "the two k must reach both layouts";
  const UnsetOnExit restore{"SONICMOE_BF16_DGATED_CONSUMER_ROWS"};
  for (int k : {384, 3072})
    for (Activation act : {Activation::swiglu, Activation::relu_sq})
      for (const char* rows : {"0", "6", "8"}) {
        SCOPED_TRACE(std::string(activation_name(act)) + ", k = " + std::to_string(k) + ", consumer rows " + rows);
        ASSERT_EQ(setenv("SONICMOE_BF16_DGATED_CONSUMER_ROWS", rows, 1), 0);
        const DgatedRun dr(act, {150, 0, 1, 90}, k, 900u + static_cast<unsigned>(k));
        const Problem& pb = dr.pb;
        const int n = dr.n, zw = dr.zw, nb = dr.nb, tiles = g8::native_dgated_n_tiles(n);
        const std::size_t zn = static_cast<std::size_t>(pb.rows) * zw, an = static_cast<std::size_t>(pb.rows) * n;
        // bf16 operands: A the dequantised FP8 rows, B [E, k, n] the dequantised [E, n, k] blocks transposed
        std::vector<bf> a(pb.a.deq.size()), b(pb.b.deq.size()), z(zn);
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = __float2bfloat16(pb.a.deq[i]);
        for (int e = 0; e < pb.E; ++e)
          for (int j = 0; j < n; ++j)
            for (int c = 0; c < k; ++c)
              b[(static_cast<std::size_t>(e) * k + c) * n + j] =
                  __float2bfloat16(pb.b.deq[(static_cast<std::size_t>(e) * n + j) * k + c]);
        for (std::size_t i = 0; i < zn; ++i) z[i] = __float2bfloat16(dr.zd[i]);
        Dev<bf> da(a), db(b), dz_in(z), dz0(zn), as0(an), dz1(zn), as1(an);
        Dev<std::uint8_t> zq(dr.zq), dzq(zn);
        Dev<float> zs(dr.zs), dzs(static_cast<std::size_t>(pb.rows) * nb), sc(dr.score);
        Dev<float> part0(static_cast<std::size_t>(tiles) * pb.rows), part1(static_cast<std::size_t>(tiles) * pb.rows);
        Dev<int> pair(dr.pair);
        for (auto* d : {&dz0, &as0, &dz1, &as1}) d->poison();
        for (auto* d : {&part0, &part1, &dzs}) d->poison();
        dzq.poison();
        g8::NativeVarlenM g;
        g.a = da.p;
        g.a_rows = pb.a_rows;
        g.gather = pb.dgather.p;
        g.b = db.p;
        g.b_kn = true;
        g.offsets = pb.doff.p;
        g.rows = pb.rows;
        g.num_experts = pb.E;
        g.n = n;
        g.k = k;
        g8::native_varlen_m_dgated(g, act, dz_in.p, sc.p, pair.p, dz0.p, as0.p, part0.p);
        g8::bf16_varlen_m_dgated_fp8z(g, act, g8::Fp8ZIn{zq.p, zs.p}, sc.p, pair.p, g8::Fp8ZOut{dz1.p, dzq.p, dzs.p},
                                      as1.p, part1.p);
        CK(cudaDeviceSynchronize());
        const std::vector<bf> dzw = dz0.host(), dzg = dz1.host(), asw = as0.host(), asg = as1.host();
        const std::vector<float> pw = part0.host(), pg = part1.host();
        EXPECT_EQ(std::memcmp(dzg.data(), dzw.data(), zn * sizeof(bf)), 0) << "dZ";
        EXPECT_EQ(std::memcmp(asg.data(), asw.data(), an * sizeof(bf)), 0) << "as";
        EXPECT_EQ(std::memcmp(pg.data(), pw.data(), pg.size() * sizeof(float)), 0) << "ds partials";
        int finite = 0;
        for (int r = 0; r < pb.valid; ++r) finite += std::isfinite(f(dzg[static_cast<std::size_t>(r) * zw]));
        EXPECT_EQ(finite, pb.valid) << "dZ rows of the experts written";
        for (std::size_t i = static_cast<std::size_t>(pb.valid) * zw; i < zn; ++i)
          ASSERT_TRUE(std::isnan(f(dzg[i]))) << "dZ row " << i / zw << " past offsets[E] was written";
        expect_quantised_rows("dZ", dzg, pb.valid, zw, dzq.host(), dzs.host());
      }
}

// The rule (heuristics.h), without a GPU: 12 of each consumer warp's 16 rows below K 3072, 8 from there; the
// override clamped to an even 0 .. 16.
TEST(CudaFp8Gemm, DgatedConsumerRowsFollowK) {
  const UnsetOnExit restore{"SONICMOE_FP8_DGATED_CONSUMER_ROWS"};
  unsetenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS");
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(1536), 12);  // small-k2
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(g8::kFp8LongK - 128), 12);
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(g8::kFp8LongK), 8);
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(4096), 8);  // readme-default
  setenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS", "7", 1);
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(4096), 6);
  setenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS", "40", 1);
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(4096), 16);
  setenv("SONICMOE_FP8_DGATED_CONSUMER_ROWS", "-3", 1);
  EXPECT_EQ(g8::fp8_dgated_consumer_rows(1536), 0);
}

TEST(CudaFp8Gemm, DgatedRefusesWhatItCannotRead) {
  SONICMOE_REQUIRE_GPU();
  auto run = [](Activation act, int n, bool with_dz) {
    const Problem pb({40, 30}, 0, n, 128, true, 19);
    const int zw = is_glu(act) ? 2 * n : n;
    const std::size_t zn = static_cast<std::size_t>(pb.rows) * zw;
    Dev<std::uint8_t> zq(zn);
    Dev<float> zs(static_cast<std::size_t>(pb.rows) * (zw + 127) / 128), sc(pb.rows * 2 + 7), part(pb.rows * 2);
    Dev<int> pair(static_cast<std::size_t>(pb.rows));
    Dev<bf> dz(zn);
    g8::fp8_varlen_m_dgated(pb.args(), act, g8::Fp8ZIn{zq.p, zs.p}, sc.p, pair.p,
                            g8::Fp8ZOut{with_dz ? dz.p : nullptr}, nullptr, part.p);
  };
  EXPECT_THROW(run(Activation::swiglu, 160, true), sonicmoe::Error);  // z_width 320: not whole 1x128 blocks
  EXPECT_THROW(run(Activation::gelu, 192, true), sonicmoe::Error);    // z_width 192
  EXPECT_THROW(run(Activation::swiglu, 192, false), sonicmoe::Error); // no bf16 dZ
}

// ---- graph capture, argument checks ----------------------------------------------------------------------
TEST(CudaFp8Gemm, GraphCaptureReplaysWithNewOffsets) {
  SONICMOE_REQUIRE_GPU();
  Problem pb({0, 0, 0, 0}, 512, 192, 256, true, 21);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Dev<bf> c(static_cast<std::size_t>(pb.rows) * pb.n);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  g8::fp8_varlen_m_store(pb.args(s), c.p, pb.dbias.p, nullptr);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<int>& counts : {std::vector<int>{10, 0, 200, 33}, std::vector<int>{300, 5, 0, 100}}) {
    pb.off = make_offsets(counts);
    pb.valid = pb.off[pb.E];
    CK(cudaMemcpy(pb.doff.p, pb.off.data(), pb.off.size() * sizeof(int), cudaMemcpyHostToDevice));
    c.poison();
    CK(cudaDeviceSynchronize());
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    const std::vector<bf> got = c.host();
    int bad = 0;
    for (int r = 0; r < pb.valid; ++r) {
      const int e = pb.expert_of(r);
      for (int j = 0; j < pb.n; ++j) {
        double mag;
        const double want = pb.dot(r, e, j, &mag) + f(pb.bias[static_cast<std::size_t>(e) * pb.n + j]);
        if (!close(f(got[static_cast<std::size_t>(r) * pb.n + j]), want, mag)) ++bad;
      }
    }
    EXPECT_EQ(bad, 0) << "graph replay, " << pb.valid << " rows";
    for (std::size_t i = static_cast<std::size_t>(pb.valid) * pb.n; i < got.size(); ++i)
      ASSERT_TRUE(std::isnan(f(got[i]))) << "row " << i / pb.n << " past offsets[E] was written";
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
}

TEST(CudaFp8Gemm, RejectsKAndNItCannotTile) {
  SONICMOE_REQUIRE_GPU();
  Problem pb({4}, 0, 16, 128, false, 22);
  Dev<bf> c(4096);
  g8::Fp8VarlenM g = pb.args();
  g.k = 192;
  EXPECT_THROW(g8::fp8_varlen_m_store(g, c.p, nullptr, nullptr), sonicmoe::Error);
  g.k = 128;
  g.n = 24;
  EXPECT_THROW(g8::fp8_varlen_m_store(g, c.p, nullptr, nullptr), sonicmoe::Error);
}

}  // namespace

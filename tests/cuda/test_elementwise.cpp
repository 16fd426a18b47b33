// Standalone memory-bound MoE kernels (src/cuda/elementwise) against float64 CPU loops.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/activation.h"
#include "baselines/unfused_elementwise.h"
#include "cuda/elementwise/expert_bias_grad.h"
#include "cuda/gpu_test_util.h"
#include "sonicmoe/types.h"

namespace sonicmoe {
namespace {

#define CK(x) ASSERT_EQ((x), cudaSuccess)

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T));
    cudaMemset(p, 0xFF, std::max<size_t>(1, n) * sizeof(T));  // poison: NaN in bf16 and f32
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice); }
  ~Dev() { cudaFree(p); }
  void poison() { cudaMemset(p, 0xFF, n * sizeof(T)); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

float b2f(bf16 v) { return bf16_to_float(v); }
std::vector<bf16> rand_bf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  return testing::random_nonzero_bf16<bf16>(n, rng, -scale, scale, float_to_bf16);
}
bool is_poison_bf16(bf16 v) { return v.bits == 0xFFFF; }
bool is_poison_f32(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u == 0xFFFFFFFFu;
}

// Routing of `cap` capacity rows over E experts, some empty; total valid rows < cap.
struct Routing {
  int E = 0, T = 0;
  int64_t cap = 0, total = 0;
  std::vector<int32_t> offsets, pair, gather;
  std::vector<float> score;
  std::vector<int> expert_of;
};
Routing make_routing(int E, int T, int64_t cap, int64_t total, std::mt19937& rng) {
  Routing R;
  R.E = E, R.T = T, R.cap = cap, R.total = total;
  std::vector<int64_t> counts(E, 0);
  std::uniform_int_distribution<int> de(0, E - 1);
  for (int64_t i = 0; i < total; ++i) {
    int e = de(rng);
    if (e % 7 == 3) e = (e + 1) % E;  // experts 3, 10, 17, ... stay empty
    counts[e]++;
  }
  R.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) R.offsets[e + 1] = R.offsets[e] + static_cast<int32_t>(counts[e]);
  R.pair.resize(cap);
  for (int64_t i = 0; i < cap; ++i) R.pair[i] = static_cast<int32_t>(i);
  std::shuffle(R.pair.begin(), R.pair.end(), rng);
  std::uniform_int_distribution<int> dt(0, T - 1);
  R.gather.resize(cap);
  for (auto& g : R.gather) g = dt(rng);
  std::uniform_real_distribution<float> ds(0.05f, 1.0f);
  R.score.resize(cap);
  for (auto& s : R.score) s = ds(rng);
  R.expert_of.assign(cap, -1);
  for (int e = 0; e < E; ++e)
    for (int32_t r = R.offsets[e]; r < R.offsets[e + 1]; ++r) R.expert_of[r] = e;
  return R;
}

// float64 versions of f and f'.
double f64(Activation a, double x) {
  switch (a) {
    case Activation::swiglu: case Activation::silu: return x / (1.0 + std::exp(-x));
    case Activation::geglu: case Activation::gelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::geglu_tanh: case Activation::gelu_tanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::reglu: case Activation::relu: return x > 0 ? x : 0.0;
    default: return x > 0 ? x * x : 0.0;
  }
}
double df64(Activation a, double x) {
  switch (a) {
    case Activation::swiglu: case Activation::silu: {
      double s = 1.0 / (1.0 + std::exp(-x));
      return s * (1.0 + x * (1.0 - s));
    }
    case Activation::geglu: case Activation::gelu:
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    case Activation::geglu_tanh: case Activation::gelu_tanh: {
      const double t = std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * std::sqrt(2.0 / M_PI) * (1.0 + 3 * 0.044715 * x * x);
    }
    case Activation::reglu: case Activation::relu: return x > 0 ? 1.0 : 0.0;
    default: return x > 0 ? 2.0 * x : 0.0;
  }
}

void expect_close(double got, double want, double scale, double rtol, const char* what, int64_t r, int64_t c) {
  ASSERT_TRUE(std::isfinite(got)) << what << " row " << r << " col " << c;
  ASSERT_LE(std::abs(got - want), rtol * (std::abs(want) + scale)) << what << " row " << r << " col " << c
                                                                    << " got " << got << " want " << want;
}

struct Shape {
  int E, T;
  int64_t cap, total, H, I;
};
const Shape kShapes[] = {
    {60, 300, 1100, 1000, 136, 72},   // vector path, E=60, T not a multiple of 128
    {5, 50, 260, 200, 30, 37},        // scalar path (odd widths)
    {8, 1000, 2048, 1920, 256, 1024}, // wide rows
};

class ActivationTest : public ::testing::TestWithParam<int> {};

TEST_P(ActivationTest, ForwardMatchesFloat64) {
  SONICMOE_REQUIRE_GPU();
  const Activation a = static_cast<Activation>(GetParam());
  for (const Shape& sh : kShapes) {
    std::mt19937 rng(1234 + GetParam());
    Routing R = make_routing(sh.E, sh.T, sh.cap, sh.total, rng);
    const int64_t zw = is_glu(a) ? 2 * sh.I : sh.I;
    auto hz = rand_bf16(sh.cap * zw, rng, 3.0f);
    Dev<bf16> z(hz), out(sh.cap * sh.I), out2(sh.cap * sh.I);
    Dev<int32_t> off(R.offsets);
    baselines::activation_forward(a, reinterpret_cast<const __nv_bfloat16*>(z.p), reinterpret_cast<__nv_bfloat16*>(out.p),
                             sh.cap, sh.I, off.p, sh.E, nullptr);
    baselines::activation_forward(a, reinterpret_cast<const __nv_bfloat16*>(z.p), reinterpret_cast<__nv_bfloat16*>(out2.p),
                             sh.cap, sh.I, off.p, sh.E, nullptr);
    CK(cudaDeviceSynchronize());
    auto ha = out.get(), ha2 = out2.get();
    ASSERT_EQ(0, std::memcmp(ha.data(), ha2.data(), ha.size() * sizeof(bf16))) << "not deterministic";
    for (int64_t r = 0; r < sh.cap; ++r)
      for (int64_t j = 0; j < sh.I; ++j) {
        const bf16 g = ha[r * sh.I + j];
        if (r >= sh.total) {
          ASSERT_TRUE(is_poison_bf16(g)) << "row " << r << " beyond offsets[E] written";
          continue;
        }
        double want = is_glu(a) ? f64(a, b2f(hz[r * zw + 2 * j])) * b2f(hz[r * zw + 2 * j + 1])
                                : f64(a, b2f(hz[r * zw + j]));
        expect_close(b2f(g), want, 1e-2, 1e-2, activation_name(a), r, j);
      }
  }
}

TEST_P(ActivationTest, DgatedMatchesFloat64) {
  SONICMOE_REQUIRE_GPU();
  const Activation a = static_cast<Activation>(GetParam());
  for (const Shape& sh : kShapes) {
    for (int with_b2 = 0; with_b2 < 2; ++with_b2) {
      std::mt19937 rng(99 + GetParam() * 3 + with_b2);
      Routing R = make_routing(sh.E, sh.T, sh.cap, sh.total, rng);
      const int64_t zw = is_glu(a) ? 2 * sh.I : sh.I;
      auto hg = rand_bf16(sh.cap * sh.I, rng), hz = rand_bf16(sh.cap * zw, rng, 3.0f);
      auto hdo = rand_bf16(int64_t(sh.T) * sh.H, rng), hb2 = rand_bf16(int64_t(sh.E) * sh.H, rng);
      Dev<bf16> g(hg), z(hz), dO(hdo), b2(hb2), dz(sh.cap * zw), as(sh.cap * sh.I);
      Dev<int32_t> off(R.offsets), pair(R.pair), gather(R.gather);
      Dev<float> score(R.score), ds(sh.cap);
      std::vector<bf16> prev_dz, prev_as;
      std::vector<float> prev_ds;
      for (int run = 0; run < 2; ++run) {
        dz.poison(), as.poison(), ds.poison();
        baselines::dgated_elementwise(a, reinterpret_cast<const __nv_bfloat16*>(g.p), reinterpret_cast<const __nv_bfloat16*>(z.p),
                                 score.p, pair.p, reinterpret_cast<const __nv_bfloat16*>(dO.p), gather.p,
                                 with_b2 ? reinterpret_cast<const __nv_bfloat16*>(b2.p) : nullptr,
                                 reinterpret_cast<__nv_bfloat16*>(dz.p), reinterpret_cast<__nv_bfloat16*>(as.p), ds.p,
                                 sh.cap, sh.H, sh.I, off.p, sh.E, nullptr);
        CK(cudaDeviceSynchronize());
        auto hdz = dz.get(), has = as.get();
        auto hds = ds.get();
        if (run == 1) {
          ASSERT_EQ(0, std::memcmp(hdz.data(), prev_dz.data(), hdz.size() * 2));
          ASSERT_EQ(0, std::memcmp(has.data(), prev_as.data(), has.size() * 2));
          ASSERT_EQ(0, std::memcmp(hds.data(), prev_ds.data(), hds.size() * 4)) << "dscore not deterministic";
          break;
        }
        prev_dz = hdz, prev_as = has, prev_ds = hds;
        for (int64_t r = 0; r < sh.cap; ++r) {
          const int32_t p = R.pair[r];
          if (r >= sh.total) {
            ASSERT_TRUE(is_poison_f32(hds[p])) << "dscore of row " << r << " written";
            for (int64_t j = 0; j < zw; ++j) ASSERT_TRUE(is_poison_bf16(hdz[r * zw + j]));
            for (int64_t j = 0; j < sh.I; ++j) ASSERT_TRUE(is_poison_bf16(has[r * sh.I + j]));
            continue;
          }
          const double s = R.score[p];
          double dot = 0, sabs = 0;
          for (int64_t j = 0; j < sh.I; ++j) {
            const double gv = b2f(hg[r * sh.I + j]);
            double av;
            if (is_glu(a)) {
              const double gate = b2f(hz[r * zw + 2 * j]), up = b2f(hz[r * zw + 2 * j + 1]);
              av = f64(a, gate) * up;
              expect_close(b2f(hdz[r * zw + 2 * j]), df64(a, gate) * up * s * gv, 1e-2, 1e-2, "dgate", r, j);
              expect_close(b2f(hdz[r * zw + 2 * j + 1]), f64(a, gate) * s * gv, 1e-2, 1e-2, "dup", r, j);
            } else {
              const double zv = b2f(hz[r * zw + j]);
              av = f64(a, zv);
              expect_close(b2f(hdz[r * zw + j]), df64(a, zv) * s * gv, 1e-2, 1e-2, "dz", r, j);
            }
            expect_close(b2f(has[r * sh.I + j]), s * av, 1e-2, 1e-2, "As", r, j);
            dot += gv * av;
            sabs += std::abs(gv * av);
          }
          if (with_b2) {
            const int e = R.expert_of[r];
            const int t = R.gather[r];
            for (int64_t h = 0; h < sh.H; ++h) {
              const double v = double(b2f(hdo[int64_t(t) * sh.H + h])) * b2f(hb2[int64_t(e) * sh.H + h]);
              dot += v;
              sabs += std::abs(v);
            }
          }
          expect_close(hds[p], dot, sabs, 1e-4, "dscore", r, -1);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllActivations, ActivationTest, ::testing::Range(0, kNumActivations),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(activation_name(static_cast<Activation>(i.param)));
                         });

TEST(ExpertBiasGrad, Db1AndDb2MatchFloat64) {
  SONICMOE_REQUIRE_GPU();
  for (const Shape& sh : kShapes) {
    for (int mode = 0; mode < 2; ++mode) {  // 0: db1 (plain colsum), 1: db2 (gathered, scaled)
      std::mt19937 rng(7 + mode);
      Routing R = make_routing(sh.E, sh.T, sh.cap, sh.total, rng);
      const int64_t C = mode ? sh.H : 2 * sh.I + (sh.I % 2);  // odd C in the scalar shape
      const int64_t src_rows = mode ? sh.T : sh.cap;
      auto hs = rand_bf16(src_rows * C, rng);
      Dev<bf16> src(hs), db(int64_t(sh.E) * C), db_again(int64_t(sh.E) * C);
      Dev<int32_t> off(R.offsets), pair(R.pair), gather(R.gather);
      Dev<float> score(R.score);
      for (Dev<bf16>* out : {&db, &db_again})
        cuda::expert_bias_grad(reinterpret_cast<const __nv_bfloat16*>(src.p), mode ? gather.p : nullptr,
                               mode ? score.p : nullptr, mode ? pair.p : nullptr, sh.cap, C, off.p, sh.E,
                               reinterpret_cast<__nv_bfloat16*>(out->p), nullptr);
      CK(cudaDeviceSynchronize());
      auto h = db.get(), h2 = db_again.get();
      ASSERT_EQ(0, std::memcmp(h.data(), h2.data(), h.size() * 2)) << "not deterministic";
      for (int e = 0; e < sh.E; ++e)
        for (int64_t c = 0; c < C; ++c) {
          double want = 0, sabs = 0;
          for (int32_t r = R.offsets[e]; r < R.offsets[e + 1]; ++r) {
            const int64_t sr = mode ? R.gather[r] : r;
            const double w = mode ? R.score[R.pair[r]] : 1.0;
            want += w * b2f(hs[sr * C + c]);
            sabs += std::abs(w * b2f(hs[sr * C + c]));
          }
          if (R.offsets[e] == R.offsets[e + 1]) {
            ASSERT_EQ(h[e * C + c].bits, 0) << "empty expert " << e;
          }
          expect_close(b2f(h[e * C + c]), want, 1e-3 * sabs + 1e-6, 1e-2, "db", e, c);
        }
    }
  }
}

TEST(GatherRows, CopiesValidRowsOnly) {
  SONICMOE_REQUIRE_GPU();
  for (const Shape& sh : kShapes) {
    for (int64_t C : {sh.H, sh.H + 3}) {
      std::mt19937 rng(5);
      Routing R = make_routing(sh.E, sh.T, sh.cap, sh.total, rng);
      auto hs = rand_bf16(int64_t(sh.T) * C, rng);
      Dev<bf16> src(hs), dst(sh.cap * C);
      Dev<int32_t> off(R.offsets), gather(R.gather);
      baselines::gather_rows(reinterpret_cast<const __nv_bfloat16*>(src.p), gather.p, reinterpret_cast<__nv_bfloat16*>(dst.p),
                        sh.cap, C, off.p + sh.E, nullptr);
      CK(cudaDeviceSynchronize());
      auto h = dst.get();
      for (int64_t r = 0; r < sh.cap; ++r)
        for (int64_t c = 0; c < C; ++c) {
          if (r >= sh.total) ASSERT_TRUE(is_poison_bf16(h[r * C + c]));
          else ASSERT_EQ(h[r * C + c].bits, hs[int64_t(R.gather[r]) * C + c].bits) << r << "," << c;
        }
    }
  }
}

}  // namespace
}  // namespace sonicmoe

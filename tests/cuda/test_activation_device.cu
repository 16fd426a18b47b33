// The activation functions as the GPU evaluates them (src/core/activation.h: on the device, sigmoid uses the
// special-function unit's ex2.approx / rcp.approx) against double precision, on a dense grid of inputs and at
// the extremes: saturation to exactly 0 and 1, infinities, NaN. The fused epilogues and the elementwise
// kernels call these same functions.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "core/activation.h"
#include "gpu_test_util.h"

namespace {

namespace act = sonicmoe::act;

__global__ void eval_kernel(const float* x, int n, float* sig, float* silu, float* dsilu) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  sig[i] = act::sigmoid(x[i]);
  silu[i] = act::silu(x[i]);
  dsilu[i] = act::dsilu(x[i]);
}

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

TEST(ActivationDevice, SigmoidSiluDsiluMatchDoublePrecision) {
  SONICMOE_REQUIRE_GPU();
  std::vector<float> x;
  for (int i = -40000; i <= 40000; ++i) x.push_back(i * 1e-3f);  // [-40, 40] step 1e-3
  for (float v : {-1e4f, -200.f, -100.f, -88.f, -87.f, 87.f, 88.f, 100.f, 1e4f, 1e-30f, -1e-30f, 0.0f, -0.0f})
    x.push_back(v);
  const float inf = std::numeric_limits<float>::infinity();
  x.push_back(inf);
  x.push_back(-inf);
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  const int n = static_cast<int>(x.size());
  float *dx, *ds, *dsl, *dd;
  CK(cudaMalloc(&dx, n * sizeof(float)));
  CK(cudaMalloc(&ds, n * sizeof(float)));
  CK(cudaMalloc(&dsl, n * sizeof(float)));
  CK(cudaMalloc(&dd, n * sizeof(float)));
  CK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemset(ds, 0xff, n * sizeof(float)));  // poison: NaN until written
  CK(cudaMemset(dsl, 0xff, n * sizeof(float)));
  CK(cudaMemset(dd, 0xff, n * sizeof(float)));
  eval_kernel<<<(n + 255) / 256, 256>>>(dx, n, ds, dsl, dd);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> s(n), sl(n), d(n);
  CK(cudaMemcpy(s.data(), ds, n * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sl.data(), dsl, n * sizeof(float), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(d.data(), dd, n * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(dx);
  cudaFree(ds);
  cudaFree(dsl);
  cudaFree(dd);

  double worst_sig = 0, worst_silu = 0, worst_dsilu = 0;
  for (int i = 0; i < n; ++i) {
    const double xi = x[i];
    if (std::isnan(xi)) {
      EXPECT_TRUE(std::isnan(s[i]) && std::isnan(sl[i]) && std::isnan(d[i])) << "NaN must propagate";
      continue;
    }
    const double sg = 1.0 / (1.0 + std::exp(-xi));
    const double si = std::isinf(xi) ? (xi > 0 ? xi : 0.0) : xi * sg;
    const double ds_ = sg * (1.0 + (std::isinf(xi) ? 0.0 : xi * (1.0 - sg)));
    if (std::isinf(xi)) {
      EXPECT_EQ(s[i], xi > 0 ? 1.0f : 0.0f) << "sigmoid(" << xi << ")";
      if (xi > 0) EXPECT_EQ(sl[i], inf) << "silu(+inf)";
      continue;
    }
    // Relative error where the exact value is above 1e-30 (dsilu: relative to max(|dsilu|, 1e-3), near its zero
    // crossing an absolute error); where the exact sigmoid is below 1e-30, the device's must be too.
    auto rel = [](double got, double want) {
      return std::abs(got - want) / std::max(std::abs(want), 1e-30);
    };
    if (sg > 1e-30) worst_sig = std::max(worst_sig, rel(s[i], sg));
    else EXPECT_LE(s[i], 1e-30f) << "sigmoid(" << xi << ")";
    if (std::abs(si) > 1e-30) worst_silu = std::max(worst_silu, rel(sl[i], si));
    if (std::abs(ds_) > 1e-6) worst_dsilu = std::max(worst_dsilu, std::abs(d[i] - ds_) / std::max(std::abs(ds_), 1e-3));
    EXPECT_GE(s[i], 0.0f);
    EXPECT_LE(s[i], 1.0f);
  }
  // bf16 keeps 8 significant bits (relative spacing 2^-8 = 3.9e-3); the device forms stay far below that.
  EXPECT_LT(worst_sig, 1e-5) << "sigmoid";
  EXPECT_LT(worst_silu, 1e-5) << "silu";
  EXPECT_LT(worst_dsilu, 1e-5) << "dsilu";
  std::printf("max relative error on the device: sigmoid %.2e, silu %.2e, dsilu %.2e\n", worst_sig, worst_silu,
              worst_dsilu);
}

}  // namespace

// fp32 main_grad accumulation on the GPU (MoEWeights::w1_main_grad / w2_main_grad: the varlen-K kernels' accumulating
// epilogue, VarlenKAccumF32Cfg): main_grad_check.h's contract (into zeros: bitwise the plain dW once rounded; into
// random values: exactly their fp32 sum; repeats bitwise; every other gradient bitwise unchanged) on shapes that
// reach each kernel variant: dW1 direct (< 1024 rows an expert) and swapped (the transposed store), dW2, the
// concatenated W1 layout both ways, partial M / N tiles (H = 264, I = 200), experts without rows (E = 60, K = 1), f16,
// and the FP8 layer's bf16 weight gradients.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "cuda/gpu_test_util.h"
#include "cuda/layer_case.h"
#include "main_grad_check.h"

namespace sonicmoe {
namespace {

struct MainGradCase {
  const char* name;
  testing_util::LayerCase c;
  DType dt;
  W1Layout layout;
  Precision precision;
};

class MainGradCuda : public ::testing::TestWithParam<MainGradCase> {};

TEST_P(MainGradCuda, AddsTheUnroundedGradientAndNothingElseChanges) {
  if (!testing::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const MainGradCase& p = GetParam();
  const testing_util::LayerCase& c = p.c;
  MoEConfig cfg{c.E, c.K, c.H, c.I, c.act, c.bias};
  cfg.w1_layout = p.layout;
  cfg.precision = p.precision;
  std::mt19937 rng(static_cast<unsigned>(c.T + 7 * c.E));
  const testing_util::LayerInputs in = testing_util::make_layer_inputs(c, cfg.z_width(), rng, p.dt)
                                           .to(Device::cuda());
  const Context ctx = testing_util::gpu_ctx();
  const ForwardResult f = moe_forward(ctx, cfg, in.x, in.weights(), {});
  testing_util::expect_main_grad_contract(ctx, in.x, in.weights(), f.saved, in.d_out, 11u + static_cast<unsigned>(c.E),
                                          /*two_part=*/p.precision == Precision::bf16);
}

using testing_util::LayerCase;
constexpr RoutingMode kTopK = RoutingMode::topk;
INSTANTIATE_TEST_SUITE_P(
    Cases, MainGradCuda,
    ::testing::Values(
        // ~120 rows an expert: dW1 by the direct kernel; partial tiles in M and N of both GEMMs
        MainGradCase{"direct_partial_tiles", LayerCase{300, 264, 200, 5, 2, Activation::swiglu, true, kTopK, 0, false},
                     DType::bf16, W1Layout::interleaved, Precision::bf16},
        // 1300 rows an expert: dW1 by the swapped kernel (D^T computed, D stored transposed)
        MainGradCase{"swapped_dw1", LayerCase{2600, 264, 200, 4, 2, Activation::swiglu, false, kTopK, 0, true},
                     DType::bf16, W1Layout::interleaved, Precision::bf16},
        MainGradCase{"concat_direct", LayerCase{300, 264, 200, 5, 2, Activation::geglu, true, kTopK, 0, false},
                     DType::bf16, W1Layout::concatenated, Precision::bf16},
        MainGradCase{"concat_swapped", LayerCase{2600, 136, 72, 4, 2, Activation::swiglu, false, kTopK, 0, false},
                     DType::bf16, W1Layout::concatenated, Precision::bf16},
        MainGradCase{"empty_experts", LayerCase{50, 128, 64, 60, 1, Activation::relu, false, kTopK, 0, false},
                     DType::bf16, W1Layout::interleaved, Precision::bf16},
        MainGradCase{"f16", LayerCase{700, 128, 96, 6, 3, Activation::swiglu, true, kTopK, 0, false}, DType::f16,
                     W1Layout::interleaved, Precision::bf16},
        MainGradCase{"fp8_layer", LayerCase{300, 256, 128, 4, 2, Activation::swiglu, false, kTopK, 0, false},
                     DType::bf16, W1Layout::interleaved, Precision::fp8_blockwise}),
    [](const ::testing::TestParamInfo<MainGradCase>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace sonicmoe

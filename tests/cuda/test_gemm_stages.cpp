// The cuda backend's GEMM stages (up/down projection, expert input grad, weight grads with bias grads)
// against the CPU reference stages on the same bf16 (or f16) inputs and metadata (one expert left empty).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda/gpu_test_util.h"
#include "moe/w1_layout.h"
#include "sonicmoe/error.h"
#include "sonicmoe/stages.h"
#include "w1_layout_util.h"

namespace sonicmoe {
namespace {

using testing::host_randn;
using testing::rel_err;

Tensor gpu_out(const std::vector<std::int64_t>& shape, DType dt = DType::bf16) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda(0));
  cudaMemset(t.data(), 0xFF, t.nbytes());  // NaN poison
  return t;
}

struct StageFixture {
  std::int64_t T = 300, H = 136, I = 72, E = 6, K = 2;
  Context cpu, gpu;
  RoutingMetadata meta_c, meta_g;
  Tensor pair_score_c, pair_score_g;
  std::mt19937 rng{7};
  DType dt = DType::bf16;  // the stages' 16-bit storage

  StageFixture() { init(); }
  StageFixture(std::int64_t t, std::int64_t h, std::int64_t i, std::int64_t e) : T(t), H(h), I(i), E(e) { init(); }
  void init() {
    gpu.backend = Backend::cuda;
    std::vector<std::int32_t> tok, ex;
    std::uniform_int_distribution<int> d(0, static_cast<int>(E) - 2);  // expert E-1 gets no rows
    for (std::int64_t t = 0; t < T; ++t) {
      const int e0 = d(rng);
      int e1 = d(rng);
      if (e1 == e0) e1 = (e0 + 1) % static_cast<int>(E - 1);
      tok.push_back(static_cast<std::int32_t>(t));
      ex.push_back(e0);
      tok.push_back(static_cast<std::int32_t>(t));
      ex.push_back(e1);
    }
    const std::int64_t N = static_cast<std::int64_t>(tok.size());
    Tensor pt = Tensor::empty({N}, DType::i32), pe = Tensor::empty({N}, DType::i32);
    std::copy(tok.begin(), tok.end(), pt.ptr<std::int32_t>());
    std::copy(ex.begin(), ex.end(), pe.ptr<std::int32_t>());
    meta_c = build_metadata(cpu, pt, pe, T, E);
    meta_g = meta_c;
    const Device g = Device::cuda(0);
    meta_g.counts = meta_c.counts.to(g);
    meta_g.offsets = meta_c.offsets.to(g);
    meta_g.pair = meta_c.pair.to(g);
    meta_g.gather = meta_c.gather.to(g);
    meta_g.rev = meta_c.rev.to(g);
    meta_g.token_offsets = meta_c.token_offsets.to(g);
    pair_score_c = Tensor::empty({N}, DType::f32);
    std::uniform_real_distribution<float> sd(0.1f, 1.0f);
    for (std::int64_t i = 0; i < N; ++i) pair_score_c.ptr<float>()[i] = sd(rng);
    pair_score_g = pair_score_c.to(g);
  }
  Tensor rnd(const std::vector<std::int64_t>& shape) { return host_randn(shape, dt, 1.0f, rng); }
  std::int64_t N() const { return meta_c.num_pairs; }
};

constexpr double kTol = 1e-2;

// A host tensor on the GPU; an absent (optional) one stays absent.
Tensor gpu_copy(const Tensor& t) { return t.defined() ? t.to(Device::cuda(0)) : Tensor(); }

// up_projection on both backends on the same inputs (b1 may be absent): the GPU's Z and A close to the
// reference's, which are returned.
struct UpOut {
  Tensor z, a;
};
UpOut expect_up_projection(StageFixture& s, Activation act, const Tensor& x, const Tensor& w1, const Tensor& b1) {
  const std::int64_t N = s.N(), ZW = is_glu(act) ? 2 * s.I : s.I;
  Tensor zc = Tensor::empty({N, ZW}, s.dt), ac = Tensor::empty({N, s.I}, s.dt);
  Tensor zg = gpu_out({N, ZW}, s.dt), ag = gpu_out({N, s.I}, s.dt);
  up_projection(s.cpu, act, x, w1, b1, s.meta_c, zc, ac);
  up_projection(s.gpu, act, gpu_copy(x), gpu_copy(w1), gpu_copy(b1), s.meta_g, zg, ag);
  cudaDeviceSynchronize();
  EXPECT_LT(rel_err(zg, zc), kTol);
  EXPECT_LT(rel_err(ag, ac), kTol);
  return {zc, ac};
}

// dgated on both backends on the same inputs (b2 may be absent): the GPU's dZ, s*A and score gradient (poisoned
// first) close to the reference's.
void expect_dgated(StageFixture& s, Activation act, const Tensor& dO, const Tensor& w2, const Tensor& b2,
                   const Tensor& z) {
  const std::int64_t N = s.N(), ZW = is_glu(act) ? 2 * s.I : s.I;
  Tensor dzc = Tensor::empty({N, ZW}, s.dt), asc = Tensor::empty({N, s.I}, s.dt);
  Tensor dsc = Tensor::empty({N}, DType::f32);
  Tensor dzg = gpu_out({N, ZW}, s.dt), asg = gpu_out({N, s.I}, s.dt);
  Tensor dsg = Tensor::empty({N}, DType::f32, Device::cuda(0));
  cudaMemset(dsg.data(), 0xFF, dsg.nbytes());
  dgated(s.cpu, act, dO, w2, b2, z, s.pair_score_c, s.meta_c, dzc, asc, dsc);
  dgated(s.gpu, act, gpu_copy(dO), gpu_copy(w2), gpu_copy(b2), gpu_copy(z), s.pair_score_g, s.meta_g, dzg, asg, dsg);
  cudaDeviceSynchronize();
  EXPECT_LT(rel_err(dzg, dzc), kTol);
  EXPECT_LT(rel_err(asg, asc), kTol);
  EXPECT_LT(rel_err(dsg, dsc), kTol);
}

TEST(CudaGemmStages, UpAndDownProjection) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s;
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N(), ZW = 2 * s.I;
  Tensor x = s.rnd({s.T, s.H}), w1 = s.rnd({s.E, ZW, s.H}), b1 = s.rnd({s.E, ZW});
  const Tensor ac = expect_up_projection(s, Activation::swiglu, x, w1, b1).a;

  Tensor w2 = s.rnd({s.E, s.H, s.I}), b2 = s.rnd({s.E, s.H});
  Tensor yc = Tensor::empty({N, s.H}, DType::bf16), yg = gpu_out({N, s.H});
  down_projection(s.cpu, ac, w2, b2, s.meta_c, yc);
  down_projection(s.gpu, ac.to(g), w2.to(g), b2.to(g), s.meta_g, yg);
  cudaDeviceSynchronize();
  EXPECT_LT(rel_err(yg, yc), kTol);

  // Non-GLU activation without bias.
  expect_up_projection(s, Activation::gelu, x, s.rnd({s.E, s.I, s.H}), Tensor());
}

// The three stages that touch W1 under W1Layout::concatenated, on the GPU: bitwise the interleaved stage's Z, A and
// dXe on the same W1 interleaved, and its dW1 / db1 moved to the concatenated rows. Shapes: partial tiles (2I = 144,
// 400; H = 136) with an empty expert; 8000 rows over 6 experts take the swapped (D^T) dW1 kernel (heuristics.h).
TEST(CudaGemmStages, W1ConcatenatedBitwiseEqualsInterleaved) {
  SONICMOE_REQUIRE_GPU();
  using Shape = std::tuple<int, int, int, int>;  // T, H, I, E
  for (auto [T, H, I, E] : {Shape{300, 136, 72, 6}, Shape{4000, 136, 200, 6}}) {
    SCOPED_TRACE("T " + std::to_string(T) + ", I " + std::to_string(I));
    StageFixture s(T, H, I, E);
    const Device g = Device::cuda(0);
    const std::int64_t N = s.N(), ZW = 2 * s.I;
    Tensor x = s.rnd({s.T, s.H}), w1 = s.rnd({s.E, ZW, s.H}), b1 = s.rnd({s.E, ZW}), dz = s.rnd({N, ZW});
    const Tensor xg = x.to(g), w1g = w1.to(g), b1g = b1.to(g), dzg = dz.to(g);
    const Tensor w1cg = testing_util::w1_rows_to_concat(w1).to(g), b1cg = testing_util::w1_rows_to_concat(b1).to(g);
    const W1Layout cat = W1Layout::concatenated;

    Tensor zi = gpu_out({N, ZW}), ai = gpu_out({N, s.I}), zc = gpu_out({N, ZW}), ac = gpu_out({N, s.I});
    up_projection(s.gpu, Activation::swiglu, xg, w1g, b1g, s.meta_g, zi, ai);
    up_projection(s.gpu, Activation::swiglu, xg, w1cg, b1cg, s.meta_g, zc, ac, cat);
    Tensor dxi = gpu_out({N, s.H}), dxc = gpu_out({N, s.H});
    expert_input_grad(s.gpu, dzg, w1g, s.meta_g, dxi);
    expert_input_grad(s.gpu, dzg, w1cg, s.meta_g, dxc, cat);
    Tensor dw1i = gpu_out({s.E, ZW, s.H}), db1i = gpu_out({s.E, ZW});
    Tensor dw1c = gpu_out({s.E, ZW, s.H}), db1c = gpu_out({s.E, ZW});
    weight_grad_w1(s.gpu, dzg, xg, s.meta_g, dw1i, db1i);
    weight_grad_w1(s.gpu, dzg, xg, s.meta_g, dw1c, db1c, cat);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(zc, zi)) << "z";
    EXPECT_TRUE(testing::bitwise_equal(ac, ai)) << "a";
    EXPECT_TRUE(testing::bitwise_equal(dxc, dxi)) << "dxe";
    EXPECT_TRUE(testing::bitwise_equal(dw1c, testing_util::w1_rows_to_concat(dw1i))) << "dw1";
    EXPECT_TRUE(testing::bitwise_equal(db1c, testing_util::w1_rows_to_concat(db1i))) << "db1";
    // Not only self-consistent: the concatenated stages are close to the CPU reference stages of that layout.
    Tensor dw1r = Tensor::empty({s.E, ZW, s.H}, DType::bf16), db1r = Tensor::empty({s.E, ZW}, DType::bf16);
    weight_grad_w1(s.cpu, dz, x, s.meta_c, dw1r, db1r, cat);
    EXPECT_LT(rel_err(dw1c, dw1r), kTol);
    EXPECT_LT(rel_err(db1c, db1r), kTol);
  }
}

// A [2, ...] separate-layout view (w1_separate_view) of `parts` ([2, E, I, ...] on the host) on the GPU, the up part
// `gap` elements after the gate's end in one buffer (a part stride other than E * I * ...); `buf` keeps the memory.
TensorView separate_on_gpu(const Tensor& parts, std::int64_t gap, Tensor& buf) {
  const std::int64_t part = parts.numel() / 2, es = static_cast<std::int64_t>(dtype_size(parts.dtype()));
  buf = Tensor::zeros({2 * part + gap}, parts.dtype(), Device::cuda(0));
  std::vector<std::int64_t> shape(parts.view().shape.begin() + 1, parts.view().shape.begin() + parts.ndim());
  char* base = static_cast<char*>(buf.data());
  const TensorView gate(base, parts.dtype(), shape, Device::cuda(0));
  const TensorView up(base + (part + gap) * es, parts.dtype(), shape, Device::cuda(0));
  copy(gate, w1_part(parts, 0));
  copy(up, w1_part(parts, 1));
  return w1_separate_view("test", "gate", gate, "up", up);
}
// A [2, ...] separate-layout view back on the host as one [2, ...] tensor.
Tensor separate_to_host(const TensorView& v) {
  std::vector<std::int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor out = Tensor::empty(shape, v.dtype);
  copy(w1_part(out, 0), w1_part(v, 0));
  copy(w1_part(out, 1), w1_part(v, 1));
  return out;
}

// The three stages under W1Layout::separate, on the GPU: W1 / b1 and dW1 / db1 as gate / up parts of one buffer with a
// gap between them (part stride E * I * H + 64, E * I + 8: the runtime strides of the same descriptor / remap) give
// bitwise the interleaved stage's Z, A and dXe, and its dW1 / db1 split into the parts. Shapes as the concatenated test.
TEST(CudaGemmStages, W1SeparateBitwiseEqualsInterleaved) {
  SONICMOE_REQUIRE_GPU();
  using Shape = std::tuple<int, int, int, int>;  // T, H, I, E
  for (auto [T, H, I, E] : {Shape{300, 136, 72, 6}, Shape{4000, 136, 200, 6}}) {
    SCOPED_TRACE("T " + std::to_string(T) + ", I " + std::to_string(I));
    StageFixture s(T, H, I, E);
    const Device g = Device::cuda(0);
    const std::int64_t N = s.N(), ZW = 2 * s.I;
    Tensor x = s.rnd({s.T, s.H}), w1 = s.rnd({s.E, ZW, s.H}), b1 = s.rnd({s.E, ZW}), dz = s.rnd({N, ZW});
    const Tensor xg = x.to(g), w1g = w1.to(g), b1g = b1.to(g), dzg = dz.to(g);
    Tensor w1buf, b1buf, dw1buf, db1buf;
    const TensorView w1sg = separate_on_gpu(testing_util::w1_rows_to_separate(w1), 64, w1buf);
    const TensorView b1sg = separate_on_gpu(testing_util::w1_rows_to_separate(b1), 8, b1buf);
    const TensorView dw1s = separate_on_gpu(Tensor::zeros({2, s.E, s.I, s.H}, DType::bf16), 64, dw1buf);
    const TensorView db1s = separate_on_gpu(Tensor::zeros({2, s.E, s.I}, DType::bf16), 8, db1buf);
    const W1Layout sep = W1Layout::separate;

    Tensor zi = gpu_out({N, ZW}), ai = gpu_out({N, s.I}), zs = gpu_out({N, ZW}), as = gpu_out({N, s.I});
    up_projection(s.gpu, Activation::swiglu, xg, w1g, b1g, s.meta_g, zi, ai);
    up_projection(s.gpu, Activation::swiglu, xg, w1sg, b1sg, s.meta_g, zs, as, sep);
    Tensor dxi = gpu_out({N, s.H}), dxs = gpu_out({N, s.H});
    expert_input_grad(s.gpu, dzg, w1g, s.meta_g, dxi);
    expert_input_grad(s.gpu, dzg, w1sg, s.meta_g, dxs, sep);
    Tensor dw1i = gpu_out({s.E, ZW, s.H}), db1i = gpu_out({s.E, ZW});
    weight_grad_w1(s.gpu, dzg, xg, s.meta_g, dw1i, db1i);
    weight_grad_w1(s.gpu, dzg, xg, s.meta_g, dw1s, db1s, sep);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(testing::bitwise_equal(zs, zi)) << "z";
    EXPECT_TRUE(testing::bitwise_equal(as, ai)) << "a";
    EXPECT_TRUE(testing::bitwise_equal(dxs, dxi)) << "dxe";
    EXPECT_TRUE(testing::bitwise_equal(separate_to_host(dw1s), testing_util::w1_rows_to_separate(dw1i))) << "dw1";
    EXPECT_TRUE(testing::bitwise_equal(separate_to_host(db1s), testing_util::w1_rows_to_separate(db1i))) << "db1";
  }
}

void check_backward_gemms(DType dt) {
  StageFixture s;
  s.dt = dt;
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N(), ZW = 2 * s.I;
  Tensor x = s.rnd({s.T, s.H}), w1 = s.rnd({s.E, ZW, s.H}), dz = s.rnd({N, ZW});
  Tensor dO = s.rnd({s.T, s.H}), as = s.rnd({N, s.I});

  Tensor dxc = Tensor::empty({N, s.H}, dt), dxg = gpu_out({N, s.H}, dt);
  expert_input_grad(s.cpu, dz, w1, s.meta_c, dxc);
  expert_input_grad(s.gpu, dz.to(g), w1.to(g), s.meta_g, dxg);

  Tensor dw1c = Tensor::empty({s.E, ZW, s.H}, dt), db1c = Tensor::empty({s.E, ZW}, dt);
  Tensor dw1g = gpu_out({s.E, ZW, s.H}, dt), db1g = gpu_out({s.E, ZW}, dt);
  weight_grad_w1(s.cpu, dz, x, s.meta_c, dw1c, db1c);
  weight_grad_w1(s.gpu, dz.to(g), x.to(g), s.meta_g, dw1g, db1g);

  Tensor dw2c = Tensor::empty({s.E, s.H, s.I}, dt), db2c = Tensor::empty({s.E, s.H}, dt);
  Tensor dw2g = gpu_out({s.E, s.H, s.I}, dt), db2g = gpu_out({s.E, s.H}, dt);
  weight_grad_w2(s.cpu, dO, as, s.pair_score_c, s.meta_c, dw2c, db2c);
  weight_grad_w2(s.gpu, dO.to(g), as.to(g), s.pair_score_g, s.meta_g, dw2g, db2g);
  cudaDeviceSynchronize();
  EXPECT_LT(rel_err(dxg, dxc), kTol);
  EXPECT_LT(rel_err(dw1g, dw1c), kTol);
  EXPECT_LT(rel_err(db1g, db1c), kTol);
  EXPECT_LT(rel_err(dw2g, dw2c), kTol);
  EXPECT_LT(rel_err(db2g, db2c), kTol);
  // The empty expert's gradients are exactly zero.
  Tensor h = dw1g.to(Device::cpu());
  const std::int64_t slice = ZW * s.H;
  for (std::int64_t i = (s.E - 1) * slice; i < s.E * slice; ++i)
    ASSERT_EQ(testing::value(h, i), 0.0) << "empty expert dW1 not zero at " << i;
}

TEST(CudaGemmStages, BackwardGemms) {
  SONICMOE_REQUIRE_GPU();
  check_backward_gemms(DType::bf16);
}

// Step 7 (dgated): GEMM into G, then A recomputed from Z, dZ, s*A and the per-pair score gradient, for a
// GLU and a plain activation, with and without b2 (whose term adds <dO, b2> to the score gradient).
void check_dgated(StageFixture& s) {
  const std::int64_t N = s.N();
  for (Activation act : {Activation::swiglu, Activation::relu_sq}) {
    for (bool bias : {false, true}) {
      SCOPED_TRACE(::testing::Message() << activation_name(act) << " bias=" << bias);
      const std::int64_t ZW = is_glu(act) ? 2 * s.I : s.I;
      Tensor dO = s.rnd({s.T, s.H}), w2 = s.rnd({s.E, s.H, s.I}), z = s.rnd({N, ZW});
      expect_dgated(s, act, dO, w2, bias ? s.rnd({s.E, s.H}) : Tensor(), z);
    }
  }
}

// H < 3072: the four-warpgroup dgated kernel.
TEST(CudaGemmStages, Dgated) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s;
  check_dgated(s);
}

// H >= 3072 (heuristics.h, dgated_mma_gather): the kernel whose MMA warps gather dO's rows; H = 3080 ends
// in a k-tile 8 wide.
TEST(CudaGemmStages, DgatedLongK) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s(300, 3080, 72, 6);
  check_dgated(s);
}

// The fused epilogues for every activation on a shape with several M, N and K tiles, partial ones included
// (H = 520: 9 k-tiles of the up-projection, the last one 8 wide; I = 264: z width 528 = 3 N tiles).
void check_fused_epilogues(DType dt) {
  StageFixture s(700, 520, 264, 5);
  s.dt = dt;
  for (int ai = 0; ai < kNumActivations; ++ai) {
    const Activation act = static_cast<Activation>(ai);
    SCOPED_TRACE(activation_name(act));
    const std::int64_t ZW = is_glu(act) ? 2 * s.I : s.I;
    const bool bias = ai % 2 == 0;
    Tensor x = s.rnd({s.T, s.H}), w1 = s.rnd({s.E, ZW, s.H});
    Tensor b1 = bias ? s.rnd({s.E, ZW}) : Tensor();
    const Tensor zc = expect_up_projection(s, act, x, w1, b1).z;

    Tensor dO = s.rnd({s.T, s.H}), w2 = s.rnd({s.E, s.H, s.I});
    expect_dgated(s, act, dO, w2, bias ? s.rnd({s.E, s.H}) : Tensor(), zc);
  }
}

TEST(CudaGemmStages, FusedEpiloguesEveryActivation) {
  SONICMOE_REQUIRE_GPU();
  check_fused_epilogues(DType::bf16);
}

// f16 storage: the same kernels instantiated for f16 operands (instances/f16/) against the CPU reference in f16.
// Every activation's up-projection and dgated epilogue (the wide dgated kernel: H < 3072), the long-K dgated kernel,
// the backward GEMMs (varlen-K with gathered / contiguous operands, bias gradients) and the down-projection.
TEST(CudaGemmStages, F16FusedEpiloguesEveryActivation) {
  SONICMOE_REQUIRE_GPU();
  check_fused_epilogues(DType::f16);
}

TEST(CudaGemmStages, F16BackwardGemmsAndLongKDgated) {
  SONICMOE_REQUIRE_GPU();
  check_backward_gemms(DType::f16);
  StageFixture s(300, 3080, 72, 6);
  s.dt = DType::f16;
  check_dgated(s);
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N();
  Tensor a = s.rnd({N, s.I}), w2 = s.rnd({s.E, s.H, s.I}), b2 = s.rnd({s.E, s.H});
  Tensor yc = Tensor::empty({N, s.H}, DType::f16), yg = gpu_out({N, s.H}, DType::f16);
  down_projection(s.cpu, a, w2, b2, s.meta_c, yc);
  down_projection(s.gpu, a.to(g), w2.to(g), b2.to(g), s.meta_g, yg);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_LT(rel_err(yg, yc), kTol);
}

// One 16-bit type per call: an f16 tensor among bf16 ones is refused, naming it.
TEST(CudaGemmStages, RejectsMixedF16AndBf16) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s;
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N();
  Tensor a = Tensor::zeros({N, s.I}, DType::bf16, g), w2 = Tensor::zeros({s.E, s.H, s.I}, DType::f16, g);
  Tensor y = Tensor::zeros({N, s.H}, DType::bf16, g);
  try {
    down_projection(s.gpu, a, w2, TensorView(), s.meta_g, y);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f16"), std::string::npos) << e.what();
  }
}

TEST(CudaGemmStages, RejectsF32) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s;
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N();
  Tensor a = Tensor::zeros({N, s.I}, DType::f32, g), w2 = Tensor::zeros({s.E, s.H, s.I}, DType::f32, g);
  Tensor y = Tensor::zeros({N, s.H}, DType::f32, g);
  EXPECT_THROW(down_projection(s.gpu, a, w2, TensorView(), s.meta_g, y), Error);
}

// A thread whose first CUDA work is a GEMM stage (no runtime call before it: every buffer was made elsewhere, as
// in PyTorch's autograd worker with a warm caching allocator) has no current context; the TMA descriptors must
// still be built (they once failed there with CUDA_ERROR_INVALID_CONTEXT, and CuTe's failure path crashed).
TEST(CudaGemmStages, FromAThreadWithoutACurrentContext) {
  SONICMOE_REQUIRE_GPU();
  StageFixture s;
  const Device g = Device::cuda(0);
  const std::int64_t N = s.N();
  Tensor a = s.rnd({N, s.I}), w2 = s.rnd({s.E, s.H, s.I});
  Tensor yc = Tensor::empty({N, s.H}, DType::bf16), yg = gpu_out({N, s.H});
  down_projection(s.cpu, a, w2, TensorView(), s.meta_c, yc);
  Tensor ag = a.to(g), w2g = w2.to(g);
  cudaDeviceSynchronize();
  std::string error;
  std::thread worker([&] {
    try {
      down_projection(s.gpu, ag, w2g, TensorView(), s.meta_g, yg);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  worker.join();
  cudaDeviceSynchronize();
  EXPECT_EQ(error, "");
  EXPECT_LT(rel_err(yg, yc), kTol);
}

}  // namespace
}  // namespace sonicmoe

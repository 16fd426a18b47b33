// The dispatched-token entries and the expert-parallel layer on the cuda backend (bf16): the DeepEP and Megatron
// contracts against the CPU reference on the same bf16 inputs, Megatron's in f16 too (and bitwise against the GPU's
// own general routing),
// the debug scan, and the EP layer over NCCL with one rank per visible GPU (up to 2) against the single-GPU layer on
// the concatenated batch. Skips without a GPU (and the NCCL case without NCCL).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "gpu_test_util.h"
#include "reference/fp8_ref.h"
#include "sonicmoe/dispatched.h"
#include "sonicmoe/ep.h"
#include "sonicmoe/error.h"
#include "sonicmoe/quant.h"
#ifdef SONICMOE_WITH_NCCL
#include <nccl.h>
#endif

namespace {

using namespace sonicmoe;
using sonicmoe::testing::bitwise_equal;
using sonicmoe::testing::host_randn;
using sonicmoe::testing::rel_err;

struct Experts {
  MoEConfig cfg;
  Tensor w1, w2;  // host bf16
  MoEWeights on(const std::vector<Tensor>& keep) const { return {TensorView(), keep[0], TensorView(), keep[1], TensorView()}; }
};

Experts make_experts(std::int64_t E, std::int64_t H, std::int64_t I, std::mt19937& rng, DType dt = DType::bf16) {
  Experts x;
  x.cfg.num_experts = E;
  x.cfg.top_k = 1;
  x.cfg.hidden_size = H;
  x.cfg.intermediate_size = I;
  x.w1 = host_randn({E, 2 * I, H}, dt, 0.05f, rng);
  x.w2 = host_randn({E, H, I}, dt, 0.05f, rng);
  return x;
}

Context gpu_ctx(int device = 0) {
  Context c;
  c.backend = Backend::cuda;
  c.device_index = device;
  return c;
}

TEST(CudaDispatched, DeepEPMatchesReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  const std::int64_t N = 300, K = 4, E = 6, H = 256, I = 128;
  Experts ex = make_experts(E, H, I, rng);
  std::vector<std::int32_t> idx(N * K);
  std::int64_t P = 0;
  for (std::int64_t s = 0; s < N * K; ++s) {
    idx[s] = rng() % 3 == 0 ? -1 : static_cast<std::int32_t>((s * 7 + s / K) % (E - 1));  // expert E-1 unused
    if (s / K == 5) idx[s] = -1;                                                       // a row without experts
    P += idx[s] >= 0;
  }
  // distinct ids per row are not required by the contract, but DeepEP sends distinct ones: dedupe to -1
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t a = 0; a < K; ++a)
      for (std::int64_t b = 0; b < a; ++b)
        if (idx[n * K + a] >= 0 && idx[n * K + a] == idx[n * K + b]) { idx[n * K + a] = -1; --P; }
  Tensor hidx = Tensor::empty({N, K}, DType::i32);
  std::copy(idx.begin(), idx.end(), hidx.ptr<std::int32_t>());
  Tensor hx = host_randn({N, H}, DType::bf16, 1.0f, rng), hw = host_randn({N, K}, DType::f32, 0.5f, rng);
  Tensor hd = host_randn({N, H}, DType::bf16, 1.0f, rng);
  const Device g = Device::cuda(0);
  const Context gpu = gpu_ctx(), cpu;
  Tensor dx = hx.to(g), didx = hidx.to(g), dw = hw.to(g), dd = hd.to(g);
  const std::vector<Tensor> gw = {ex.w1.to(g), ex.w2.to(g)}, cw = {ex.w1, ex.w2};

  const DispatchedForward ref = moe_forward_deepep(cpu, ex.cfg, hx, hidx, hw, ex.on(cw));
  const DispatchedGradients rg = moe_backward_dispatched(cpu, hx, ex.on(cw), ref, hd);
  for (std::int64_t np : {std::int64_t{-1}, P}) {
    DispatchedOptions opt;
    opt.num_pairs = np;
    const DispatchedForward f = moe_forward_deepep(gpu, ex.cfg, dx, didx, dw, ex.on(gw), opt);
    const DispatchedGradients gg = moe_backward_dispatched(gpu, dx, ex.on(gw), f, dd);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_err(f.output, ref.output), 2e-2) << "num_pairs " << np;
    EXPECT_LT(rel_err(gg.dx, rg.dx), 2e-2);
    EXPECT_LT(rel_err(gg.dw1, rg.dw1), 2e-2);
    EXPECT_LT(rel_err(gg.dw2, rg.dw2), 2e-2);
    EXPECT_LT(rel_err(gg.dweights, rg.dweights), 2e-2);
    Tensor hdw = gg.dweights.to(Device::cpu());
    for (std::int64_t s = 0; s < N * K; ++s)
      if (idx[s] < 0) ASSERT_EQ(hdw.ptr<float>()[s], 0.0f) << "slot " << s;
  }
  // debug: an id outside [-1, E) is an Error (without debug it counts as -1)
  idx[3] = static_cast<std::int32_t>(E);
  std::copy(idx.begin(), idx.end(), hidx.ptr<std::int32_t>());
  Tensor bad = hidx.to(g);
  DispatchedOptions dbg;
  dbg.debug = true;
  EXPECT_THROW(moe_forward_deepep(gpu, ex.cfg, dx, bad, dw, ex.on(gw), dbg), Error);
  EXPECT_NO_THROW(moe_forward_deepep(gpu, ex.cfg, dx, bad, dw, ex.on(gw)));
}

// DeepEP's FP8 dispatch (moe_forward_deepep_fp8): the codes and scales of bf16 rows quantised by the CPU; on the GPU
// bitwise moe_forward_deepep (precision fp8_blockwise) on the dequantised rows, forward and backward (the GPU
// quantises those rows back to the same codes; the backward's dW1 reads the same dequantised values), and close to
// the CPU entry on the same codes.
TEST(CudaDispatched, DeepEPFp8MatchesReferenceAndDequantisedRows) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(9);
  const std::int64_t N = 300, K = 4, E = 6, H = 256, I = 128;
  Experts ex = make_experts(E, H, I, rng);
  ex.cfg.precision = Precision::fp8_blockwise;
  std::vector<std::int32_t> idx(N * K);
  for (std::int64_t s = 0; s < N * K; ++s)  // distinct ids per row, some -1, row 5 without local experts
    idx[s] = (s / K == 5 || rng() % 3 == 0) ? -1 : static_cast<std::int32_t>((s / K + s % K) % (E - 1));
  Tensor hidx = Tensor::empty({N, K}, DType::i32);
  std::copy(idx.begin(), idx.end(), hidx.ptr<std::int32_t>());
  Tensor hx = host_randn({N, H}, DType::bf16, 1.0f, rng), hw = host_randn({N, K}, DType::f32, 0.5f, rng);
  Tensor hd = host_randn({N, H}, DType::bf16, 1.0f, rng);
  const Context gpu = gpu_ctx(), cpu;
  Tensor hq = Tensor::empty({N, H}, DType::f8e4m3), hs = Tensor::empty({N, H / 128}, DType::f32);
  fp8_quantize_rows(cpu, hx, TensorView(), hq, hs);
  // the rows' values in bf16 (exact: 4-bit codes times power-of-two scales)
  Tensor hxd = Tensor::empty({N, H}, DType::bf16);
  {
    const Tensor d = ref::fp8_dequantize(hq, hs, 1, 128);
    for (std::int64_t i = 0; i < N * H; ++i) hxd.ptr<bf16>()[i] = float_to_bf16(d.ptr<const float>()[i]);
  }
  const Device g = Device::cuda(0);
  Tensor gq = hq.to(g), gs = hs.to(g), gxd = hxd.to(g), didx = hidx.to(g), dw = hw.to(g), dd = hd.to(g);
  const std::vector<Tensor> gw = {ex.w1.to(g), ex.w2.to(g)}, cw = {ex.w1, ex.w2};

  const DispatchedForward f8 = moe_forward_deepep_fp8(gpu, ex.cfg, {gq, gs}, didx, dw, ex.on(gw));
  const DispatchedGradients g8 = moe_backward_dispatched_fp8(gpu, {gq, gs}, ex.on(gw), f8, dd);
  const DispatchedForward f = moe_forward_deepep(gpu, ex.cfg, gxd, didx, dw, ex.on(gw));
  const DispatchedGradients gg = moe_backward_dispatched(gpu, gxd, ex.on(gw), f, dd);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(f8.output, f.output));
  EXPECT_TRUE(bitwise_equal(g8.dx, gg.dx));
  EXPECT_TRUE(bitwise_equal(g8.dw1, gg.dw1));
  EXPECT_TRUE(bitwise_equal(g8.dw2, gg.dw2));
  EXPECT_TRUE(bitwise_equal(g8.dweights, gg.dweights));

  const DispatchedForward ref = moe_forward_deepep_fp8(cpu, ex.cfg, {hq, hs}, hidx, hw, ex.on(cw));
  const DispatchedGradients rg = moe_backward_dispatched_fp8(cpu, {hq, hs}, ex.on(cw), ref, hd);
  EXPECT_LT(rel_err(f8.output, ref.output), 4e-2);
  EXPECT_LT(rel_err(g8.dx, rg.dx), 4e-2);
  EXPECT_LT(rel_err(g8.dw1, rg.dw1), 4e-2);
  EXPECT_LT(rel_err(g8.dw2, rg.dw2), 4e-2);
  EXPECT_LT(rel_err(g8.dweights, rg.dweights), 4e-2);
  EXPECT_EQ(f8.output.dtype(), DType::bf16);
  EXPECT_EQ(g8.dx.dtype(), DType::bf16);
}

// Megatron's permuted rows in bf16, or in f16 (the dispatched entries' f16 path: the same kernels as the layer's).
void check_permuted(DType dt) {
  std::mt19937 rng(8);
  const std::int64_t E = 5, H = 256, I = 128;
  const std::vector<std::int32_t> counts = {130, 0, 7, 260, 1};
  std::int64_t N = 0;
  for (auto c : counts) N += c;
  Experts ex = make_experts(E, H, I, rng, dt);
  Tensor hc = Tensor::empty({E}, DType::i32);
  std::copy(counts.begin(), counts.end(), hc.ptr<std::int32_t>());
  Tensor hx = host_randn({N, H}, dt, 1.0f, rng), hp = host_randn({N}, DType::f32, 0.5f, rng);
  Tensor hd = host_randn({N, H}, dt, 1.0f, rng);
  const Device g = Device::cuda(0);
  const Context gpu = gpu_ctx(), cpu;
  const std::vector<Tensor> gw = {ex.w1.to(g), ex.w2.to(g)}, cw = {ex.w1, ex.w2};
  Tensor dx = hx.to(g), dp = hp.to(g), dd = hd.to(g);
  const DispatchedForward ref = moe_forward_permuted(cpu, ex.cfg, hx, hc, hp, ex.on(cw));
  const DispatchedGradients rg = moe_backward_dispatched(cpu, hx, ex.on(cw), ref, hd);
  Tensor first;
  for (const Tensor& tpe : {hc, hc.to(g)}) {  // counts on the host, then on the device (no host read)
    const DispatchedForward f = moe_forward_permuted(gpu, ex.cfg, dx, tpe, dp, ex.on(gw));
    const DispatchedGradients gg = moe_backward_dispatched(gpu, dx, ex.on(gw), f, dd);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_err(f.output, ref.output), 2e-2);
    EXPECT_LT(rel_err(gg.dx, rg.dx), 2e-2);
    EXPECT_LT(rel_err(gg.dw1, rg.dw1), 2e-2);
    EXPECT_LT(rel_err(gg.dw2, rg.dw2), 2e-2);
    EXPECT_LT(rel_err(gg.dweights, rg.dweights), 2e-2);
    if (first.defined()) EXPECT_TRUE(bitwise_equal(f.output, first));
    else first = f.output.to(Device::cpu());
    EXPECT_EQ(f.output.dtype(), dt);
  }
}

TEST(CudaDispatched, PermutedMatchesReference) {
  SONICMOE_REQUIRE_GPU();
  check_permuted(DType::bf16);
}

TEST(CudaDispatched, PermutedF16MatchesReference) {
  SONICMOE_REQUIRE_GPU();
  check_permuted(DType::f16);
}

#ifdef SONICMOE_WITH_NCCL
TEST(CudaEP, NcclMatchesSingleGpuLayer) {
  SONICMOE_REQUIRE_GPU();
  int ndev = 0;
  ASSERT_EQ(cudaGetDeviceCount(&ndev), cudaSuccess);
  const int R = ndev >= 2 ? 2 : 1;
  std::mt19937 rng(9);
  MoEConfig cfg;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.hidden_size = 256;
  cfg.intermediate_size = 128;
  const std::vector<std::int64_t> tokens = R == 2 ? std::vector<std::int64_t>{300, 97} : std::vector<std::int64_t>{397};
  const std::int64_t T = 397, E = 8, El = E / R, H = 256, I = 128;
  Tensor hx = host_randn({T, H}, DType::bf16, 1.0f, rng), hd = host_randn({T, H}, DType::bf16, 1.0f, rng);
  Tensor hr = host_randn({E, H}, DType::bf16, 0.1f, rng);
  Tensor hw1 = host_randn({E, 2 * I, H}, DType::bf16, 0.05f, rng), hw2 = host_randn({E, H, I}, DType::bf16, 0.05f, rng);
  // The single-GPU layer on the whole batch.
  const Context g0 = gpu_ctx(0);
  const Device d0 = Device::cuda(0);
  Tensor x0 = hx.to(d0), dd0 = hd.to(d0), r0 = hr.to(d0), w10 = hw1.to(d0), w20 = hw2.to(d0);
  const MoEWeights w0{r0, w10, TensorView(), w20, TensorView()};
  const ForwardResult f = moe_forward(g0, cfg, x0, w0);
  const Gradients gr = moe_backward(g0, x0, w0, f.saved, dd0, 0.5f);
  const Tensor out_ref = f.output.to(Device::cpu()), dx_ref = gr.dx.to(Device::cpu());

  std::vector<ncclComm_t> comms(static_cast<std::size_t>(R));
  std::vector<int> devs = {0, 1};
  ASSERT_EQ(ncclCommInitAll(comms.data(), R, devs.data()), ncclSuccess);
  std::vector<Tensor> outs(R), dxs(R), dw1s(R);
  std::vector<std::string> errors(R);
  std::vector<std::thread> th;
  for (int r = 0; r < R; ++r)
    th.emplace_back([&, r] {
      try {
        ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
        std::unique_ptr<Communicator> comm = make_nccl_communicator(comms[r], r);
        const Context ctx = gpu_ctx(r);
        const Device d = Device::cuda(r);
        std::int64_t t0 = 0;
        for (int q = 0; q < r; ++q) t0 += tokens[q];
        const std::int64_t Tr = tokens[r];
        auto rows = [&](const Tensor& h, std::int64_t a, std::vector<std::int64_t> shape) {
          Tensor part = Tensor::empty(shape, h.dtype());
          std::memcpy(part.data(), static_cast<const char*>(h.data()) + a * (h.nbytes() / h.size(0)), part.nbytes());
          return part.to(d);
        };
        Tensor x = rows(hx, t0, {Tr, H}), dd = rows(hd, t0, {Tr, H}), rw = hr.to(d);
        Tensor w1 = rows(hw1, r * El, {El, 2 * I, H}), w2 = rows(hw2, r * El, {El, H, I});
        const MoEWeights w{rw, w1, TensorView(), w2, TensorView()};
        EPForwardResult ef = ep_moe_forward(ctx, *comm, cfg, x, w);
        EPGradients eg = ep_moe_backward(ctx, *comm, x, w, ef.saved, dd, 0.5f);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        outs[r] = ef.output.to(Device::cpu());
        dxs[r] = eg.dx.to(Device::cpu());
        dw1s[r] = eg.dw1.to(Device::cpu());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : th) t.join();
  for (auto c : comms) ncclCommDestroy(c);
  for (int r = 0; r < R; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  // Concatenate the ranks' rows and compare.
  auto cat = [&](const std::vector<Tensor>& parts, std::vector<std::int64_t> shape) {
    Tensor all = Tensor::empty(shape, parts[0].dtype());
    std::size_t at = 0;
    for (const Tensor& p : parts) {
      std::memcpy(static_cast<char*>(all.data()) + at, p.data(), p.nbytes());
      at += p.nbytes();
    }
    return all;
  };
  EXPECT_LT(rel_err(cat(outs, {T, H}), out_ref), 2e-2);
  EXPECT_LT(rel_err(cat(dxs, {T, H}), dx_ref), 2e-2);
  EXPECT_LT(rel_err(cat(dw1s, {E, 2 * I, H}), gr.dw1.to(Device::cpu())), 2e-2);
}
#endif

}  // namespace

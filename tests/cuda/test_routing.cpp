// GPU routing / memory-bound stages against the CPU reference (sonicmoe::ref::) on the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "baselines/metadata_radix_sort.h"
#include "cuda/cuda_backend.h"
#include "cuda/gpu_test_util.h"
#include "reference/reference.h"
#include "routing_util.h"
#include "sonicmoe/error.h"
#include "sonicmoe/stages.h"

namespace sonicmoe {
namespace {

using testing::bitwise_equal;
using testing::rel_err;

Context gpu_ctx() {
  Context c;
  c.backend = Backend::cuda;
  return c;
}
Context cpu_ctx() { return Context{}; }

Tensor to_gpu(const Tensor& t) { return t.to(Device::cuda(0)); }
Tensor to_cpu(const Tensor& t) {
  cudaDeviceSynchronize();
  return t.to(Device::cpu());
}
// Device tensor filled with 0xff bytes (poison).
Tensor poisoned(const std::vector<std::int64_t>& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda(0));
  cudaMemset(t.data(), 0xff, t.nbytes());
  return t;
}

// A GPU tensor (copied to the host) and the reference's, named in the failure message.
struct Field {
  const char* name;
  const Tensor& gpu;
  const Tensor& ref;
};
void expect_fields_equal(std::initializer_list<Field> fields) {
  for (const Field& f : fields) EXPECT_TRUE(bitwise_equal(to_cpu(f.gpu), f.ref)) << f.name;
}

// The metadata arrays that every routing fills whole (with or without a capacity), bitwise equal to the reference's.
void expect_whole_metadata_equal(const RoutingMetadata& g, const RoutingMetadata& r) {
  expect_fields_equal({{"meta.counts", g.counts, r.counts},
                       {"meta.offsets", g.offsets, r.offsets},
                       {"meta.rev", g.rev, r.rev},
                       {"meta.token_offsets", g.token_offsets, r.token_offsets}});
}

// Every metadata array of a GPU result bitwise equal to the reference's.
void expect_metadata_equal(const RoutingMetadata& g, const RoutingMetadata& r) {
  expect_whole_metadata_equal(g, r);
  expect_fields_equal({{"meta.pair", g.pair, r.pair}, {"meta.gather", g.gather, r.gather}});
}

// cuda::topk_routing on the GPU logits Ld gives bitwise the reference's ids, scores, pair_token and metadata,
// on two runs (determinism). Outputs are poisoned first.
void expect_topk_routing_equal(const Tensor& Ld, std::int64_t K, const Tensor& ids_r, const Tensor& sc_r,
                               const Tensor& pt_r, const RoutingMetadata& mr, const RouterSpec& router = {}) {
  const std::int64_t T = Ld.size(0);
  for (int rep = 0; rep < 2; ++rep) {
    SCOPED_TRACE(rep == 0 ? "topk_routing, first run" : "topk_routing, second run");
    Tensor ids = poisoned({T, K}, DType::i32), sc = poisoned({T, K}, DType::f32), pt = poisoned({T * K}, DType::i32);
    const RoutingMetadata mg = cuda::topk_routing(gpu_ctx(), Ld, K, ids, sc, pt, router);
    EXPECT_TRUE(bitwise_equal(to_cpu(ids), ids_r)) << "topk ids";
    EXPECT_TRUE(bitwise_equal(to_cpu(sc), sc_r)) << "topk scores";
    EXPECT_TRUE(bitwise_equal(to_cpu(pt), pt_r)) << "pair_token";
    expect_metadata_equal(mg, mr);
  }
}

// The top-K routing state (routing_util.h) on the GPU: the host state's arrays copied, with the GPU's metadata.
Routing gpu_state(const Routing& host, const RoutingMetadata& meta) {
  return testing_util::topk_routing_state(to_gpu(host.logits), host.top_k, to_gpu(host.topk_expert),
                                          to_gpu(host.topk_score), to_gpu(host.pair_token), meta, host.router);
}

// The router backward on a host state rr (ref::router_backward) and on its GPU copy rg (cuda::router_backward), same
// ds and d_aux: the logits' gradients within 1e-5. Returns the GPU's.
Tensor expect_router_backward_close(const Routing& rr, const Routing& rg, const Tensor& ds, float daux) {
  const std::int64_t T = rr.logits.size(0), E = rr.logits.size(1);
  Tensor dl_r = Tensor::empty({T, E}, DType::f32), dl = poisoned({T, E}, DType::f32);
  ref::router_backward(cpu_ctx(), rr, ds, daux, dl_r);
  cuda::router_backward(gpu_ctx(), rg, to_gpu(ds), daux, dl);
  EXPECT_LT(rel_err(to_cpu(dl), dl_r), 1e-5) << "router_backward d_aux=" << daux;
  return dl;
}

enum class Kind { normal, zipf, one_hot, ties };

Tensor make_logits(std::int64_t T, std::int64_t E, Kind kind, std::mt19937& rng) {
  Tensor L = Tensor::empty({T, E}, DType::f32);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> bias(E, 0.0f);
  if (kind == Kind::zipf)
    for (std::int64_t e = 0; e < E; ++e) bias[e] = -2.0f * std::log(static_cast<float>(e + 1));
  float* p = L.ptr<float>();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      float v = nd(rng) + bias[e];
      if (kind == Kind::one_hot && e == 3 % E) v += 50.0f;
      if (kind == Kind::ties) v = static_cast<float>(static_cast<int>(nd(rng) * 2.0f)) * 0.5f;  // many exact ties
      p[t * E + e] = v;
    }
  return L;
}

struct Case {
  std::int64_t T, E, K;
  Kind kind;
};

const Case kCases[] = {{1, 8, 2, Kind::normal},      {100, 60, 4, Kind::normal},  {1000, 64, 1, Kind::normal},
                       {777, 128, 8, Kind::zipf},    {513, 32, 2, Kind::one_hot}, {300, 60, 6, Kind::ties},
                       {4096, 256, 8, Kind::normal}, {250, 512, 16, Kind::zipf},  {129, 7, 7, Kind::normal}};

TEST(CudaRouting, TopkMetadataAuxMatchReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(1234);
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K << " kind=" << int(c.kind));
    const Tensor L = make_logits(c.T, c.E, c.kind, rng);
    const Tensor Ld = to_gpu(L);
    // Reference.
    Tensor ids_r = Tensor::empty({c.T, c.K}, DType::i32), sc_r = Tensor::empty({c.T, c.K}, DType::f32);
    Tensor cnt_r = Tensor::empty({c.E}, DType::i32);
    ref::topk_softmax(cpu_ctx(), L, c.K, ids_r, sc_r, cnt_r, RouterSpec{});
    // GPU.
    Tensor ids = poisoned({c.T, c.K}, DType::i32), sc = poisoned({c.T, c.K}, DType::f32);
    Tensor cnt = poisoned({c.E}, DType::i32);
    cuda::topk_softmax(gpu_ctx(), Ld, c.K, ids, sc, cnt, RouterSpec{});
    EXPECT_TRUE(bitwise_equal(to_cpu(ids), ids_r)) << "topk ids";
    EXPECT_TRUE(bitwise_equal(to_cpu(cnt), cnt_r)) << "counts";
    EXPECT_TRUE(bitwise_equal(to_cpu(sc), sc_r)) << "topk scores (exp_f32 on both sides)";

    // Fused top-K routing (top-K, pair_token, metadata) against the reference's three stages.
    const std::int64_t N = c.T * c.K;
    Tensor pt_r = Tensor::empty({N}, DType::i32);
    RoutingMetadata mr = ref::topk_routing(cpu_ctx(), L, c.K, ids_r, sc_r, pt_r, RouterSpec{});
    expect_topk_routing_equal(Ld, c.K, ids_r, sc_r, pt_r, mr);
    // Metadata from the same pairs by the general path (pairs from the reference: identical inputs).
    const Tensor pt = to_gpu(pt_r), pe_r = ids_r.reshape({N});
    RoutingMetadata mg = cuda::build_metadata(gpu_ctx(), pt, to_gpu(pe_r), c.T, c.E);
    for (int rep = 0; rep < 2; ++rep) {
      expect_metadata_equal(mg, mr);
      mg = cuda::build_metadata(gpu_ctx(), pt, to_gpu(pe_r), c.T, c.E);  // second run: determinism
    }
    {  // The CUB radix-sort variant (benchmark baseline) gives the same arrays.
      RoutingMetadata ms = baselines::build_metadata_radix_sort(gpu_ctx(), pt, to_gpu(pe_r), c.T, c.E);
      EXPECT_TRUE(bitwise_equal(to_cpu(ms.pair), mr.pair)) << "radix-sort meta.pair";
      EXPECT_TRUE(bitwise_equal(to_cpu(ms.offsets), mr.offsets)) << "radix-sort meta.offsets";
    }

    // Aux loss.
    Tensor aux_r = Tensor::empty({1}, DType::f32), aux = poisoned({1}, DType::f32);
    ref::aux_loss(cpu_ctx(), L, cnt_r, aux_r);
    cuda::aux_loss(gpu_ctx(), Ld, to_gpu(cnt_r), aux);
    const float a = to_cpu(aux).ptr<float>()[0], b = aux_r.ptr<float>()[0];
    EXPECT_NEAR(a, b, 1e-5 * std::max(1.0f, std::fabs(b))) << "aux_loss";
    Tensor aux2 = poisoned({1}, DType::f32);
    cuda::aux_loss(gpu_ctx(), Ld, to_gpu(cnt_r), aux2);
    EXPECT_TRUE(bitwise_equal(to_cpu(aux2), to_cpu(aux))) << "aux_loss deterministic";

    // Aggregate (bf16 and f32), weighted and unweighted.
    for (DType dt : {DType::bf16, DType::f32}) {
      for (std::int64_t H : {std::int64_t{256}, std::int64_t{200}, std::int64_t{4}}) {
        const Tensor Y = testing::host_randn({N, H}, dt, 1.0f, rng);
        Tensor o_r = Tensor::empty({c.T, H}, dt);
        Tensor s_flat = sc_r.reshape({N});
        for (bool weighted : {true, false}) {
          const TensorView sv = weighted ? TensorView(s_flat) : TensorView();
          ref::aggregate(cpu_ctx(), Y, sv, mr, o_r);
          Tensor o = poisoned({c.T, H}, dt);
          Tensor sg = to_gpu(s_flat);
          cuda::aggregate(gpu_ctx(), to_gpu(Y), weighted ? TensorView(sg) : TensorView(), mg, o);
          const double err = rel_err(to_cpu(o), o_r);
          EXPECT_LT(err, dt == DType::bf16 ? 4e-3 : 1e-6) << "aggregate H=" << H << " weighted=" << weighted;
        }
      }
    }

    // Router backward (top-K routing) with and without the aux term.
    const Routing rr = testing_util::topk_routing_state(L, c.K, ids_r, sc_r, pt_r, mr);
    const Routing rg = gpu_state(rr, mg);
    const Tensor ds = testing::host_randn({N}, DType::f32, 1.0f, rng);
    for (float daux : {0.0f, 0.7f}) {
      const Tensor dl = expect_router_backward_close(rr, rg, ds, daux);
      // d_aux as a device scalar (what the PyTorch binding passes): the same bits as the host value.
      Tensor d_aux_dev = Tensor::empty({1}, DType::f32);
      d_aux_dev.ptr<float>()[0] = daux;
      d_aux_dev = to_gpu(d_aux_dev);
      Tensor dl_dev = poisoned({c.T, c.E}, DType::f32);
      router_backward(gpu_ctx(), rg, to_gpu(ds), AuxLossGrad(d_aux_dev.view()), dl_dev);
      EXPECT_TRUE(bitwise_equal(to_cpu(dl_dev), to_cpu(dl))) << "router_backward, d_aux on the device =" << daux;
    }
  }
}

// Fused top-K routing at token counts where every warp of the top-K kernel takes several tokens (its grid is
// capped at one resident wave), so block counts cover many pairs; skewed and uniform logits, E = 300.
TEST(CudaRouting, TopkRoutingManyTokensPerWarpMatchesReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(4321);
  for (const Case& c : {Case{40001, 128, 8, Kind::zipf}, Case{20011, 300, 3, Kind::normal},
                        Case{70000, 16, 1, Kind::one_hot}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K << " kind=" << int(c.kind));
    const Tensor L = make_logits(c.T, c.E, c.kind, rng);
    Tensor ids_r = Tensor::empty({c.T, c.K}, DType::i32), sc_r = Tensor::empty({c.T, c.K}, DType::f32);
    Tensor pt_r = Tensor::empty({c.T * c.K}, DType::i32);
    const RoutingMetadata mr = ref::topk_routing(cpu_ctx(), L, c.K, ids_r, sc_r, pt_r, RouterSpec{});
    expect_topk_routing_equal(to_gpu(L), c.K, ids_r, sc_r, pt_r, mr);
  }
}

// Every tensor of the GPU token rounding's Routing bitwise equal to the reference's, and every expert's count a
// multiple of the tile unless capped at T.
void expect_token_rounding_equal(const Tensor& L, std::int64_t K, std::int64_t tile, RoutingMode mode) {
  const std::int64_t T = L.size(0), E = L.size(1);
  Routing rr = ref::token_rounding(cpu_ctx(), L, K, tile, mode);
  Routing rg = cuda::token_rounding(gpu_ctx(), to_gpu(L), K, tile, mode);
  ASSERT_EQ(rg.meta.num_pairs, rr.meta.num_pairs);
  expect_fields_equal({{"topk_expert", rg.topk_expert, rr.topk_expert},
                       {"topk_score", rg.topk_score, rr.topk_score},
                       {"pair_token", rg.pair_token, rr.pair_token},
                       {"pair_expert", rg.pair_expert, rr.pair_expert},
                       {"pair_score", rg.pair_score, rr.pair_score},
                       {"pair_slot", rg.pair_slot, rr.pair_slot}});
  expect_metadata_equal(rg.meta, rr.meta);
  Tensor cnt = to_cpu(rg.meta.counts);
  for (std::int64_t e = 0; e < E; ++e) {
    const int n = cnt.ptr<std::int32_t>()[e];
    EXPECT_TRUE(n % tile == 0 || n == T) << "expert " << e << " count " << n;
  }
}

// Token rounding: bitwise the reference for the three modes, tiles that divide nothing evenly, skewed and tied
// logits, and T smaller than the tile.
TEST(CudaRouting, TokenRoundingMatchesReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(99);
  for (const Case& c : kCases) {
    const Tensor L = make_logits(c.T, c.E, c.kind, rng);
    for (RoutingMode mode : {RoutingMode::round_down, RoutingMode::round_up, RoutingMode::round_nearest}) {
      for (std::int64_t tile : {std::int64_t{128}, std::int64_t{16}, std::int64_t{7}}) {
        SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K << " kind=" << int(c.kind)
                                          << " mode=" << routing_mode_name(mode) << " tile=" << tile);
        expect_token_rounding_equal(L, c.K, tile, mode);
      }
    }
  }
}

// T = 8192 (small-k2): the select kernel's staged keys (32 KB) fit the 48 KB default alone but not with its
// static shared memory; the launch failed ("invalid argument") unless an earlier, larger T had raised the
// kernel's limit in the same process. ctest runs each test in its own process, so this one sees a fresh limit.
TEST(CudaRouting, TokenRoundingStagedKeysBesideStaticSharedMemory) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  for (std::int64_t T : {std::int64_t{8192}, std::int64_t{12288}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    expect_token_rounding_equal(make_logits(T, 32, Kind::normal, rng), 2, 128, RoutingMode::round_nearest);
  }
}

// General routing (variable experts per token, tokens without pairs at the start, middle and end) and pair
// counts large enough for many segments, and for segments longer than 256 pairs (N > 8192 * 256).
TEST(CudaRouting, MetadataGeneralRoutingMatchesReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(77);
  struct G {
    std::int64_t T, E, max_k;
    double p_empty;
  };
  for (const G& g : {G{1, 1, 1, 0.0}, G{5, 3, 3, 0.6}, G{1000, 60, 9, 0.3}, G{50000, 128, 12, 0.1},
                     G{300000, 512, 16, 0.05}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << g.T << " E=" << g.E << " max_k=" << g.max_k);
    std::vector<std::int32_t> tok, exp;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<std::int32_t> perm(g.E);
    for (std::int64_t t = 0; t < g.T; ++t) {
      const bool edge = t < 3 || t >= g.T - 3;  // tokens without pairs at both ends
      if (u(rng) < g.p_empty || (edge && g.T > 8)) continue;
      const std::int64_t k = 1 + static_cast<std::int64_t>(u(rng) * std::min(g.max_k, g.E));
      for (std::int64_t e = 0; e < g.E; ++e) perm[e] = static_cast<std::int32_t>(e);
      for (std::int64_t j = 0; j < std::min(k, g.E); ++j) {  // distinct experts, skewed (Fisher-Yates, v^2)
        const double v = u(rng);
        const std::int64_t q = std::min<std::int64_t>(g.E - 1, j + static_cast<std::int64_t>((g.E - j) * v * v));
        std::swap(perm[j], perm[q]);
        tok.push_back(static_cast<std::int32_t>(t));
        exp.push_back(perm[j]);
      }
    }
    const std::int64_t N = static_cast<std::int64_t>(tok.size());
    Tensor pt_r = Tensor::empty({N}, DType::i32), pe_r = Tensor::empty({N}, DType::i32);
    if (N) {
      std::memcpy(pt_r.data(), tok.data(), 4 * N);
      std::memcpy(pe_r.data(), exp.data(), 4 * N);
    }
    RoutingMetadata mr = ref::build_metadata(cpu_ctx(), pt_r, pe_r, g.T, g.E);
    for (int variant = 0; variant < 2; ++variant) {
      RoutingMetadata mg = variant == 0 ? cuda::build_metadata(gpu_ctx(), to_gpu(pt_r), to_gpu(pe_r), g.T, g.E)
                                        : baselines::build_metadata_radix_sort(gpu_ctx(), to_gpu(pt_r), to_gpu(pe_r), g.T, g.E);
      SCOPED_TRACE(variant == 0 ? "counting sort" : "radix sort");
      EXPECT_EQ(mg.num_pairs, N);
      expect_metadata_equal(mg, mr);
    }
  }
}

// Token rounding reads the pair count back to the host: inside a stream capture it must refuse clearly
// (and leave the capture intact) instead of failing in the driver.
TEST(CudaRouting, TokenRoundingRefusesGraphCapture) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  const Tensor Ld = to_gpu(make_logits(256, 16, Kind::normal, rng));
  cudaStream_t st;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  Context ctx = gpu_ctx();
  ctx.stream = st;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  try {
    cuda::token_rounding(ctx, Ld, 2, 16, RoutingMode::round_nearest);
    ADD_FAILURE() << "token_rounding did not throw under stream capture";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA graph"), std::string::npos) << e.what();
  }
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
}

TEST(CudaRouting, RouterGemmsMatchReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(99);
  for (DType dt : {DType::bf16, DType::f32})
    for (auto [T, H, E] : std::vector<std::array<std::int64_t, 3>>{{1, 64, 8}, {300, 256, 60}, {2048, 512, 128}}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " E=" << E << " dt=" << int(dt));
      const Tensor X = testing::host_randn({T, H}, dt, 1.0f, rng);
      const Tensor W = testing::host_randn({E, H}, dt, 0.05f, rng);
      Tensor l_r = Tensor::empty({T, E}, DType::f32), l = poisoned({T, E}, DType::f32);
      ref::router_logits(cpu_ctx(), X, W, l_r);
      const Tensor Xd = to_gpu(X), Wd = to_gpu(W);
      cuda::router_logits(gpu_ctx(), Xd, Wd, l);
      EXPECT_LT(rel_err(to_cpu(l), l_r), 1e-5) << "router_logits";  // f32 may use TF32? must not
      const Tensor dL = testing::host_randn({T, E}, DType::f32, 1e-3f, rng);
      const Tensor dx0 = testing::host_randn({T, H}, dt, 1.0f, rng);
      Tensor dw_r = Tensor::empty({E, H}, dt), dx_r = Tensor::empty({T, H}, dt);
      copy(dx_r, dx0);
      ref::router_weight_grad(cpu_ctx(), dL, X, W, dw_r, dx_r, GradWrite::store);
      Tensor dw = poisoned({E, H}, dt), dx = to_gpu(dx0);
      cuda::router_weight_grad(gpu_ctx(), to_gpu(dL), Xd, Wd, dw, dx, GradWrite::store);
      const double tol = dt == DType::bf16 ? 4e-3 : 1e-5;
      EXPECT_LT(rel_err(to_cpu(dw), dw_r), tol) << "dWr";
      EXPECT_LT(rel_err(to_cpu(dx), dx_r), tol) << "dX";
      // dx - dx0 only (the update itself), f32 view.
      Tensor a = to_cpu(dx);
      double num = 0, den = 0;
      for (std::int64_t i = 0; i < T * H; ++i) {
        const double u = testing::value(a, i) - testing::value(dx0, i), v = testing::value(dx_r, i) - testing::value(dx0, i);
        num += (u - v) * (u - v);
        den += v * v;
      }
      std::printf("T=%lld H=%lld E=%lld %s: dWr rel %.3g, dX rel %.3g, update rel %.3g\n", (long long)T,
                  (long long)H, (long long)E, dtype_name(dt), rel_err(to_cpu(dw), dw_r), rel_err(to_cpu(dx), dx_r),
                  den > 0 ? std::sqrt(num / den) : 0.0);
    }
}

// ---- Router variants (RouterSpec): the fused top-K kernel and the router backward against the reference ----------

struct RouterCase {
  const char* name;
  std::int64_t T, E, K;
  Kind kind;
  ScoreFunction score;
  bool softmax_over_topk, norm;
  std::int64_t n_group, topk_group;
  float scale;
  bool bias;
};

// Awkward sizes: E not a power of two (7, 60, 300), E = 256 in 8 groups (DeepSeek-V3), 32 groups, K = 1, K = 16,
// exact ties in logits (and so in sigmoid scores, group sums and biased keys), many tokens per warp (T = 40000).
const RouterCase kRouterCases[] = {
    {"softmax norm (Qwen3/OLMoE)", 1000, 60, 4, Kind::normal, ScoreFunction::softmax, false, true, 1, 1, 1.0f, false},
    {"softmax full, scaled", 777, 128, 8, Kind::zipf, ScoreFunction::softmax, false, false, 1, 1, 2.5f, false},
    {"softmax over top-K, scaled", 513, 64, 2, Kind::normal, ScoreFunction::softmax, true, false, 1, 1, 0.5f, false},
    {"DeepSeek-V3", 4096, 256, 8, Kind::normal, ScoreFunction::sigmoid, true, true, 8, 4, 2.5f, true},
    {"DeepSeek-V3, ties", 300, 256, 8, Kind::ties, ScoreFunction::sigmoid, true, true, 8, 4, 2.5f, true},
    {"DeepSeek-V3, many tokens per warp", 40000, 256, 8, Kind::zipf, ScoreFunction::sigmoid, true, true, 8, 4, 2.5f,
     true},
    {"sigmoid K=1, E=7", 129, 7, 1, Kind::normal, ScoreFunction::sigmoid, true, false, 1, 1, 1.0f, false},
    {"sigmoid groups E=60, ties", 300, 60, 6, Kind::ties, ScoreFunction::sigmoid, true, true, 4, 2, 1.0f, true},
    {"softmax groups + bias, 32 groups, K=16", 250, 512, 16, Kind::zipf, ScoreFunction::softmax, false, true, 32, 3,
     1.0f, true},
    {"sigmoid E=300, 10 groups, K=1", 2000, 300, 1, Kind::normal, ScoreFunction::sigmoid, true, true, 10, 10, 1.0f,
     true},
    {"one-hot sigmoid norm", 513, 32, 2, Kind::one_hot, ScoreFunction::sigmoid, true, true, 2, 1, 1.0f, false},
};

TEST(CudaRouting, RouterVariantsMatchReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(4321);
  for (const RouterCase& c : kRouterCases) {
    SCOPED_TRACE(::testing::Message() << c.name << ": T=" << c.T << " E=" << c.E << " K=" << c.K);
    const Tensor L = make_logits(c.T, c.E, c.kind, rng);
    const Tensor Ld = to_gpu(L);
    Tensor bias = Tensor::empty({c.E}, DType::f32);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (std::int64_t e = 0; e < c.E; ++e)  // ties: biases on a 1/8 grid keep sigmoid(logit) + bias ties exact
      bias.ptr<float>()[e] = c.kind == Kind::ties ? static_cast<float>(e % 3) * 0.125f : nd(rng);
    const Tensor bias_d = to_gpu(bias);
    RouterSpec rr = testing_util::router_spec(c.score, c.softmax_over_topk, c.norm, c.n_group, c.topk_group, c.scale);
    RouterSpec rg = rr;
    if (c.bias) {
      rr.e_score_correction_bias = bias;
      rg.e_score_correction_bias = bias_d;
    }
    const std::int64_t N = c.T * c.K;
    Tensor ids_r = Tensor::empty({c.T, c.K}, DType::i32), sc_r = Tensor::empty({c.T, c.K}, DType::f32);
    Tensor pt_r = Tensor::empty({N}, DType::i32), cnt_r = Tensor::empty({c.E}, DType::i32);
    const RoutingMetadata mr = ref::topk_routing(cpu_ctx(), L, c.K, ids_r, sc_r, pt_r, rr);
    ref::topk_softmax(cpu_ctx(), L, c.K, ids_r, sc_r, cnt_r, rr);
    expect_topk_routing_equal(Ld, c.K, ids_r, sc_r, pt_r, mr, rg);
    Tensor ids = poisoned({c.T, c.K}, DType::i32), sc = poisoned({c.T, c.K}, DType::f32);
    Tensor cnt = poisoned({c.E}, DType::i32);
    cuda::topk_softmax(gpu_ctx(), Ld, c.K, ids, sc, cnt, rg);
    expect_fields_equal({{"router ids", ids, ids_r}, {"router weights", sc, sc_r}, {"router counts", cnt, cnt_r}});

    // Backward through the router's weights (the bias view dropped, as route() keeps it).
    const Routing rb = testing_util::topk_routing_state(L, c.K, ids_r, sc_r, pt_r, mr, rr);
    const Routing rbg = gpu_state(rb, cuda::build_metadata(gpu_ctx(), to_gpu(pt_r), to_gpu(ids_r.reshape({N})),
                                                           c.T, c.E));
    const Tensor ds = testing::host_randn({N}, DType::f32, 1.0f, rng);
    for (float daux : {0.0f, 0.7f}) expect_router_backward_close(rb, rbg, ds, daux);
  }
}

// ---- Capacity (RouterSpec::capacity_factor): the fused top-K routing's metadata against ref::apply_capacity -------

struct CapacityCase {
  std::int64_t T, E, K;
  Kind kind;
  double factor;
  bool sigmoid;
};

// Skewed logits (zipf, one-hot) drop many pairs; E not a power of two; K = 1; E = 256; many tokens per warp; a factor
// that drops nothing; T = 1.
const CapacityCase kCapacityCases[] = {
    {1000, 60, 4, Kind::zipf, 1.0, false},    {777, 7, 1, Kind::one_hot, 1.25, true},
    {4096, 256, 8, Kind::zipf, 1.0, true},    {300, 60, 6, Kind::ties, 0.5, false},
    {40001, 128, 8, Kind::zipf, 2.0, false},  {513, 32, 2, Kind::normal, 64.0, false},
    {1, 8, 2, Kind::normal, 1.0, false},      {20011, 300, 3, Kind::one_hot, 1.0, true},
};

// Rows [offsets[E], N) are unused under a capacity (the reference writes -1 / 0 there, the GPU leaves them): pair
// and gather are compared over the used rows.
void expect_capacity_metadata_equal(const RoutingMetadata& g, const RoutingMetadata& r) {
  expect_whole_metadata_equal(g, r);
  expect_fields_equal({{"meta.demand", g.demand, r.demand}, {"meta.dropped", g.dropped, r.dropped}});
  const std::int64_t rows = r.offsets.ptr<const std::int32_t>()[r.num_experts];
  const Tensor pg = to_cpu(g.pair), gg = to_cpu(g.gather);
  EXPECT_EQ(std::memcmp(pg.data(), r.pair.data(), sizeof(std::int32_t) * rows), 0) << "meta.pair (used rows)";
  EXPECT_EQ(std::memcmp(gg.data(), r.gather.data(), sizeof(std::int32_t) * rows), 0) << "meta.gather (used rows)";
}

TEST(CudaRouting, CapacityMatchesReference) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(2468);
  for (const CapacityCase& c : kCapacityCases) {
    SCOPED_TRACE(::testing::Message() << "T=" << c.T << " E=" << c.E << " K=" << c.K << " kind=" << int(c.kind)
                                      << " factor=" << c.factor);
    const Tensor L = make_logits(c.T, c.E, c.kind, rng);
    const Tensor Ld = to_gpu(L);
    RouterSpec r;
    if (c.sigmoid) r = testing_util::router_spec(ScoreFunction::sigmoid, true, true, 1, 1, 1.0f);
    r.capacity_factor = c.factor;
    const std::int64_t N = c.T * c.K;
    Tensor ids_r = Tensor::empty({c.T, c.K}, DType::i32), sc_r = Tensor::empty({c.T, c.K}, DType::f32);
    Tensor pt_r = Tensor::empty({N}, DType::i32);
    const RoutingMetadata mr = ref::topk_routing(cpu_ctx(), L, c.K, ids_r, sc_r, pt_r, r);
    RoutingMetadata mg;
    for (int rep = 0; rep < 2; ++rep) {  // the second run: determinism (dropped is an atomic sum)
      SCOPED_TRACE(rep == 0 ? "first run" : "second run");
      Tensor ids = poisoned({c.T, c.K}, DType::i32), sc = poisoned({c.T, c.K}, DType::f32);
      Tensor pt = poisoned({N}, DType::i32);
      mg = cuda::topk_routing(gpu_ctx(), Ld, c.K, ids, sc, pt, r);
      expect_fields_equal({{"topk ids", ids, ids_r}, {"topk scores", sc, sc_r}, {"pair_token", pt, pt_r}});
      expect_capacity_metadata_equal(mg, mr);
    }
    std::printf("  T=%lld E=%lld K=%lld factor=%g: C=%lld, %d of %lld pairs dropped\n", static_cast<long long>(c.T),
                static_cast<long long>(c.E), static_cast<long long>(c.K), c.factor,
                static_cast<long long>(r.expert_capacity(c.T, c.K, c.E)), mr.dropped.ptr<const std::int32_t>()[0],
                static_cast<long long>(N));

    // Aggregate skips the dropped pairs (rev = -1), weighted and unweighted.
    const std::int64_t H = 200;
    const Tensor Y = testing::host_randn({N, H}, DType::f32, 1.0f, rng);
    Tensor s_flat = sc_r.reshape({N}), sg = to_gpu(s_flat);
    for (bool weighted : {true, false}) {
      Tensor o_r = Tensor::empty({c.T, H}, DType::f32), o = poisoned({c.T, H}, DType::f32);
      ref::aggregate(cpu_ctx(), Y, weighted ? TensorView(s_flat) : TensorView(), mr, o_r);
      cuda::aggregate(gpu_ctx(), to_gpu(Y), weighted ? TensorView(sg) : TensorView(), mg, o);
      EXPECT_LT(rel_err(to_cpu(o), o_r), 1e-6) << "aggregate weighted=" << weighted;
    }

    // Router backward: the aux term counts the demand (the router's choices), not the kept counts.
    Routing rr = testing_util::topk_routing_state(L, c.K, ids_r, sc_r, pt_r, mr, r);
    const Routing rg = gpu_state(rr, mg);
    const Tensor ds = testing::host_randn({N}, DType::f32, 1.0f, rng);
    Tensor dl_r = Tensor::empty({c.T, c.E}, DType::f32), dl = poisoned({c.T, c.E}, DType::f32);
    ref::router_backward(cpu_ctx(), rr, ds, 0.7f, dl_r);
    cuda::router_backward(gpu_ctx(), rg, to_gpu(ds), 0.7f, dl);
    EXPECT_LT(rel_err(to_cpu(dl), dl_r), 1e-5) << "router_backward with the aux term";
  }
}

// The router's argument errors on the cuda backend (the limit of 32 groups; the rest is the reference's validation).
TEST(CudaRouting, RouterVariantLimits) {
  SONICMOE_REQUIRE_GPU();
  const Tensor Ld = poisoned({4, 128}, DType::f32);
  Tensor ids = poisoned({4, 2}, DType::i32), sc = poisoned({4, 2}, DType::f32), cnt = poisoned({128}, DType::i32);
  RouterSpec r;
  r.score_function = ScoreFunction::sigmoid;
  r.n_group = 64;
  r.topk_group = 1;
  try {
    topk_softmax(gpu_ctx(), Ld, 2, ids, sc, cnt, r);
    ADD_FAILURE() << "n_group = 64 accepted on the cuda backend";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("router.n_group"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sonicmoe

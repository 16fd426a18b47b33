// Bad inputs found by fuzzing the CPU build (issue 25, item 6), one group per class: sizes that used to wrap or
// crash, inputs that were silently ignored or truncated, vague errors, and the int32 index contract. Every case
// asserts an Error (or a CLI's "error: ..." and exit code 2) whose message names the argument and its value.
// Huge problems use views over a small dummy buffer: every check here runs before any element is read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <utility>

#include "core/check.h"
#include "counting_allocator.h"
#include "error_of.h"
#include "naive_moe.h"
#include "sonicmoe/dispatched.h"
#include "sonicmoe/ep.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/stages.h"

namespace {

using namespace sonicmoe;
using testing::AllOf;
using testing::HasSubstr;
using testing::Not;

using sonicmoe::testing_util::CountingAllocator;
using sonicmoe::testing_util::error_of;

// Storage behind the views of huge problems: never read (the entry points fail first), only non-null and aligned.
alignas(64) char g_dummy[64];

TensorView fake(DType dt, std::initializer_list<std::int64_t> shape) { return TensorView(g_dummy, dt, shape); }

// A config with small weights (E=8, K=2, H=16, I=8, swiglu) whose weight views are fake.
struct Huge {
  MoEConfig cfg{8, 2, 16, 8, Activation::swiglu, false};
  MoEWeights weights() const {
    const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size;
    return MoEWeights{fake(DType::f32, {E, H}), fake(DType::f32, {E, 2 * I, H}), {}, fake(DType::f32, {E, H, I}), {}};
  }
};

// ---- 1. Crashes: size arithmetic, nesting, memory --------------------------------------------------------------

TEST(BadInputSizes, ShapeProductPastInt64IsAnError) {
  const std::string msg = error_of([] { TensorView v(nullptr, DType::f32, {std::int64_t{1} << 40, std::int64_t{1} << 40}); });
  EXPECT_THAT(msg, AllOf(HasSubstr("[1099511627776, 1099511627776]"), HasSubstr("int64")));
  EXPECT_THAT(error_of([] { Tensor::empty({std::int64_t{1} << 32, std::int64_t{1} << 32}, DType::bf16); }),
              HasSubstr("[4294967296, 4294967296]"));
}

TEST(BadInputSizes, BytesPastPtrdiffMaxIsAnError) {
  // 2^62 elements fit int64, but not as f32 bytes.
  EXPECT_THAT(error_of([] { TensorView v(nullptr, DType::f32, {std::int64_t{1} << 62}); }),
              AllOf(HasSubstr("[4611686018427387904]"), HasSubstr("f32"), HasSubstr("bytes")));
}

TEST(BadInputSizes, NumelAndNbytesOfAnEditedShapeAreChecked) {
  TensorView v(g_dummy, DType::f32, {4, 4});
  v.shape[0] = std::int64_t{1} << 40;  // the fields are public: numel() must not trust the constructor's check
  v.shape[1] = std::int64_t{1} << 40;
  EXPECT_THAT(error_of([&] { (void)v.numel(); }), HasSubstr("[1099511627776, 1099511627776]"));
  EXPECT_THAT(error_of([&] { (void)v.nbytes(); }), HasSubstr("[1099511627776, 1099511627776]"));
}

TEST(BadInputSizes, NegativeSizeNamesTheShape) {
  EXPECT_THAT(error_of([] { TensorView v(nullptr, DType::f32, {4, -3}); }),
              AllOf(HasSubstr("negative size -3"), HasSubstr("[4, -3]")));
}

TEST(BadInputSizes, CheckedMulNamesTheProduct) {
  EXPECT_EQ(checked_mul(3, 4, "a*b"), 12);
  EXPECT_THAT(error_of([] { checked_mul(std::int64_t{1} << 40, std::int64_t{1} << 30, "T*K"); }),
              AllOf(HasSubstr("T*K"), HasSubstr("1099511627776"), HasSubstr("1073741824")));
  EXPECT_THAT(error_of([] { checked_add(INT64_MAX, 1, "T+1"); }), HasSubstr("T+1"));
}

TEST(BadInputSizes, FailedHostAllocationIsAnError) {
  // 2^61 bytes: a valid size no machine can back; aligned_alloc returns null and the allocator says so.
  EXPECT_THAT(error_of([] { Tensor::empty({std::int64_t{1} << 59}, DType::f32); }),
              AllOf(HasSubstr("out of host memory"), HasSubstr("2305843009213693952 bytes")));
  // A direct call with a size whose 64-byte round-up would wrap.
  EXPECT_THAT(error_of([] { default_allocator()->allocate(SIZE_MAX, Device::cpu(), nullptr); }),
              HasSubstr("PTRDIFF_MAX"));
}

TEST(BadInputSizes, ForwardBeyondHostMemoryFailsBeforeAllocating) {
  // T = 2^28 tokens of H = 16: x alone is 16 GiB as a view; the layer's buffers (N = 2^29 pairs of z_width 16)
  // need far more than any test machine has, so the cpu backend refuses before allocating anything.
  Huge h;
  h.cfg.hidden_size = 4096;
  const std::int64_t T = std::int64_t{1} << 28;
  const std::string msg = error_of([&] { moe_forward(Context{}, h.cfg, fake(DType::f32, {T, 4096}), h.weights()); });
  EXPECT_THAT(msg, AllOf(HasSubstr("moe_forward"), HasSubstr("not enough host memory"), HasSubstr("T = 268435456"),
                         HasSubstr("H = 4096"), HasSubstr("I = 8"), HasSubstr("E = 8"), HasSubstr("K = 2"),
                         HasSubstr("bytes"), HasSubstr("available")));
}

struct EstimateCase {
  const char* name;
  RoutingMode mode;
  bool bias;
};

// The estimate is the layer's own buffers at their peak: at least what the allocator saw, and not far above.
TEST(BadInputSizes, RouteBeyondHostMemoryFailsBeforeAllocating) {
  Huge h;  // route alone, on the cpu: logits [T, E] f32 with T = 2^29, E = 512 are 1 TiB (more than any test host)
  const TensorView x = fake(DType::f32, {std::int64_t{1} << 29, 16});
  h.cfg.num_experts = 512;
  h.cfg.top_k = 1;
  EXPECT_THAT(error_of([&] { route(Context{}, h.cfg, x, fake(DType::f32, {512, 16}), RoutingSpec{}); }),
              AllOf(HasSubstr("route"), HasSubstr("not enough host memory"), HasSubstr("T = 536870912"),
                    HasSubstr("E = 512")));
}

TEST(BadInputSizes, MemoryEstimateBoundsTheMeasuredPeak) {
  for (const EstimateCase& c : {EstimateCase{"topk", RoutingMode::topk, false}, {"topk bias", RoutingMode::topk, true},
                                {"round-up", RoutingMode::round_up, false}, {"round-down", RoutingMode::round_down, true},
                                {"general", RoutingMode::general, true}}) {
    SCOPED_TRACE(c.name);
    const std::int64_t T = 200, E = 8, K = 2, H = 64, I = 32;
    MoEConfig cfg{E, K, H, I, Activation::swiglu, c.bias};
    std::mt19937 rng(5);
    Tensor x = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, DType::f32);
    Tensor dO = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, DType::f32);
    Tensor wr = naive::to_tensor(naive::randn(rng, E * H, 0.3), {E, H}, DType::f32);
    Tensor w1 = naive::to_tensor(naive::randn(rng, E * 2 * I * H, 0.3), {E, 2 * I, H}, DType::f32);
    Tensor w2 = naive::to_tensor(naive::randn(rng, E * H * I, 0.3), {E, H, I}, DType::f32);
    Tensor b1 = Tensor::zeros({E, 2 * I}, DType::f32), b2 = Tensor::zeros({E, H}, DType::f32);
    MoEWeights w{wr, w1, c.bias ? b1.view() : TensorView(), w2, c.bias ? b2.view() : TensorView()};
    RoutingSpec spec;
    spec.mode = c.mode;
    spec.tile = 16;
    Tensor tok = Tensor::empty({2 * T}, DType::i32), exp = Tensor::empty({2 * T}, DType::i32);
    Tensor score = Tensor::empty({2 * T}, DType::f32);
    for (std::int64_t p = 0; p < 2 * T; ++p) {  // general: two experts per token
      tok.ptr<std::int32_t>()[p] = static_cast<std::int32_t>(p / 2);
      exp.ptr<std::int32_t>()[p] = static_cast<std::int32_t>((p / 2 + p % 2) % E);
      score.ptr<float>()[p] = 0.5f;
    }
    if (c.mode == RoutingMode::general) spec.token = tok, spec.expert = exp, spec.score = score;
    CountingAllocator alloc;
    Context ctx;
    ctx.allocator = &alloc;
    std::size_t fwd_peak = 0, bwd_peak = 0, all_peak = 0;
    {
      ForwardResult f = moe_forward(ctx, cfg, x, w, spec);
      fwd_peak = alloc.peak_;
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      { Gradients g = moe_backward(ctx, x, w, f.saved, dO, 1.0f); }
      bwd_peak = alloc.peak_ - base;
      all_peak = alloc.peak_;
    }
    std::size_t inf_peak = 0, consumed_bwd_peak = 0;
    {
      alloc.peak_ = alloc.live_;
      { Tensor o = moe_inference(ctx, cfg, x, w, spec); }
      inf_peak = alloc.peak_;
      ForwardResult f = moe_forward(ctx, cfg, x, w, spec);
      const std::size_t base = alloc.live_;
      alloc.peak_ = base;
      { Gradients g = moe_backward(ctx, x, w, std::move(f.saved), dO, 1.0f); }  // dZ written over Z
      consumed_bwd_peak = alloc.peak_ - base;
    }
    const std::size_t est_i = moe_memory_estimate(cfg, T, DType::f32, spec, MemoryPass::inference);
    const std::size_t est_f = moe_memory_estimate(cfg, T, DType::f32, spec, MemoryPass::forward);
    const std::size_t est_b = moe_memory_estimate(cfg, T, DType::f32, spec, MemoryPass::backward);
    const std::size_t est_fb = moe_memory_estimate(cfg, T, DType::f32, spec);
    // Top-K's and general routing's N are exact (the estimate is within bytes); token rounding's assumes its
    // worst-case N and host scratch.
    const double slack = is_token_rounding(c.mode) ? 1.3 : 1.001;
    EXPECT_GE(est_f, fwd_peak);
    EXPECT_LE(est_f, fwd_peak * slack + 9 * T * E);
    EXPECT_GE(est_b, bwd_peak);
    EXPECT_LE(est_b, bwd_peak * slack);
    EXPECT_GE(est_fb, all_peak);
    EXPECT_LE(est_fb, all_peak * slack + 9 * T * E);
    EXPECT_GE(est_i, inf_peak);
    EXPECT_LE(est_i, inf_peak * slack + 9 * T * E);
    EXPECT_GE(est_b, consumed_bwd_peak);  // the estimate is the const& backward's: an upper bound here
  }
}

TEST(BadInputSizes, MemoryEstimateValidatesItsArguments) {
  MoEConfig cfg{8, 2, 16, 8, Activation::swiglu, false};
  EXPECT_THAT(error_of([&] { moe_memory_estimate(cfg, 0, DType::f32); }), HasSubstr("T = 0"));
  EXPECT_THAT(error_of([&] { moe_memory_estimate(cfg, 16, DType::i32); }), HasSubstr("dtype int32"));
  RoutingSpec general;
  general.mode = RoutingMode::general;
  EXPECT_THAT(error_of([&] { moe_memory_estimate(cfg, 16, DType::f32, general); }), HasSubstr("spec.token"));
  cfg.top_k = 9;
  EXPECT_THAT(error_of([&] { moe_memory_estimate(cfg, 16, DType::f32); }), HasSubstr("top_k = 9"));
}

// ---- 4. The int32 index contract (every backend; checked before the backend is involved) -----------------------

TEST(BadInputIndexLimits, PairsPastInt32InForwardAndRoute) {
  Huge h;
  const std::int64_t T = std::int64_t{1} << 30;  // N = T*K = 2^31
  const TensorView x = fake(DType::f32, {T, 16});
  for (const std::string& msg : {error_of([&] { moe_forward(Context{}, h.cfg, x, h.weights()); }),
                                 error_of([&] { route(Context{}, h.cfg, x, h.weights().router, RoutingSpec{}); })})
    EXPECT_THAT(msg, AllOf(HasSubstr("N = T*K = 2147483648"), HasSubstr("exceeds the limit of 2147479551"),
                           HasSubstr("int32")));
}

TEST(BadInputIndexLimits, TokenRoundingBoundIsChecked) {
  Huge h;
  h.cfg.top_k = 1;
  RoutingSpec spec;
  spec.mode = RoutingMode::round_up;
  spec.tile = 1 << 28;  // T*K = 2^30 fits; rounding up may add E*(tile-1) ~ 2^31 pairs
  const TensorView x = fake(DType::f32, {std::int64_t{1} << 30, 16});
  EXPECT_THAT(error_of([&] { route(Context{}, h.cfg, x, h.weights().router, spec); }),
              AllOf(HasSubstr("token rounding"), HasSubstr("exceeds the limit")));
}

TEST(BadInputIndexLimits, TokensPastInt32) {
  Huge h;
  h.cfg.hidden_size = 1;
  h.cfg.top_k = 1;
  h.cfg.num_experts = 1;
  const TensorView x = fake(DType::f32, {3000000000, 1});
  EXPECT_THAT(error_of([&] { moe_forward(Context{}, h.cfg, x, h.weights()); }),
              AllOf(HasSubstr("T = 3000000000"), HasSubstr("exceeds the limit")));
}

TEST(BadInputIndexLimits, GeneralRoutingTriplesPastInt32) {
  Huge h;
  RoutingSpec spec;
  spec.mode = RoutingMode::general;
  const std::int64_t N = 3000000000;
  spec.token = fake(DType::i32, {N});
  spec.expert = fake(DType::i32, {N});
  spec.score = fake(DType::f32, {N});
  EXPECT_THAT(error_of([&] { route(Context{}, h.cfg, fake(DType::f32, {64, 16}), TensorView(), spec); }),
              AllOf(HasSubstr("N = spec.token's length = 3000000000"), HasSubstr("exceeds the limit")));
}

TEST(BadInputIndexLimits, BackwardChecksTheSavedPairs) {
  Huge h;
  SavedState saved;
  saved.config = h.cfg;
  saved.routing.mode = RoutingMode::topk;
  saved.routing.meta.num_tokens = 64;
  saved.routing.meta.num_pairs = std::int64_t{1} << 32;  // a corrupt or hand-made saved state
  const TensorView x = fake(DType::f32, {64, 16});
  EXPECT_THAT(error_of([&] { moe_backward(Context{}, x, h.weights(), saved, x); }),
              AllOf(HasSubstr("moe_backward"), HasSubstr("N = "), HasSubstr("4294967296"),
                    HasSubstr("exceeds the limit")));
}

TEST(BadInputIndexLimits, RoutingStagesPastInt32) {
  // The stages alone (the layer checks N itself): their int32 indices and counts would wrap.
  const std::int64_t T = std::int64_t{1} << 30;
  const TensorView logits = fake(DType::f32, {T, 8});
  const TensorView ids = fake(DType::i32, {T, 4}), scores = fake(DType::f32, {T, 4});
  EXPECT_THAT(error_of([&] { topk_routing(Context{}, logits, 4, ids, scores, fake(DType::i32, {4 * T})); }),
              AllOf(HasSubstr("topk_routing"), HasSubstr("T*K = 4294967296"), HasSubstr("exceeds the limit")));
  EXPECT_THAT(error_of([&] { token_rounding(Context{}, logits, 4, 16, RoutingMode::round_up); }),
              AllOf(HasSubstr("token_rounding"), HasSubstr("T*K = 4294967296")));
  const TensorView pairs = fake(DType::i32, {std::int64_t{3} << 30});
  EXPECT_THAT(error_of([&] { build_metadata(Context{}, pairs, pairs, 8, 8); }),
              AllOf(HasSubstr("build_metadata"), HasSubstr("N (pair_token's length) = 3221225472")));
}

TEST(BadInputIndexLimits, ConfigDimensionsPastInt32) {
  MoEConfig cfg{8, 2, std::int64_t{1} << 31, 8, Activation::swiglu, false};
  EXPECT_THAT(error_of([&] { validate_config(cfg); }), AllOf(HasSubstr("hidden_size = 2147483648"), HasSubstr("int32")));
  cfg.hidden_size = 16;
  cfg.intermediate_size = std::int64_t{1} << 30;  // z_width = 2I = 2^31 under swiglu
  EXPECT_THAT(error_of([&] { validate_config(cfg); }), AllOf(HasSubstr("z_width"), HasSubstr("2147483648")));
  cfg.activation = Activation::relu;  // z_width = I fits
  EXPECT_NO_THROW(validate_config(cfg));
  cfg.intermediate_size = INT64_MAX;  // 2I would wrap: rejected before z_width() is computed
  EXPECT_THAT(error_of([&] { validate_config(cfg); }), HasSubstr("intermediate_size = 9223372036854775807"));
}

// ---- 3. Vague errors at the library's entries -----------------------------------------------------------------

TEST(BadInputEntries, NegativeTokenCountNamesX) {
  Huge h;
  TensorView x = fake(DType::f32, {4, 16});
  x.shape[0] = -5;  // a hand-edited view: must not reach "TensorView: negative size" inside an allocation
  for (const std::string& msg : {error_of([&] { moe_forward(Context{}, h.cfg, x, h.weights()); }),
                                 error_of([&] { route(Context{}, h.cfg, x, h.weights().router, RoutingSpec{}); })})
    EXPECT_THAT(msg, AllOf(HasSubstr("argument 'x'"), HasSubstr("-5"), Not(HasSubstr("TensorView"))));
}

TEST(BadInputEntries, RouteValidatesX) {
  Huge h;
  EXPECT_THAT(error_of([&] { route(Context{}, h.cfg, TensorView(), h.weights().router, RoutingSpec{}); }),
              AllOf(HasSubstr("route"), HasSubstr("argument 'x' is required")));
}

TEST(BadInputEntries, ParseBackendNamesTheAcceptedValues) {
  EXPECT_EQ(parse_backend("cpu"), Backend::cpu);
  EXPECT_EQ(parse_backend("cuda"), Backend::cuda);
  EXPECT_THAT(error_of([] { parse_backend("tpu"); }), AllOf(HasSubstr("'tpu'"), HasSubstr("cpu, cuda")));
}

// ---- 5. Hand-edited or foreign state: values the cpu reference indexes with (second fuzzing pass) ---------------
// Each of these used to segfault (or run silently on a wrong value); now an Error names the array and the entry.

// A small real problem (T=8, E=4, K=2, H=8, I=8, swiglu, f32) and its forward.
struct Small {
  MoEConfig cfg{4, 2, 8, 8, Activation::swiglu, false};
  std::int64_t T = 8;
  Tensor x, wr, w1, w2, dO;
  explicit Small(std::int64_t tokens = 8) : T(tokens) {
    std::mt19937 rng(11);
    const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size;
    x = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, DType::f32);
    dO = naive::to_tensor(naive::randn(rng, T * H, 1.0), {T, H}, DType::f32);
    wr = naive::to_tensor(naive::randn(rng, E * H, 0.3), {E, H}, DType::f32);
    w1 = naive::to_tensor(naive::randn(rng, E * 2 * I * H, 0.3), {E, 2 * I, H}, DType::f32);
    w2 = naive::to_tensor(naive::randn(rng, E * H * I, 0.3), {E, H, I}, DType::f32);
  }
  MoEWeights weights() const { return MoEWeights{wr, w1, {}, w2, {}}; }
  ForwardResult forward(const RoutingSpec& spec = {}) const { return moe_forward(Context{}, cfg, x, weights(), spec); }
};

std::int32_t* i32(const Tensor& t) { return t.ptr<std::int32_t>(); }

TEST(BadInputState, StagesCheckTheMetadataValues) {
  Small s;
  const ForwardResult f = s.forward();
  const std::int64_t N = f.saved.routing.meta.num_pairs;
  Tensor a = Tensor::empty({N, 8}, DType::f32), z = Tensor::empty({N, 16}, DType::f32);
  Tensor y = Tensor::zeros({N, 8}, DType::f32), out = Tensor::empty({s.T, 8}, DType::f32);
  auto edited = [&](auto edit) {  // a deep copy of the metadata with one value changed
    RoutingMetadata m = f.saved.routing.meta;
    for (Tensor* t : {&m.counts, &m.offsets, &m.pair, &m.gather, &m.rev, &m.token_offsets}) *t = t->to(Device::cpu());
    edit(m);
    return m;
  };
  const RoutingMetadata gather = edited([](RoutingMetadata& m) { i32(m.gather)[3] = 1 << 30; });
  EXPECT_THAT(error_of([&] { up_projection(Context{}, Activation::swiglu, s.x, s.w1, {}, gather, z, a); }),
              AllOf(HasSubstr("up_projection"), HasSubstr("'meta.gather'[3] = 1073741824"), HasSubstr("[0, T = 8)")));
  const RoutingMetadata rev = edited([](RoutingMetadata& m) { i32(m.rev)[2] = -5; });
  EXPECT_THAT(error_of([&] { aggregate(Context{}, y, {}, rev, out); }), HasSubstr("'meta.rev'[2] = -5"));
  const RoutingMetadata rev_high = edited([](RoutingMetadata& m) { i32(m.rev)[2] = 16; });  // N = 16 rows of y
  EXPECT_THAT(error_of([&] { aggregate(Context{}, y, {}, rev_high, out); }),
              AllOf(HasSubstr("'meta.rev'[2] = 16"), HasSubstr("[0, N = 16)")));
  const RoutingMetadata toff = edited([](RoutingMetadata& m) { i32(m.token_offsets)[8] = 1 << 30; });
  EXPECT_THAT(error_of([&] { aggregate(Context{}, y, {}, toff, out); }), HasSubstr("'meta.token_offsets'[8]"));
  const RoutingMetadata off = edited([](RoutingMetadata& m) { i32(m.offsets)[1] = -100; });
  Tensor dw1 = Tensor::empty({4, 16, 8}, DType::f32);
  EXPECT_THAT(error_of([&] { weight_grad_w1(Context{}, z, s.x, off, dw1, {}); }),
              AllOf(HasSubstr("weight_grad_w1"), HasSubstr("'meta.offsets'[1] = -100")));
  const RoutingMetadata cnt = edited([](RoutingMetadata& m) { i32(m.counts)[3] = 1 << 29; i32(m.offsets)[4] = 1 << 30; });
  EXPECT_THAT(error_of([&] { down_projection(Context{}, a, s.w2, {}, cnt, y); }),
              AllOf(HasSubstr("down_projection"), HasSubstr("'meta.offsets'[4]")));
}

TEST(BadInputState, NegativeMetadataSizesAreNotWildcards) {
  // num_tokens = -2 made every "[T+1]" / "[T, H]" check a wildcard (-1: any): aggregate ran over no token and left
  // its output unwritten, without an error.
  Small s;
  const ForwardResult f = s.forward();
  RoutingMetadata m = f.saved.routing.meta;
  m.num_tokens = -2;
  Tensor y = Tensor::zeros({m.num_pairs, 8}, DType::f32), out = Tensor::empty({8, 8}, DType::f32);
  EXPECT_THAT(error_of([&] { aggregate(Context{}, y, {}, m, out); }),
              AllOf(HasSubstr("aggregate"), HasSubstr("num_tokens = -2"), HasSubstr("expected T >= 0")));
  m = f.saved.routing.meta;
  m.num_pairs = -1;
  EXPECT_THAT(error_of([&] { aggregate(Context{}, y, {}, m, out); }), HasSubstr("num_pairs = -1"));
  SavedState st = f.saved;
  st.routing.meta.num_tokens = -2;
  EXPECT_THAT(error_of([&] { validate_saved_state(Context{}, st, -2); }), HasSubstr("num_tokens = -2"));
}

// An allocator that fails by returning null (instead of throwing) must not hand out a tensor with no memory.
struct NullAllocator final : Allocator {
  void* allocate(std::size_t, Device, void*) override { return nullptr; }
  void deallocate(void*, std::size_t, Device, void*) override {}
};

TEST(BadInputState, AllocatorReturningNull) {
  NullAllocator none;
  EXPECT_THAT(error_of([&] { Tensor::empty({4, 4}, DType::f32, Device::cpu(), &none); }),
              AllOf(HasSubstr("allocator returned a null pointer for 64 bytes"), HasSubstr("[4, 4]")));
  Small s;
  Context ctx;
  ctx.allocator = &none;
  EXPECT_THAT(error_of([&] { moe_forward(ctx, s.cfg, s.x, s.weights()); }), HasSubstr("null pointer"));
}

TEST(BadInputState, RouterBackwardChecksTheRouting) {
  Small s(64);
  RoutingSpec spec;
  spec.mode = RoutingMode::round_up;
  spec.tile = 4;
  const ForwardResult f = s.forward(spec);
  const std::int64_t N = f.saved.routing.meta.num_pairs;
  Tensor ds = Tensor::zeros({N}, DType::f32), dl = Tensor::empty({64, 4}, DType::f32);
  Routing r = f.saved.routing;
  r.topk_expert = Tensor();
  EXPECT_THAT(error_of([&] { router_backward(Context{}, r, ds, 0.0f, dl); }),
              AllOf(HasSubstr("router_backward"), HasSubstr("'routing.topk_expert' is required")));
  r = f.saved.routing;
  r.pair_slot = r.pair_slot.to(Device::cpu());
  i32(r.pair_slot)[0] = 1 << 20;
  EXPECT_THAT(error_of([&] { router_backward(Context{}, r, ds, 0.0f, dl); }),
              AllOf(HasSubstr("'routing.pair_slot'[0] = 1048576"), HasSubstr("[-1, 2)")));
  r = f.saved.routing;
  r.mode = static_cast<RoutingMode>(42);
  EXPECT_THAT(error_of([&] { router_backward(Context{}, r, ds, 0.0f, dl); }), HasSubstr("routing.mode = 42"));
  r = f.saved.routing;
  r.top_k = 100;
  EXPECT_THAT(error_of([&] { router_backward(Context{}, r, ds, 0.0f, dl); }), HasSubstr("top_k = 100"));
  r = f.saved.routing;
  r.router.n_group = 0;
  EXPECT_THAT(error_of([&] { router_backward(Context{}, r, ds, 0.0f, dl); }), HasSubstr("router.n_group = 0"));
}

TEST(BadInputState, BackwardValidatesTheSavedState) {
  Small s;
  const auto backward_error = [&](auto edit) {
    ForwardResult f = s.forward();
    edit(f.saved);
    return error_of([&] { moe_backward(Context{}, s.x, s.weights(), f.saved, s.dO, 1.0f); });
  };
  EXPECT_THAT(backward_error([](SavedState& st) { i32(st.routing.meta.gather)[0] = 1000000; }),
              AllOf(HasSubstr("moe_backward: argument 'saved'"), HasSubstr("saved state 'gather'[0] = 1000000")));
  EXPECT_THAT(backward_error([](SavedState& st) { i32(st.routing.meta.rev)[0] = -7000000; }),
              HasSubstr("saved state 'rev'[0] = -7000000"));
  EXPECT_THAT(backward_error([](SavedState& st) { i32(st.routing.topk_expert)[0] = 99999; }), HasSubstr("99999"));
  EXPECT_THAT(backward_error([](SavedState& st) { st.routing.topk_score = Tensor(); }),
              HasSubstr("'topk_score' is required"));
  EXPECT_THAT(backward_error([](SavedState& st) { st.routing.top_k = 5; }), HasSubstr("routing.top_k = 5"));
  EXPECT_THAT(backward_error([](SavedState& st) { st.routing.mode = static_cast<RoutingMode>(42); }),
              HasSubstr("routing.mode = 42"));
  // Under a capacity the dropped pairs' dscore is only zeroed when 'dropped' is there: without it, uninitialised.
  RoutingSpec cap;
  cap.router.capacity_factor = 0.5;
  ForwardResult f = s.forward(cap);
  f.saved.routing.meta.dropped = Tensor();
  EXPECT_THAT(error_of([&] { moe_backward(Context{}, s.x, s.weights(), f.saved, s.dO); }), HasSubstr("dropped"));
}

TEST(BadInputState, EnumsCastFromInts) {
  Small s;
  Context bad;
  bad.backend = static_cast<Backend>(7);
  EXPECT_THAT(error_of([&] { moe_forward(bad, s.cfg, s.x, s.weights()); }), HasSubstr("ctx.backend = 7"));
  const ForwardResult f = s.forward();
  const std::int64_t N = f.saved.routing.meta.num_pairs;
  Tensor z = Tensor::empty({N, 16}, DType::f32), dz = Tensor::empty({N, 16}, DType::f32);
  Tensor as = Tensor::empty({N, 8}, DType::f32), ds = Tensor::empty({N}, DType::f32);
  EXPECT_THAT(error_of([&] {
                dgated(Context{}, static_cast<Activation>(-1), s.dO, s.w2, {}, f.saved.z, f.saved.routing.pair_score,
                       f.saved.routing.meta, dz, as, ds);
              }),
              AllOf(HasSubstr("dgated"), HasSubstr("'act' = -1")));
  EXPECT_THAT(error_of([&] { up_projection(Context{}, static_cast<Activation>(42), s.x, s.w1, {},
                                           f.saved.routing.meta, z, as); }),
              HasSubstr("'act' = 42"));
  EXPECT_THAT(error_of([&] { moe_memory_estimate(s.cfg, 8, DType::f32, {}, static_cast<MemoryPass>(42)); }),
              HasSubstr("pass = 42"));
  RoutingSpec spec;
  spec.mode = static_cast<RoutingMode>(42);
  EXPECT_THAT(error_of([&] { moe_memory_estimate(s.cfg, 8, DType::f32, spec); }), HasSubstr("spec.mode = 42"));
  EXPECT_THAT(error_of([] { Tensor::empty({4}, static_cast<DType>(42)); }), HasSubstr("dtype = 42"));
}

TEST(BadInputState, ViewsAndCopies) {
  Small s;
  const TensorView shifted(static_cast<char*>(s.x.data()) + 1, DType::f32, {7, 8});
  EXPECT_THAT(error_of([&] { moe_forward(Context{}, s.cfg, shifted, s.weights()); }),
              AllOf(HasSubstr("argument 'x'"), HasSubstr("not aligned to its 4-byte f32 elements")));
  Tensor dst = Tensor::empty({4}, DType::f32);
  EXPECT_THAT(error_of([&] { copy(dst, TensorView(nullptr, DType::f32, {4})); }), HasSubstr("null data pointer"));
  RouterSpec r;
  r.capacity_factor = 1e308;  // T*K = 2^62 * 8 would wrap int64
  EXPECT_EQ(r.expert_capacity(std::int64_t{1} << 62, 8, 1), std::int64_t{1} << 62);
  r.capacity_factor = 1.0;
  EXPECT_EQ(r.expert_capacity(10, 2, 4), 5);
  Tensor t = Tensor::zeros({1}, DType::i32), e = Tensor::zeros({1}, DType::i32);
  EXPECT_THAT(error_of([&] { build_metadata(Context{}, t, e, std::int64_t{1} << 40, 4); }),
              AllOf(HasSubstr("num_tokens = 1099511627776"), HasSubstr("exceeds the limit")));
}

TEST(BadInputState, RouterBiasAuxCountsAndSeparateHalves) {
  Small s;
  RoutingSpec spec;
  spec.router.score_function = ScoreFunction::sigmoid;
  Tensor bias = Tensor::zeros({4}, DType::f32);
  bias.ptr<float>()[1] = NAN;  // used to steer the selection silently
  spec.router.e_score_correction_bias = bias;
  EXPECT_THAT(error_of([&] { s.forward(spec); }),
              AllOf(HasSubstr("'router.e_score_correction_bias' [1] = nan"), HasSubstr("not finite")));
  spec.router.e_score_correction_bias = TensorView(nullptr, DType::f32, {4});  // used to be read as "no bias"
  EXPECT_THAT(error_of([&] { s.forward(spec); }), HasSubstr("null data pointer"));
  Tensor logits = Tensor::zeros({4, 4}, DType::f32), counts = Tensor::zeros({4}, DType::i32);
  Tensor out = Tensor::empty({1}, DType::f32);
  i32(counts)[0] = -5;  // the loss used to come out as 0
  EXPECT_THAT(error_of([&] { aux_loss(Context{}, logits, counts, out); }), HasSubstr("'counts'[0] = -5"));
  // Separate gate / up tensors that overlap (up 8 elements above gate) used to run on aliased rows.
  MoEConfig cfg = s.cfg;
  cfg.w1_layout = W1Layout::separate;
  float* base = s.w1.ptr<float>();
  MoEWeights w = s.weights();
  w.w1 = TensorView(base, DType::f32, {4, 8, 8});
  w.w1_up = TensorView(base + 8, DType::f32, {4, 8, 8});
  EXPECT_THAT(error_of([&] { moe_forward(Context{}, cfg, s.x, w); }),
              AllOf(HasSubstr("'w1_up'"), HasSubstr("overlaps 'w1'"), HasSubstr("1024 bytes")));
  w.w1_up = TensorView(base + 256, DType::f32, {4, 8, 8});  // the two halves of one allocation: fine
  EXPECT_NO_THROW(moe_forward(Context{}, cfg, s.x, w));
}

TEST(BadInputState, DispatchedBackwardChecksTheForward) {
  Small s(4);
  s.cfg.top_k = 1;
  const MoEWeights w{{}, s.w1, {}, s.w2, {}};
  Tensor idx = Tensor::empty({4, 1}, DType::i32), wt = Tensor::empty({4, 1}, DType::f32);
  for (int i = 0; i < 4; ++i) i32(idx)[i] = i, wt.ptr<float>()[i] = 1.0f;
  DispatchedForward f = moe_forward_deepep(Context{}, s.cfg, s.x, idx, wt, w);
  f.pair_slot = f.pair_slot.to(Device::cpu());
  i32(f.pair_slot)[0] = 1 << 28;
  EXPECT_THAT(error_of([&] { moe_backward_dispatched(Context{}, s.x, w, f, s.dO); }),
              AllOf(HasSubstr("'fwd.pair_slot'[0] = 268435456"), HasSubstr("[0, 4)")));
  f.contract = static_cast<DispatchContract>(9);
  EXPECT_THAT(error_of([&] { moe_backward_dispatched(Context{}, s.x, w, f, s.dO); }), HasSubstr("contract = 9"));
  // N = 0 rows: the weights still give the gradients' shapes, so they are checked (an empty MoEWeights used to
  // return [0, 0, 0] gradients).
  const TensorView x0(s.x.data(), DType::f32, {0, 8});
  Tensor idx0 = Tensor::empty({0, 2}, DType::i32), wt0 = Tensor::empty({0, 2}, DType::f32);
  const DispatchedForward f0 = moe_forward_deepep(Context{}, s.cfg, x0, idx0, wt0, w);
  EXPECT_THAT(error_of([&] { moe_backward_dispatched(Context{}, x0, MoEWeights{}, f0, x0); }),
              HasSubstr("argument 'w1' is required"));
  const DispatchedGradients g = moe_backward_dispatched(Context{}, x0, w, f0, x0);
  EXPECT_EQ(g.dw1.view().shape_str(), "[4, 16, 8]");
}

TEST(BadInputState, InProcessGroup) {
  EXPECT_THAT(error_of([] { run_in_process(2, std::function<void(Communicator&)>()); }),
              HasSubstr("argument 'fn' is empty"));
  // Ranks that disagree on the row width (or dtype) used to copy out of bounds.
  EXPECT_THAT(error_of([] {
                run_in_process(2, [](Communicator& c) {
                  Tensor send = Tensor::zeros({4, 1 + 7 * c.rank()}, DType::f32);
                  Tensor recv = Tensor::zeros({4, 1 + 7 * c.rank()}, DType::f32);
                  c.all_to_all_v(send, {2, 2}, recv, {2, 2}, nullptr);
                });
              }),
              HasSubstr("different widths or dtypes"));
  EXPECT_THAT(error_of([] {
                run_in_process(2, [](Communicator& c) {
                  Tensor send = Tensor::zeros({4, 2}, DType::f32), recv = Tensor::zeros({400, 2}, DType::f32);
                  c.all_to_all_v(send, {100, 100}, recv, {100, 100}, nullptr);
                });
              }),
              HasSubstr("more rows than the tensors hold"));
  // A rank that returns without joining the others' collective used to leave them waiting forever.
  EXPECT_THAT(error_of([] {
                run_in_process(3, [](Communicator& c) {
                  if (c.rank() == 1) return;
                  Tensor t = Tensor::zeros({1}, DType::f32);
                  c.all_reduce_sum(t, nullptr);
                });
              }),
              AllOf(HasSubstr("rank 1 returned from fn without joining this collective"), HasSubstr("abandoned")));
  // Ranks calling different collectives at the same point: all_to_all_v read the other's all_reduce post as row
  // counts (a segfault).
  EXPECT_THAT(error_of([] {
                run_in_process(2, [](Communicator& c) {
                  Tensor t = Tensor::zeros({4, 2}, DType::f32), r = Tensor::zeros({4, 2}, DType::f32);
                  if (c.rank() == 0) c.all_reduce_sum(t, nullptr);
                  else c.all_to_all_v(t, {2, 2}, r, {2, 2}, nullptr);
                });
              }),
              AllOf(HasSubstr("called all_reduce_sum while rank"), HasSubstr("called all_to_all_v")));
  // A strided send view was copied as contiguous rows (stride 0: rows read past the one stored row).
  EXPECT_THAT(error_of([] {
                run_in_process(2, [](Communicator& c) {
                  Tensor one = Tensor::zeros({1, 2}, DType::f32), recv = Tensor::zeros({4, 2}, DType::f32);
                  const TensorView send = TensorView::strided(one.data(), DType::f32, {4, 2}, {0, 1});
                  c.all_to_all_v(send, {2, 2}, recv, {2, 2}, nullptr);
                });
              }),
              HasSubstr("must be contiguous"));
  // Ranks that all return right after their last collective are fine.
  EXPECT_NO_THROW(run_in_process(4, [](Communicator& c) {
    for (int i = 0; i < 50; ++i) {
      Tensor t = Tensor::zeros({1}, DType::i32);
      c.all_reduce_sum(t, nullptr);
    }
  }));
  // An edited expert-parallel state (slot_row indexes the exchanged weight gradients).
  EXPECT_THAT(error_of([] {
                run_in_process(2, [](Communicator& c) {
                  Small s(4);
                  const MoEWeights w{s.wr, TensorView(s.w1.data(), DType::f32, {2, 16, 8}), {},
                                     TensorView(s.w2.data(), DType::f32, {2, 8, 8}), {}};
                  EPForwardResult f = ep_moe_forward(Context{}, c, s.cfg, s.x, w);
                  f.saved.slot_row[0] = 1 << 28;
                  ep_moe_backward(Context{}, c, s.x, w, f.saved, s.dO);
                });
              }),
              HasSubstr("saved.slot_row[0] = 268435456"));
}

// ---- The CLIs: every bad argument is "error: ..." naming it, with exit code 2 ---------------------------------

struct CliRun {
  int code = -1;
  std::string out;  // stdout and stderr
};

CliRun run(const std::string& binary, const std::string& args) {
  CliRun r;
  const std::string cmd = "'" + binary + "' " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A configs file in the test's temporary folder.
std::string configs_file(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "bad_input_" + name + ".json";
  std::ofstream(path) << text;
  return path;
}
const char* kOneConfig = R"({"configs": [{"name": "tiny", "T": 64, "H": 16, "I": 16, "E": 4, "K": 2 %s}]})";
std::string one_config(const std::string& extra) {
  char buf[512];
  std::snprintf(buf, sizeof buf, kOneConfig, extra.c_str());
  return buf;
}

#if defined(SONICMOE_BENCH_BIN) && defined(SONICMOE_TRAIN_BIN)
const std::string kBench = SONICMOE_BENCH_BIN;
const std::string kTrain = SONICMOE_TRAIN_BIN;

// Exit code 2, "error: " and every fragment; never an abort or a bare "stoi"/"stoll".
void expect_cli_error(const CliRun& r, std::initializer_list<const char*> fragments) {
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("error: "));
  for (const char* f : fragments) EXPECT_THAT(r.out, HasSubstr(f));
  EXPECT_THAT(r.out, AllOf(Not(HasSubstr("stoi")), Not(HasSubstr("stoll")), Not(HasSubstr("terminate"))));
}

TEST(BadInputCli, ThiekPastInt64) {
  // The fuzzer's crash: each size fits, their product (E * z_width * H weights) does not fit int64.
  expect_cli_error(run(kBench, "--backend cpu --thiek 3000000,3000000,3000000,3000000,2"),
                   {"size overflow", "does not fit in int64"});
  const std::string big = "9223372036854775807";
  expect_cli_error(run(kBench, "--backend cpu --thiek " + big + "," + big + "," + big + ",2,2"),
                   {"hidden_size = 9223372036854775807", "exceeds the limit"});
  expect_cli_error(run(kBench, "--backend cpu --thiek 99999999999999999999,8,8,4,2"),
                   {"--thiek T", "99999999999999999999", "out of range"});
}

TEST(BadInputCli, ThiekBeyondInt32AndMemory) {
  expect_cli_error(run(kBench, "--backend cpu --thiek 1073741824,16,8,8,4"), {"N = T*K = 4294967296", "int32"});
  expect_cli_error(run(kBench, "--backend cpu --thiek 100000000,4096,1024,64,8"),
                   {"not enough host memory", "T = 100000000", "H = 4096", "I = 1024", "E = 64", "K = 8", "bytes"});
}

TEST(BadInputCli, FractionalAndMalformedIntegers) {
  expect_cli_error(run(kBench, "--backend cpu --thiek 8.5,16,16,4,2"), {"--thiek T", "'8.5'", "not an integer"});
  expect_cli_error(run(kBench, "--backend cpu --thiek 64,16,16,4,"), {"--thiek K", "''"});
  expect_cli_error(run(kBench, "--backend cpu --iters abc"), {"--iters", "'abc'"});
  expect_cli_error(run(kBench, "--backend cpu --warmup -1"), {"--warmup = -1", "out of range"});
  expect_cli_error(run(kTrain, "--steps 2.5"), {"--steps", "'2.5'"});
}

TEST(BadInputCli, ConfigsFileIntegerFields) {
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " +
                                   configs_file("k", R"({"configs": [{"name": "tiny", "T": 64, "H": 16, "I": 16,
                                                          "E": 4, "K": 2.7}]})")),
                   {"config 'tiny'", "field 'K'", "'2.7'", "not an integer"});
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " + configs_file("tile", one_config(", \"tile\": 2.9"))),
                   {"field 'tile'", "'2.9'"});
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " + configs_file("t", R"({"configs": [{"name": "tiny", "T": "64", "H": 16, "I": 16, "E": 4, "K": 2}]})")),
                   {"field 'T'", "a string", "expected a positive integer"});
}

TEST(BadInputCli, ConfigsFileNestingLimit) {
  const std::string deep = "{\"configs\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " + configs_file("deep", deep)),
                   {"nesting deeper than 64 levels"});
}

TEST(BadInputCli, ConfigsFileRoutingStringIsAOneElementList) {
  const CliRun r = run(kBench, "--backend cpu --no-check --iters 1 --warmup 0 --config all --configs-file " +
                                configs_file("rs", one_config(", \"routing\": \"round-up\"")));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, AllOf(HasSubstr("round-up"), Not(HasSubstr("FAILED"))));
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " + configs_file("r7", one_config(", \"routing\": 7"))),
                   {"field 'routing'", "a number", "expected a string or a list of strings"});
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " +
                                   configs_file("rx", one_config(", \"routing\": [\"topk\", \"sideways\"]"))),
                   {"field 'routing'[1]", "'sideways'"});
}

TEST(BadInputCli, UnknownBackendIsAnError) {
  expect_cli_error(run(kTrain, "--backend tpu --steps 1"), {"--backend", "'tpu'", "cpu, cuda"});
  expect_cli_error(run(kBench, "--backend tpu"), {"--backend", "'tpu'", "cpu, cuda"});
}

TEST(BadInputCli, GeneralRoutingIsRefusedByTheTools) {
  expect_cli_error(run(kBench, "--backend cpu --routing general"), {"--routing = general", "not supported"});
  expect_cli_error(run(kTrain, "--routing general"), {"--routing = general", "not supported"});
  expect_cli_error(run(kBench, "--backend cpu --config all --configs-file " +
                                   configs_file("rg", one_config(", \"routing\": [\"general\"]"))),
                   {"field 'routing'[0] = general", "not supported"});
}

TEST(BadInputCli, TrainStepsMustBePositive) {
  expect_cli_error(run(kTrain, "--steps 0"), {"--steps = 0", "out of range"});
  const CliRun ok = run(kTrain, "--steps 1");
  EXPECT_EQ(ok.code, 1) << ok.out;  // one step: the loss cannot have gone down yet, but it is reported
  EXPECT_THAT(ok.out, AllOf(HasSubstr("mse went from"), Not(HasSubstr("nan"))));
}
TEST(BadInputCli, RepeatedFlags) {
  expect_cli_error(run(kBench, "--backend cpu --iters 2 --iters 3"), {"--iters given twice", "'2'", "'3'"});
  expect_cli_error(run(kBench, "--backend cpu --thiek 8,8,8,4,2 --thiek 16,8,8,4,2"), {"--thiek given twice"});
  expect_cli_error(run(kBench, "--backend cpu --routing topk --routing topk"), {"--routing topk given twice"});
  expect_cli_error(run(kTrain, "--steps 1 --steps 2"), {"--steps given twice", "'1'", "'2'"});
}

TEST(BadInputCli, ErrorsStayOnOneLine) {
  // An echoed value with a newline or a terminal escape used to split the message over lines / reach the terminal.
  const CliRun r = run(kBench, "--backend cpu --config \"$(printf 'a\\nb\\033[31m')\"");
  expect_cli_error(r, {"no config named 'a\\nb\\x1b[31m'"});
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

TEST(BadInputCli, ContradictoryOrIgnoredFlags) {
  expect_cli_error(run(kBench, "--backend cpu --dtype ''"), {"--dtype ''", "expected bf16"});
  expect_cli_error(run(kBench, "--backend cpu --configs-file " + configs_file("ign", one_config(""))),
                   {"--configs-file", "only read with --config"});
  expect_cli_error(run(kBench, "--backend cpu --router qwen3 --precision fp8"), {"--router qwen3", "--precision fp8"});
  expect_cli_error(run(kBench, "--backend cpu --router qwen3 --w1-layout both"), {"--router qwen3", "--w1-layout both"});
  expect_cli_error(run(kBench, "--backend cpu --dtype f16 --precision fp8 --thiek 64,128,128,4,2"),
                   {"--dtype f16", "--precision fp8"});
  // --router default alone used to run nothing and exit 0.
  const CliRun r = run(kBench, "--backend cpu --router default --thiek 64,16,16,4,2 --iters 1 --warmup 0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("custom             topk"));
}

TEST(BadInputCli, ConfigsFileStrictJson) {
  const std::string bench = "--backend cpu --no-check --iters 1 --warmup 0 --config all --configs-file ";
  const std::string tiny = R"("name": "tiny", "H": 16, "I": 16, "E": 4, "K": 2)";
  expect_cli_error(run(kBench, bench + configs_file("dk", "{\"configs\": [{" + tiny + ", \"T\": 64, \"T\": 32}]}")),
                   {"duplicate key \"T\""});
  expect_cli_error(run(kBench, bench + configs_file("uk", one_config(", \"tiel\": 16"))),
                   {"unknown field 'tiel'"});
  expect_cli_error(run(kBench, bench + configs_file("nan", "{\"configs\": [{" + tiny + ", \"T\": NaN}]}")),
                   {"invalid value 'NaN'"});
  expect_cli_error(run(kBench, bench + configs_file("plus", "{\"configs\": [{" + tiny + ", \"T\": +64}]}")),
                   {"invalid value '+64'"});
  expect_cli_error(run(kBench, bench + configs_file("ctl", "{\"configs\": [{\"name\": \"a\x01\", \"T\": 64}]}")),
                   {"control character 1"});
  expect_cli_error(run(kBench, bench + configs_file("en", R"({"configs": [{"name": "", "T": 64}]})")),
                   {"non-empty string 'name'"});
  expect_cli_error(run(kBench, bench + configs_file("dn", "{\"configs\": [{" + tiny + ", \"T\": 64}, {" + tiny +
                                                              ", \"T\": 32}]}")),
                   {"configs 0 and 1 are both named 'tiny'"});
  expect_cli_error(run(kBench, bench + configs_file("er", one_config(", \"routing\": []"))),
                   {"field 'routing' is an empty list"});
  expect_cli_error(run(kBench, bench + configs_file("rr", one_config(", \"routing\": [\"topk\", \"topk\"]"))),
                   {"field 'routing'[1] = topk repeats an earlier entry"});
  // \u escapes are decoded ("ti\u006ey" is "tiny"; it used to read as "tiu006ey").
  const CliRun ok = run(kBench, bench + configs_file("esc", R"({"_doc": "x", "configs": [{"name": "ti\u006ey", "T": 64, "H": 16, "I": 16, "E": 4, "K": 2}]})"));
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_THAT(ok.out, AllOf(HasSubstr("tiny "), Not(HasSubstr("u006e"))));
}

TEST(BadInputCli, ConfigsFileMustBeARegularFileOfSaneSize) {
  const std::string bench = "--backend cpu --config all --configs-file ";
  expect_cli_error(run(kBench, bench + "/dev/zero"), {"'/dev/zero' is not a regular file"});  // grew without bound
  expect_cli_error(run(kBench, bench + testing::TempDir()), {"is a directory"});
  const std::string big = testing::TempDir() + "bad_input_big.json";
  { std::ofstream(big) << "{}"; }
  std::filesystem::resize_file(big, std::uintmax_t{65} << 20);  // sparse: no disk used
  expect_cli_error(run(kBench, bench + big), {"bytes, more than the limit of 67108864"});
  std::filesystem::remove(big);
}

TEST(BadInputCli, TrainMemoryAndZeroLoss) {
  // About 3 TB of parameters and optimizer state: more than any machine this runs on (216 GiB at H = I = 1024 fitted
  // a 256 GiB GPU host, which then trained for minutes).
  expect_cli_error(run(kTrain, "--size 1048576,4096,4096,1024,1 --steps 1"),
                   {"not enough host memory", "T = 1048576", "E = 1024"});
  // Token rounding that routes no pair at this size: a zero loss, reported as such (was "(-nanx lower)").
  const CliRun r = run(kTrain, "--routing round-nearest --size 4,8,8,8,1 --steps 2");
  EXPECT_THAT(r.out, AllOf(HasSubstr("nothing to learn"), Not(HasSubstr("nan"))));
}
#else
TEST(BadInputCli, Binaries) { GTEST_SKIP() << "built without the tools (SONICMOE_BUILD_TOOLS=OFF)"; }
#endif

}  // namespace

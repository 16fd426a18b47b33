// sonicmoe-bench: forward / backward / forward+backward time, TFLOP/s and peak memory of the MoE layer
// for the shapes of bench_configs.json (or one given shape), with a correctness check of the chosen
// backend against the CPU reference at a reduced size. --precision fp8 adds the FP8 blockwise layer next to the bf16
// one on every case, twice: with the weights quantised in every forward (row fp8: a training step of one
// micro-batch; the forward quantises W1 and W2 with their transposed copies, the backward reuses them) and with
// pre-quantised weights (row fp8pq: MoEWeights::fp8 made once, the steady state of gradient accumulation); their
// TFLOP/s on the same FLOPs, the speedup, the time of the weights' quantisation alone, and the precision against the
// bf16 layer at full size (cosine and relative RMS error of out, dx, ds, dW1, dW2).
// --w1-layout concat runs the layer on W1 / b1 stored concatenated ([gate; up], MoEConfig::w1_layout), separate on
// separate gate / up tensors (the two halves of one allocation, read in place); --w1-layout both runs each case
// interleaved, then concatenated, all interleaved, concatenated, then separate, and prints each other layout's speed
// relative to the interleaved one.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_configs.h"
#include "bench_util.h"
#include "cli.h"
#include "routing_util.h"
#include "sonicmoe/detail/host_util.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"

using namespace sonicmoe;
using namespace sonicmoe::tools;

namespace {

struct Options {
  std::vector<std::string> configs;  // names; "all" for every config in the file
  bool have_thiek = false;
  BenchConfig thiek;
  std::vector<std::string> routing;  // empty: each config's own list (top-K by default)
  std::string backend;               // "" = cuda if available else cpu; else "cpu" or "cuda" (checked)
  std::string dtype;                 // "" = bf16 on cuda, f32 on cpu; or bf16, f16 (fp16), f32
  std::string config_file = SONICMOE_DEFAULT_CONFIGS;
  Activation act = Activation::swiglu;
  bool bias = false;
  int warmup = 2, iters = 10;
  bool check = true;
  bool graph = false;  // time CUDA-graph replays of forward / backward instead of direct calls
  bool fp8 = false;    // --precision fp8: the FP8 layer beside the bf16 layer
  bool fp8_wgrad = false;  // --fp8-weight-grads: also the FP8 row with FP8 weight gradients (fp8pq+w8)
  bool fp8_dgated_given = false;
  Precision fp8_dgated = MoEConfig{}.dgated_precision;  // --fp8-dgated: the FP8 rows' MoEConfig::dgated_precision
  // --w1-layout: the rows' W1 layout (interleaved, concat or separate); both / all: each case interleaved, then in
  // the layouts of w1_also (both: concatenated; all: concatenated and separate)
  W1Layout w1_layout = W1Layout::interleaved;
  bool w1_both = false;
  std::vector<W1Layout> w1_also;
  // --router: the top-K router of each case (default softmax top-K, qwen3, deepseek-v3; routing_util.h's presets)
  std::vector<std::string> routers;
};

// The router presets --router names (tests/routing_util.h): default (softmax over the K selected logits), qwen3
// (softmax over all E, renormalised over the K picks), deepseek-v3 (sigmoid + e_score_correction_bias, 8 groups of
// which 4 kept where E allows, renormalised, scaled by 2.5). bias: deepseek-v3's f32 [E] selection bias.
RouterSpec bench_router(const std::string& name, std::int64_t E, std::int64_t K, const Tensor* bias) {
  if (name == "default") return RouterSpec{};
  if (name == "qwen3") return testing_util::qwen3_router();
  SONICMOE_CHECK(name == "deepseek-v3", "sonicmoe-bench: --router ", name, ", expected default, qwen3 or deepseek-v3");
  const bool grouped = E % 8 == 0 && E / 8 >= 2 && K <= 4 * (E / 8);
  RouterSpec rs = testing_util::deepseek_v3_router(grouped ? 8 : 1, grouped ? 4 : 1);
  if (bias) rs.e_score_correction_bias = *bias;
  return rs;
}

void usage() {
  std::puts(
      "usage: sonicmoe-bench [--config NAME|all]... [--thiek T,H,I,E,K] [--routing topk|round-down|round-up|"
      "round-nearest]...\n"
      "                      [--backend cpu|cuda] [--dtype bf16|f16|f32] [--activation swiglu|...] [--bias]\n"
      "                      [--iters N] [--warmup N] [--no-check] [--graph] [--configs-file PATH]\n"
      "                      [--precision bf16|fp8 [--fp8-weight-grads] [--fp8-dgated bf16|fp8]]\n"
      "                      [--w1-layout interleaved|concat|...]\n"
      "                      [--router NAME]...\n"
      "Without --config/--thiek: every config of the file on a GPU; on a machine without one, the CPU backend\n"
      "on the small shape cpu-small (T=512, H=256, I=128, E=16, K=4).\n"
      "--graph (cuda backend; top-K and general routing): forward and backward are each captured once into a\n"
      "CUDA graph and the replays are timed (no host work between kernels: what a captured training step pays).\n"
      "--precision fp8: every case runs the bf16 layer, then the FP8 blockwise layer (MoEConfig::precision\n"
      "fp8_blockwise, bf16 weight gradients) twice: row fp8 quantises the weights in every forward (W1, W2 and\n"
      "their transposed copies, reused by the backward: one micro-batch per step), row fp8pq takes them\n"
      "pre-quantised (MoEWeights::fp8, made once: gradient accumulation's steady state). TF/s on the same FLOPs,\n"
      "speedup over bf16, the weights' quantisation alone (quant ms), and the precision of out, dx, ds, dW1, dW2\n"
      "against the bf16 layer at full size (worst cosine, worst relative RMS; gate: >= 0.997, < 7.6%); fp8pq\n"
      "checks that it gives fp8's bits instead. --fp8-weight-grads adds row fp8pq+w8: fp8pq with FP8 weight\n"
      "gradients (MoEConfig::weight_grad_precision fp8_blockwise), its precision against the bf16 layer.\n"
      "--fp8-dgated bf16|fp8: the FP8 rows' dgated GEMM on bf16 or FP8 operands (MoEConfig::dgated_precision; default\n"
      "the library's).\n"
      "--router default|qwen3|deepseek-v3 (repeatable; top-K routing only): the router of each case (Qwen3: softmax\n"
      "over all E, renormalised; DeepSeek-V3: sigmoid + selection bias, 8 groups / 4 kept where E allows,\n"
      "renormalised, x2.5); rows marked '/qwen3', '/deepseek-v3'; their check against the CPU reference is skipped\n"
      "(test_cuda_layer and test_cuda_routing cover the variants).\n"
      "--w1-layout concat: W1 and b1 stored concatenated [gate; up] (MoEConfig::w1_layout; rows marked '+cat');\n"
      "separate: W1 and b1 as separate gate and up tensors, the two halves of one allocation (rows marked '+sep');\n"
      "both: each case interleaved, then concatenated; all: interleaved, concatenated, then separate; each other\n"
      "layout's row with its speed relative to the interleaved one (x > 1: faster). GLU activations only; not with\n"
      "--precision fp8.");
}

// --thiek T,H,I,E,K: five integers >= 1, each named in its error (the layer checks their limits and products).
BenchConfig parse_thiek(const std::string& text) {
  const std::vector<std::string> items = cli::split_commas(text);
  SONICMOE_CHECK(items.size() == 5, "sonicmoe-bench: --thiek expects T,H,I,E,K (5 integers), got '", text, "'");
  const char* names[5] = {"T", "H", "I", "E", "K"};
  std::int64_t v[5];
  for (int i = 0; i < 5; ++i)
    v[i] = cli::parse_int(items[i], std::string("sonicmoe-bench: --thiek ") + names[i], 1, INT64_MAX);
  return BenchConfig{"custom", v[0], v[1], v[2], v[3], v[4], {}, 128};
}

Options parse(int argc, char** argv) {
  Options o;
  cli::SeenFlags seen("sonicmoe-bench");
  bool have_config_file = false;
  cli::for_each_option(argc, argv, "sonicmoe-bench", [&](const std::string& a, auto next) {
    const std::string flag = "sonicmoe-bench: " + a;
    // A single-valued flag: its value, refused when the flag was given before (it would override silently).
    auto value_once = [&] {
      const std::string v = next();
      seen.once(a, v);
      return v;
    };
    // One item of a list flag, refused when already in the list (it would run twice).
    auto list_item = [&](const std::vector<std::string>& list) {
      const std::string v = next();
      cli::SeenFlags::unique_item("sonicmoe-bench", a, list, v);
      return v;
    };
    if (a == "--config") o.configs.push_back(list_item(o.configs));
    else if (a == "--thiek") {
      o.have_thiek = true;
      o.thiek = parse_thiek(value_once());
    } else if (a == "--routing") {
      o.routing.push_back(list_item(o.routing));
      cli::parse_tool_routing(o.routing.back(), flag);
    } else if (a == "--backend") {
      const std::string v = value_once();
      o.backend = backend_name(cli::with_flag(flag, [&] { return parse_backend(v); }));
    } else if (a == "--dtype") {
      o.dtype = value_once();
      SONICMOE_CHECK(o.dtype == "bf16" || o.dtype == "f16" || o.dtype == "fp16" || o.dtype == "f32",
                     "sonicmoe-bench: --dtype '", o.dtype, "', expected bf16, f16 (fp16) or f32");
    } else if (a == "--activation") {
      const std::string v = value_once();
      o.act = cli::with_flag(flag, [&] { return parse_activation(v); });
    }
    else if (a == "--bias") o.bias = true;
    else if (a == "--iters") o.iters = static_cast<int>(cli::parse_int(value_once(), flag, 1, 1000000));
    else if (a == "--warmup") o.warmup = static_cast<int>(cli::parse_int(value_once(), flag, 0, 1000000));
    else if (a == "--no-check") o.check = false;
    else if (a == "--fp8-weight-grads") o.fp8_wgrad = true;
    else if (a == "--fp8-dgated") {
      const std::string v = value_once();
      o.fp8_dgated = cli::with_flag(flag, [&] { return parse_precision(v); });
      o.fp8_dgated_given = true;
    }
    else if (a == "--graph") o.graph = true;
    else if (a == "--configs-file") {
      o.config_file = value_once();
      SONICMOE_CHECK(!o.config_file.empty(), "sonicmoe-bench: --configs-file '': expected a file path");
      have_config_file = true;
    } else if (a == "--precision") {
      const std::string v = value_once();
      o.fp8 = cli::with_flag(flag, [&] { return parse_precision(v); }) == Precision::fp8_blockwise;
    }
    else if (a == "--router") {
      o.routers.push_back(list_item(o.routers));
      bench_router(o.routers.back(), 8, 1, nullptr);  // checks the name
    } else if (a == "--w1-layout") {
      const std::string v = value_once();
      o.w1_both = v == "both" || v == "all";
      o.w1_also.clear();
      if (v == "both") o.w1_also = {W1Layout::concatenated};
      if (v == "all") o.w1_also = {W1Layout::concatenated, W1Layout::separate};
      o.w1_layout = o.w1_both ? W1Layout::interleaved : cli::with_flag(flag, [&] { return parse_w1_layout(v); });
    }
    else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      usage();
      throw Error("sonicmoe-bench: unknown option '" + a + "'");
    }
  });
  const bool other = o.w1_both || o.w1_layout != W1Layout::interleaved;
  const char* which = o.w1_both ? (o.w1_also.size() > 1 ? "all" : "both")
                                : o.w1_layout == W1Layout::separate ? "separate" : "concat";
  SONICMOE_CHECK(!other || is_glu(o.act), "sonicmoe-bench: --w1-layout ", which,
                 " needs a GLU activation (", activation_name(o.act), " has no gate/up halves)");
  SONICMOE_CHECK(!o.fp8_wgrad || o.fp8, "sonicmoe-bench: --fp8-weight-grads needs --precision fp8");
  SONICMOE_CHECK(!o.fp8_dgated_given || o.fp8, "sonicmoe-bench: --fp8-dgated needs --precision fp8");
  SONICMOE_CHECK(!other || !o.fp8, "sonicmoe-bench: --w1-layout ", which,
                 " is not supported with --precision fp8");
  // Contradictions that used to be resolved by silently dropping one side.
  SONICMOE_CHECK(!have_config_file || !o.configs.empty(), "sonicmoe-bench: --configs-file ", o.config_file,
                 " is only read with --config NAME|all (name the configs to run; without --config the CPU backend "
                 "runs cpu-small and a GPU every config of the default file)");
  SONICMOE_CHECK(!(o.fp8 && (o.dtype == "f16" || o.dtype == "fp16")), "sonicmoe-bench: --dtype ", o.dtype,
                 " is not supported with --precision fp8 (the FP8 layer takes bf16 or f32 inputs)");
  bool variants = false;  // a router other than the default: each case runs as a default row and a variant row
  for (const auto& r : o.routers) variants = variants || r != "default";
  if (!variants) o.routers.clear();  // only the default router asked for: the plain rows
  SONICMOE_CHECK(!variants || !o.fp8, "sonicmoe-bench: --router ", o.routers.empty() ? "" : o.routers.back(),
                 " is not supported with --precision fp8 (the router rows run the bf16 layer only)");
  SONICMOE_CHECK(!variants || !o.w1_both, "sonicmoe-bench: --router ", o.routers.empty() ? "" : o.routers.back(),
                 " is not supported with --w1-layout ", which, " (the router rows run one W1 layout)");
  return o;
}

struct Inputs {
  Tensor x, router, w1, b1, w2, b2, d_out;
  // W1Layout::separate: w1 / b1 [E, 2I, ...] read as the gate and up halves of their memory ([2, E, I, ...]).
  MoEWeights weights(W1Layout layout = W1Layout::interleaved) const {
    MoEWeights w{router, w1, b1, w2, b2};
    if (layout != W1Layout::separate) return w;
    auto halves = [](const Tensor& t, TensorView& gate, TensorView& up) {
      if (!t.defined()) return;
      std::vector<std::int64_t> shape(t.view().shape.begin(), t.view().shape.begin() + t.ndim());
      shape[1] /= 2;
      char* base = static_cast<char*>(t.data());
      gate = TensorView(base, t.dtype(), shape, t.device());
      up = TensorView(base + t.nbytes() / 2, t.dtype(), shape, t.device());
    };
    halves(w1, w.w1, w.w1_up);
    halves(b1, w.b1, w.b1_up);
    return w;
  }
};

// Random inputs on `dev`. Small tensors are fully random; the big ones (billions of weight elements at the
// benchmark shapes) are random_tensor_on's windows into one random pool, which keeps set-up to a second.
Inputs make_inputs(const MoEConfig& cfg, std::int64_t T, DType dt, Device dev, unsigned seed) {
  std::mt19937 rng(seed);
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  Inputs in;
  in.x = random_tensor_on(dev, {T, H}, dt, 1.0f, rng);
  in.router = random_tensor_on(dev, {E, H}, dt, 1.0f / std::sqrt(float(H)), rng);
  in.w1 = random_tensor_on(dev, {E, ZW, H}, dt, 1.0f / std::sqrt(float(H)), rng);
  in.w2 = random_tensor_on(dev, {E, H, I}, dt, 1.0f / std::sqrt(float(I)), rng);
  if (cfg.add_bias) {
    in.b1 = random_tensor_on(dev, {E, ZW}, dt, 0.1f, rng);
    in.b2 = random_tensor_on(dev, {E, H}, dt, 0.1f, rng);
  }
  in.d_out = random_tensor_on(dev, {T, H}, dt, 1.0f, rng);
  return in;
}

// Bytes of make_inputs' tensors (x, d_out, the weights) and of random_tensor_on's pool, overflow-checked.
std::size_t input_bytes(const MoEConfig& cfg, std::int64_t T, DType dt) {
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
  std::int64_t n = checked_mul(2, checked_mul(T, H, "T*H"), "2*T*H (x, d_out)");
  n = checked_add(n, checked_mul(E, H, "E*H (router)"), "input elements");
  n = checked_add(n, checked_mul(E, checked_mul(ZW, H, "z_width*H"), "E*z_width*H (w1)"), "input elements");
  n = checked_add(n, checked_mul(E, checked_mul(H, I, "H*I"), "E*H*I (w2)"), "input elements");
  if (cfg.add_bias) n = checked_add(n, checked_mul(E, ZW + H, "E*(z_width+H) (biases)"), "input elements");
  n = checked_add(n, (std::int64_t{1} << 22) + (std::int64_t{1} << 20), "input elements");  // the random pool
  return static_cast<std::size_t>(checked_mul(n, static_cast<std::int64_t>(dtype_size(dt)), "input bytes"));
}

// Everything about a case that can be wrong before a byte is allocated: the routing name, the config and the
// layer's index limits (moe_memory_estimate checks both) and, on the cpu backend, inputs + one forward and backward
// against the host's available memory. Returns the layer's estimate in bytes.
std::size_t check_case(const BenchConfig& bc, const std::string& routing, const Options& o, Backend backend,
                       DType dt) {
  const std::string where = "sonicmoe-bench: config '" + bc.name + "' (routing " + routing + ")";
  MoEConfig cfg{bc.E, bc.K, bc.H, bc.I, o.act, o.bias};
  if (o.fp8) cfg.precision = Precision::fp8_blockwise;  // its shape rules too (H, I multiples of 128)
  cfg.dgated_precision = o.fp8_dgated;
  RoutingSpec spec;
  spec.mode = cli::parse_tool_routing(routing, where);
  spec.tile = bc.tile;
  for (const auto& r : o.routers)
    SONICMOE_CHECK(r == "default" || spec.mode == RoutingMode::topk, where, ": --router ", r,
                   " needs top-K routing (token rounding takes the default router)");
  try {
    std::size_t layer = moe_memory_estimate(cfg, bc.T, dt, spec, MemoryPass::forward_backward);
    if (o.fp8) {  // the bf16 layer runs too, and with --fp8-weight-grads the FP8 one with FP8 weight gradients
      MoEConfig b = cfg;
      b.precision = Precision::bf16;
      layer = std::max(layer, moe_memory_estimate(b, bc.T, dt, spec, MemoryPass::forward_backward));
      if (o.fp8_wgrad) {
        b.precision = b.weight_grad_precision = Precision::fp8_blockwise;
        layer = std::max(layer, moe_memory_estimate(b, bc.T, dt, spec, MemoryPass::forward_backward));
      }
    }
    if (backend == Backend::cpu) {
      const std::size_t need = layer + input_bytes(cfg, bc.T, dt);  // both < 2^63: the sum cannot wrap
      limits::check_host_memory("moe_forward + moe_backward", cfg, bc.T, need, "its inputs and one forward + backward");
    }
    return layer;
  } catch (const Error& e) {
    throw Error(where + ": " + e.what());  // which case of the list is at fault
  }
}

std::int64_t valid_pairs(const Routing& r) {
  Tensor off = r.meta.offsets.to(Device::cpu());
  return off.ptr<std::int32_t>()[r.meta.num_experts];
}

// Max relative error of the backend's output and gradients vs the CPU reference at a reduced shape.
double check_against_reference(const Context& ctx, MoEConfig cfg, const RoutingSpec& spec, DType dt) {
  cfg.hidden_size = std::min<std::int64_t>(cfg.hidden_size, 256);
  cfg.intermediate_size = std::min<std::int64_t>(cfg.intermediate_size, 128);
  const std::int64_t T = 300;  // not a multiple of 128
  Context cpu;
  Inputs dev_in = make_inputs(cfg, T, dt, ctx.device(), 7);
  Inputs ref_in = make_inputs(cfg, T, dt, Device::cpu(), 7);
  const W1Layout l = cfg.effective_w1_layout();
  ForwardResult f_dev = moe_forward(ctx, cfg, dev_in.x, dev_in.weights(l), spec);
  Gradients g_dev = moe_backward(ctx, dev_in.x, dev_in.weights(l), f_dev.saved, dev_in.d_out, 1.0f);
  synchronize(ctx);
  ForwardResult f_ref = moe_forward(cpu, cfg, ref_in.x, ref_in.weights(l), spec);
  Gradients g_ref = moe_backward(cpu, ref_in.x, ref_in.weights(l), f_ref.saved, ref_in.d_out, 1.0f);
  double worst = rel_error(f_dev.output.to(Device::cpu()), f_ref.output);
  for (auto [a, b] : {std::pair{&g_dev.dx, &g_ref.dx}, {&g_dev.dw1, &g_ref.dw1}, {&g_dev.dw2, &g_ref.dw2},
                      {&g_dev.drouter, &g_ref.drouter}})
    if (b->defined()) worst = std::max(worst, rel_error(a->to(Device::cpu()), *b));
  return worst;
}

// Out, dx, ds, dW1 and dW2 of one forward + backward, on the host (ds: the valid pairs only).
struct Results {
  Tensor t[5];
};
constexpr const char* kResultNames[5] = {"out", "dx", "ds", "dW1", "dW2"};

Results host_results(const ForwardResult& f, const Gradients& g, std::int64_t valid_pairs) {
  Results r;
  r.t[0] = f.output.to(Device::cpu());
  r.t[1] = g.dx.to(Device::cpu());
  r.t[2] = g.dscore.to(Device::cpu()).carve(0, {valid_pairs}, DType::f32);
  r.t[3] = g.dw1.to(Device::cpu());
  r.t[4] = g.dw2.to(Device::cpu());
  return r;
}

// Worst cosine and worst relative RMS error over the five results, and which result each is.
struct Precision5 {
  double min_cos = 1, max_rrms = 0;
  const char *cos_of = "", *rrms_of = "";
};
Precision5 compare_results(const Results& got, const Results& want) {
  Precision5 p;
  for (int i = 0; i < 5; ++i) {
    double ab = 0, aa = 0, bb = 0, dd = 0;
    const std::int64_t n = want.t[i].numel();  // billions of elements at the bench shapes: all host cores
#pragma omp parallel for reduction(+ : ab, aa, bb, dd) schedule(static)
    for (std::int64_t j = 0; j < n; ++j) {
      const double x = to_double(got.t[i], j), y = to_double(want.t[i], j);
      ab += x * y, aa += x * x, bb += y * y, dd += (x - y) * (x - y);
    }
    const double cos = aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : (aa == bb ? 1.0 : 0.0);
    const double rrms = bb > 0 ? std::sqrt(dd / bb) : std::sqrt(dd);
    if (!(cos >= p.min_cos)) p.min_cos = cos, p.cos_of = kResultNames[i];
    if (!(rrms <= p.max_rrms)) p.max_rrms = rrms, p.rrms_of = kResultNames[i];
  }
  return p;
}

struct Row {
  std::string name, routing;
  Precision precision = Precision::bf16;
  bool pre_quantised = false;  // fp8 with MoEWeights::fp8 made once before the timed calls
  bool fp8_wgrad = false;      // fp8 with FP8 weight gradients
  double quant_ms = -1;        // fp8: fp8_quantize_expert_weights alone (with the transposed copies the backward reads)
  int same_bits = -1;          // fp8pq: output and dx bitwise equal to the fp8 row's (1), or not (0)
  W1Layout w1_layout = W1Layout::interleaved;
  std::int64_t pairs = 0;
  double fwd_ms = 0, bwd_ms = 0, fwd_tf = 0, bwd_tf = 0, all_tf = 0;
  double fwd_peak_mib = 0, bwd_peak_mib = 0, saved_mib = 0, err = -1;
  bool have_precision = false;  // fp8 rows: against the bf16 row's results
  Precision5 vs_bf16;
  std::string error;
};

// A created CUDA stream (graph capture needs one), or the default stream when not wanted.
class OwnedStream {
 public:
  explicit OwnedStream(bool create) {
#ifdef SONICMOE_WITH_CUDA
    if (create) SONICMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
#else
    (void)create;
#endif
  }
  ~OwnedStream() {
#ifdef SONICMOE_WITH_CUDA
    if (s_) {
      cudaStreamSynchronize(s_);
      cudaStreamDestroy(s_);
    }
#endif
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  void* get() const { return s_; }

 private:
#ifdef SONICMOE_WITH_CUDA
  cudaStream_t s_ = nullptr;
#else
  void* s_ = nullptr;
#endif
};

// One case at one precision. keep: the bf16 run's results are stored there (for the fp8 row to compare with);
// against: the fp8 run's results are compared with them. pre_quantised (fp8): the weights are quantised once, before
// anything is measured, and passed as MoEWeights::fp8; bits: the fp8 row's output and dx are stored there (fp8,
// computing its own) or compared bitwise with it (fp8pq).
// w1_layout: MoEConfig::w1_layout of the case (the random W1 / b1 read in that layout).
Row run_case(const Options& o, const BenchConfig& bc, const std::string& routing, Backend backend, DType dt,
             Precision precision, Results* keep, const Results* against, W1Layout w1_layout,
             bool pre_quantised = false, Results* bits = nullptr, const std::string& router = "default",
             bool fp8_wgrad = false) {
  Row row;
  row.name = bc.name;
  row.routing = router == "default" ? routing : routing + "/" + router;
  row.precision = precision;
  row.pre_quantised = pre_quantised;
  row.fp8_wgrad = fp8_wgrad;
  row.w1_layout = w1_layout;
  OwnedStream stream(o.graph && backend == Backend::cuda);  // outlives every tensor below (freed on it)
  PeakAllocator alloc;
  Context ctx;
  ctx.backend = backend;
  ctx.allocator = &alloc;
  ctx.stream = stream.get();
  MoEConfig cfg{bc.E, bc.K, bc.H, bc.I, o.act, o.bias};
  cfg.precision = precision;
  if (fp8_wgrad) cfg.weight_grad_precision = Precision::fp8_blockwise;
  cfg.dgated_precision = o.fp8_dgated;
  cfg.w1_layout = w1_layout;
  RoutingSpec spec;
  spec.mode = parse_routing_mode(routing);  // checked by check_case before any case runs
  spec.tile = bc.tile;
  try {
    const double est_gib = moe_memory_estimate(cfg, bc.T, dt, spec) / (1024.0 * 1024.0 * 1024.0);
    std::fprintf(stderr, "[%s %s %s, W1 %s] preparing inputs (T=%lld H=%lld I=%lld E=%lld K=%lld; layer needs ~%.2f "
                 "GiB)\n", bc.name.c_str(), routing.c_str(), precision_name(precision), w1_layout_name(w1_layout),
                 (long long)bc.T, (long long)bc.H,
                 (long long)bc.I, (long long)bc.E, (long long)bc.K, est_gib);
    Inputs in = make_inputs(cfg, bc.T, dt, ctx.device(), 1);
    // deepseek-v3's selection bias: small values (the aux-loss-free update keeps the load near balance; a large
    // random bias would skew the experts' rows and time the imbalance, not the router)
    Tensor router_bias;
    if (router == "deepseek-v3") {
      std::mt19937 bias_rng(3);
      router_bias = random_tensor_on(ctx.device(), {bc.E}, DType::f32, 0.01f, bias_rng);
    }
    spec.router = bench_router(router, bc.E, bc.K, router_bias.defined() ? &router_bias : nullptr);
    Fp8ExpertWeights wq;
    MoEWeights weights = in.weights(cfg.effective_w1_layout());
    if (precision == Precision::fp8_blockwise) {
      auto quantise = [&] { return fp8_quantize_expert_weights(ctx, cfg, in.weights(), /*transposed=*/true); };
      if (pre_quantised) {
        wq = quantise();  // outside the peaks and timings, as a cache across micro-batches holds them
        weights.fp8 = &wq;
      } else {
        row.quant_ms = time_ms(ctx, o.warmup, o.iters, [&] { quantise(); });
      }
    }
    synchronize(ctx);
    const double mib = 1024.0 * 1024.0;
    // One forward and one backward with peak tracking (bytes beyond the inputs).
    alloc.reset_peak();
    std::size_t base = alloc.live();
    ForwardResult fr = moe_forward(ctx, cfg, in.x, weights, spec);
    synchronize(ctx);
    row.fwd_peak_mib = (alloc.peak() - base) / mib;
    row.saved_mib = saved_state_bytes(fr.saved) / mib;
    row.pairs = valid_pairs(fr.saved.routing);
    alloc.reset_peak();
    base = alloc.live();
    {
      Gradients g = moe_backward(ctx, in.x, weights, fr.saved, in.d_out, 1.0f);
      synchronize(ctx);
      row.bwd_peak_mib = (alloc.peak() - base) / mib;
      if (keep) *keep = host_results(fr, g, row.pairs);
      if (bits) {
        Tensor out = fr.output.to(Device::cpu()), dx = g.dx.to(Device::cpu());
        if (!pre_quantised) {
          bits->t[0] = out;
          bits->t[1] = dx;
        } else if (bits->t[0].defined()) {
          row.same_bits = out.nbytes() == bits->t[0].nbytes() && dx.nbytes() == bits->t[1].nbytes() &&
                          std::memcmp(out.data(), bits->t[0].data(), out.nbytes()) == 0 &&
                          std::memcmp(dx.data(), bits->t[1].data(), dx.nbytes()) == 0;
        }
      }
      if (against) {
        row.vs_bf16 = compare_results(host_results(fr, g, row.pairs), *against);
        row.have_precision = true;
      }
    }

    std::fprintf(stderr, "[%s %s] timing (%d warm-up, %d timed runs each)\n", bc.name.c_str(), routing.c_str(),
                 o.warmup, o.iters);
    auto fwd = [&] { moe_forward(ctx, cfg, in.x, weights, spec); };
    auto bwd = [&] { moe_backward(ctx, in.x, weights, fr.saved, in.d_out); };
    if (o.graph) {
#ifdef SONICMOE_WITH_CUDA
      row.fwd_ms = time_graph_ms(ctx, o.warmup, o.iters, fwd);
      row.bwd_ms = time_graph_ms(ctx, o.warmup, o.iters, bwd);
#endif
    } else {
      row.fwd_ms = time_ms(ctx, o.warmup, o.iters, fwd);
      row.bwd_ms = time_ms(ctx, o.warmup, o.iters, bwd);
    }
    const double fl = moe_forward_flops(cfg, row.pairs);
    row.fwd_tf = fl / (row.fwd_ms * 1e-3) / 1e12;
    row.bwd_tf = 2 * fl / (row.bwd_ms * 1e-3) / 1e12;
    row.all_tf = 3 * fl / ((row.fwd_ms + row.bwd_ms) * 1e-3) / 1e12;
    if (o.check && backend != Backend::cpu && !pre_quantised && router == "default") {
      std::fprintf(stderr, "[%s %s] checking against the CPU reference at T=300, H<=256, I<=128\n",
                   bc.name.c_str(), routing.c_str());
      row.err = check_against_reference(ctx, cfg, spec, dt);
      // bf16 / f16 storage on both sides: errors of a few 1e-3 are rounding; far above that is a bug.
      const double tol = is_16bit_float(dt) ? 5e-2 : 1e-3;
      if (!(row.err <= tol))
        row.error = "correctness check failed: max relative error " + std::to_string(row.err) + " > " +
                    std::to_string(tol);
    }
  } catch (const std::bad_alloc&) {
    row.error = "out of memory (std::bad_alloc)";
  } catch (const std::exception& e) {
    row.error = e.what();
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main([&] {
    Options o = parse(argc, argv);
    const bool gpu = devops::cuda_device_count() > 0;
    Backend backend = gpu ? Backend::cuda : Backend::cpu;
    if (!o.backend.empty()) {
      backend = parse_backend(o.backend);
      SONICMOE_CHECK(backend == Backend::cpu || gpu, "sonicmoe-bench: --backend cuda: ",
                     devops::cuda_compiled() ? "no CUDA device is visible" : "this build has no CUDA (nvcc not found at configure time)");
    }
    DType dt = backend == Backend::cuda ? DType::bf16 : DType::f32;
    if (!o.dtype.empty()) dt = parse_dtype(o.dtype);  // checked by parse()

    std::vector<BenchConfig> cases;
    if (o.have_thiek) cases.push_back(o.thiek);
    if (!o.configs.empty()) {
      auto all = load_bench_configs(o.config_file);
      for (const auto& name : o.configs) {
        bool found = false;
        for (const auto& c : all)
          if (name == "all" || c.name == name) {
            cases.push_back(c);
            found = true;
          }
        SONICMOE_CHECK(found, "sonicmoe-bench: no config named '", name, "' in ", o.config_file);
      }
      for (std::size_t i = 0; i < cases.size(); ++i)  // e.g. --config all --config NAME: it would run twice
        for (std::size_t j = 0; j < i; ++j)
          SONICMOE_CHECK(cases[i].name != cases[j].name || (o.have_thiek && j == 0), "sonicmoe-bench: config '",
                         cases[i].name, "' is selected twice (by --config all and --config ", cases[i].name, ")");
    }
    if (cases.empty()) {
      if (backend == Backend::cuda) cases = load_bench_configs(o.config_file);
      else cases.push_back(BenchConfig{"cpu-small", 512, 256, 128, 16, 4, {}, 128});
    }

    SONICMOE_CHECK(!o.graph || backend == Backend::cuda, "sonicmoe-bench: --graph needs the cuda backend");
    auto modes_of = [&](const BenchConfig& c) {
      std::vector<std::string> modes = o.routing.empty() ? c.routing : o.routing;
      if (modes.empty()) modes.push_back("topk");
      return modes;
    };
    for (const auto& c : cases)  // bad sizes fail here, with exit code 2, before any input is made
      for (const auto& m : modes_of(c)) check_case(c, m, o, backend, dt);
    std::printf("sonicmoe-bench: backend %s, dtype %s, activation %s%s, device %s, timing %s%s%s\n",
                backend_name(backend), dtype_name(dt), activation_name(o.act), o.bias ? ", bias" : "",
                gpu ? "cuda:0" : "cpu (no CUDA device visible)",
                o.graph ? "CUDA-graph replays" : "direct calls", o.fp8 ? ", precision bf16 and fp8_blockwise" : "",
                o.w1_both ? (o.w1_also.size() > 1 ? ", W1 interleaved, concatenated (+cat) and separate (+sep)"
                                                  : ", W1 interleaved and concatenated (+cat)")
                : o.w1_layout == W1Layout::concatenated ? ", W1 concatenated (+cat)"
                : o.w1_layout == W1Layout::separate     ? ", W1 separate (+sep)"
                                                        : "");
    int failures = 0;
    std::printf("\n%-18s %-17s %-8s %9s %9s %8s %9s %8s %8s %10s %10s %9s %9s%s%s\n", "config", "routing", "prec",
                "pairs", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s", "all TF/s", "fwd peak", "bwd peak", "saved",
                "max err", o.fp8 ? "  fp8 vs bf16: speedup fwd / bwd / all; quant ms; worst cosine, worst rel. RMS" : "",
                o.w1_both ? "  +cat / +sep vs interleaved: speed fwd / bwd / all"
                : o.routers.empty() ? "" : "  router variant vs the default row above it: speed fwd / bwd / all");
    std::fflush(stdout);
    auto print_row = [&](const Row& r, const Row* bf) {
      // the 16-bit layer's rows by their storage type (bf16, f16; f32 on the cpu backend), the FP8 ones by recipe
      const char* base = r.precision == Precision::bf16 ? dtype_name(dt)
                         : r.fp8_wgrad                 ? "fp8pq+w8"
                         : r.pre_quantised             ? "fp8pq"
                                                       : "fp8";
      const std::string prec = std::string(base) + (r.w1_layout == W1Layout::concatenated ? "+cat"
                                                    : r.w1_layout == W1Layout::separate   ? "+sep"
                                                                                          : "");
      if (!r.error.empty()) {
        ++failures;
        std::printf("%-18s %-17s %-8s  FAILED: %s\n", r.name.c_str(), r.routing.c_str(), prec.c_str(),
                    r.error.c_str());
        std::fflush(stdout);
        return;
      }
      char err[32];
      if (r.err < 0) std::snprintf(err, sizeof err, "n/a");
      else std::snprintf(err, sizeof err, "%.2e", r.err);
      std::printf("%-18s %-17s %-8s %9lld %9.3f %8.1f %9.3f %8.1f %8.1f %7.1fMiB %7.1fMiB %6.1fMiB %9s",
                  r.name.c_str(), r.routing.c_str(), prec.c_str(), (long long)r.pairs, r.fwd_ms, r.fwd_tf, r.bwd_ms,
                  r.bwd_tf,
                  r.all_tf, r.fwd_peak_mib, r.bwd_peak_mib, r.saved_mib, err);
      if (bf && bf->error.empty())
        std::printf("  x%.2f / x%.2f / x%.2f", bf->fwd_ms / r.fwd_ms, bf->bwd_ms / r.bwd_ms,
                    (bf->fwd_ms + bf->bwd_ms) / (r.fwd_ms + r.bwd_ms));
      if (r.quant_ms >= 0) std::printf("; quant %.3f", r.quant_ms);
      if (r.same_bits >= 0) std::printf("; %s", r.same_bits ? "fp8's bits" : "BITS DIFFER FROM fp8");
      if (r.same_bits == 0) ++failures;
      if (r.have_precision) {
        const bool pass = r.vs_bf16.min_cos >= 0.997 && r.vs_bf16.max_rrms < 0.076;
        std::printf("  cos %.5f (%s)  rrms %.2f%% (%s)%s", r.vs_bf16.min_cos, r.vs_bf16.cos_of,
                    100 * r.vs_bf16.max_rrms, r.vs_bf16.rrms_of, pass ? "" : "  GATE MISSED");
      }
      std::printf("\n");
      std::fflush(stdout);
    };
    for (const auto& c : cases) {
      for (const auto& m : modes_of(c)) {
        for (const auto& r : o.routers) {  // router variants (top-K), relative to the default router's row
          if (r == "default") continue;
          const Row base = run_case(o, c, m, backend, dt, Precision::bf16, nullptr, nullptr, o.w1_layout);
          print_row(base, nullptr);
          print_row(run_case(o, c, m, backend, dt, Precision::bf16, nullptr, nullptr, o.w1_layout, false, nullptr, r),
                    &base);
        }
        if (!o.routers.empty()) continue;
        Results bf_results;  // each row is printed as soon as it is measured
        const Row bf = run_case(o, c, m, backend, dt, Precision::bf16, o.fp8 ? &bf_results : nullptr, nullptr,
                                o.w1_layout);
        print_row(bf, nullptr);
        for (W1Layout l : o.w1_also) {  // the same case in another W1 layout, its speed relative to interleaved
          const Row other = run_case(o, c, m, backend, dt, Precision::bf16, nullptr, nullptr, l);
          print_row(other, &bf);
        }
        if (!o.fp8) continue;
        Results bits;  // the fp8 row's output and dx, for the fp8pq row
        const Row f8 = run_case(o, c, m, backend, dt, Precision::fp8_blockwise, nullptr,
                                bf.error.empty() ? &bf_results : nullptr, W1Layout::interleaved, false, &bits);
        print_row(f8, &bf);
        const Row pq =
            run_case(o, c, m, backend, dt, Precision::fp8_blockwise, nullptr, nullptr, W1Layout::interleaved, true,
                     &bits);
        print_row(pq, &bf);
        if (o.fp8_wgrad)  // pre-quantised weights, FP8 weight gradients: its precision against the bf16 layer
          print_row(run_case(o, c, m, backend, dt, Precision::fp8_blockwise, nullptr,
                             bf.error.empty() ? &bf_results : nullptr, W1Layout::interleaved, true, nullptr, "default",
                             true),
                    &bf);
      }
    }
    std::printf("\nTF/s: expert GEMM FLOPs (forward 2*N*H*(z_width+I), backward twice that) over wall time, the same "
                "FLOPs for both precisions; peaks are bytes allocated by sonicmoe beyond the inputs; saved: the "
                "forward's state%s.\n",
                o.fp8 ? "; fp8 precision: against the bf16 layer on the same inputs, at full size.\nfp8: the weights "
                        "quantised in every forward (with their transposed copies, kept in the saved state and reused "
                        "by the backward: a training step of one micro-batch); fp8pq: pre-quantised weights "
                        "(MoEWeights::fp8, made once outside the timing and the peaks: the steady state of gradient "
                        "accumulation); quant: fp8_quantize_expert_weights of W1 and W2 with the transposed copies the backward reads, alone, in ms; fp8pq+w8: fp8pq with FP8 weight "
                        "gradients"
                      : "");
    return failures ? 1 : 0;
  });
}

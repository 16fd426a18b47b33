// Trains a small MoE layer (student) to imitate a fixed random MoE layer (teacher) on random inputs, with
// Adam on the mean squared error, using only the public API: moe_forward + moe_backward.
//   train_moe [--steps N>=1] [--backend cpu|cuda] [--activation NAME] [--routing topk|round-nearest|...]
//             [--dtype f32|bf16] [--precision bf16|fp8] [--size T,H,I,E,K]
// --dtype: the tensors' storage (default f32 on the cpu backend, bf16 on cuda, which takes bf16 only); the
// optimiser keeps f32 master weights on the host either way. --precision fp8 trains an FP8 blockwise student
// beside a bf16 one, from the same initial weights on the same batches (the teacher is bf16), and reports the
// relative gap between their losses at every step (H and I must be multiples of 128: the default size then is
// 512,256,128,8,2). Bad arguments print "error: ..." and exit with code 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli.h"  // tools/cli.h: integer parsing and the "error: ..." exit path shared with sonicmoe-bench
#include "sonicmoe/detail/host_util.h"  // checked_mul / checked_add, the host-memory guard
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"

using namespace sonicmoe;

namespace {

// Host f32 values <-> a tensor of `dt` (f32 or bf16) on `dev`.
Tensor upload(const std::vector<float>& v, const std::vector<std::int64_t>& shape, DType dt, Device dev) {
  Tensor t = Tensor::empty(shape, dt);
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::bf16) t.ptr<bf16>()[i] = float_to_bf16(v[i]);
    else t.ptr<float>()[i] = v[i];
  }
  return t.to(dev);
}
std::vector<float> download(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  std::vector<float> v(h.numel());
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = h.dtype() == DType::bf16 ? bf16_to_float(h.ptr<bf16>()[i]) : h.ptr<float>()[i];
  return v;
}

// A weight: f32 master values and Adam moments on the host, the layer's copy (storage dtype) on the device.
struct Param {
  std::vector<std::int64_t> shape;
  std::vector<float> w, m, v;
  Tensor value;
};

// Adam step on the host copies (an example, not a fast optimiser), then the device copy refreshed.
void adam(Param& p, const Tensor& grad, int step, float lr, DType dt, Device dev) {
  const std::vector<float> g = download(grad);
  if (p.m.empty()) p.m.assign(p.w.size(), 0.0f), p.v.assign(p.w.size(), 0.0f);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const float c1 = 1.0f - std::pow(b1, step), c2 = 1.0f - std::pow(b2, step);
  for (std::size_t i = 0; i < p.w.size(); ++i) {
    p.m[i] = b1 * p.m[i] + (1 - b1) * g[i];
    p.v[i] = b2 * p.v[i] + (1 - b2) * g[i] * g[i];
    p.w[i] -= lr * (p.m[i] / c1) / (std::sqrt(p.v[i] / c2) + eps);
  }
  p.value = upload(p.w, p.shape, dt, dev);
}

struct Student {
  MoEConfig cfg;
  std::vector<Param> params;  // router, w1, b1, w2, b2
  double first = 0, last = 0, loss = 0;
  MoEWeights weights() const {
    return MoEWeights{params[0].value, params[1].value, params[2].value, params[3].value, params[4].value};
  }
};

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main([&] {
    int steps = 300;
    Context ctx;
    MoEConfig cfg{8, 2, 32, 16, Activation::swiglu, true};
    RoutingSpec spec;
    std::string dtype_arg;
    bool fp8 = false, have_size = false;
    std::int64_t T = 256;
    cli::SeenFlags seen("train_moe");
    cli::for_each_option(argc, argv, "train_moe", [&](const std::string& a, auto next_value) {
      // At least one step: the loss report divides by the last step's loss.
      const std::string flag = "train_moe: " + a;
      // Every flag takes one value: a repeated flag would override the first silently.
      auto next = [&] {
        const std::string v = next_value();
        seen.once(a, v);
        return v;
      };
      if (a == "--steps") {
        steps = static_cast<int>(cli::parse_int(next(), flag, 1, 1000000000));
      } else if (a == "--backend") {
        const std::string v = next();
        ctx.backend = cli::with_flag(flag, [&] { return parse_backend(v); });
      } else if (a == "--activation") {
        const std::string v = next();
        cfg.activation = cli::with_flag(flag, [&] { return parse_activation(v); });
      } else if (a == "--routing") {
        spec.mode = cli::parse_tool_routing(next(), flag);
        spec.tile = 16;
      } else if (a == "--dtype") {
        dtype_arg = next();
        if (dtype_arg != "f32" && dtype_arg != "bf16")
          throw Error(flag + ": '" + dtype_arg + "' is not a storage dtype (f32 or bf16)");
      } else if (a == "--precision") {
        const std::string v = next();
        fp8 = cli::with_flag(flag, [&] { return parse_precision(v); }) == Precision::fp8_blockwise;
      } else if (a == "--size") {
        const std::vector<std::string> items = cli::split_commas(next());
        SONICMOE_CHECK(items.size() == 5, flag, " expects T,H,I,E,K (5 integers)");
        const char* names[5] = {"T", "H", "I", "E", "K"};
        std::int64_t v[5];
        for (int i = 0; i < 5; ++i) v[i] = cli::parse_int(items[i], flag + " " + names[i], 1, 1 << 20);
        T = v[0], cfg.hidden_size = v[1], cfg.intermediate_size = v[2], cfg.num_experts = v[3], cfg.top_k = v[4];
        have_size = true;
      } else throw Error("train_moe: unknown option '" + a + "' (use --steps, --backend, --activation, --routing, "
                         "--dtype, --precision, --size)");
    });
    SONICMOE_CHECK(ctx.backend == Backend::cpu || cuda_backend_available(),
                   "train_moe: --backend cuda, but this build has no CUDA or no CUDA device is visible");
    if (fp8 && !have_size) T = 512, cfg.hidden_size = 256, cfg.intermediate_size = 128;
    const DType dt = dtype_arg.empty() ? (ctx.backend == Backend::cuda ? DType::bf16 : DType::f32)
                                       : (dtype_arg == "bf16" ? DType::bf16 : DType::f32);
    const Device dev = ctx.device();
    // Before anything is allocated: the config (K <= E, FP8's multiples of 128, ...) and, on the host, everything this
    // example holds against the available memory (each size may be up to 2^20, so their products can be terabytes).
    {
      MoEConfig c = cfg;
      if (fp8) c.precision = Precision::fp8_blockwise;
      const int models = fp8 ? 2 : 1;  // students; the teacher runs forwards only
      std::size_t layer = moe_memory_estimate(c, T, dt, spec, MemoryPass::forward_backward);
      if (fp8) {
        c.precision = Precision::bf16;
        layer = std::max(layer, moe_memory_estimate(c, T, dt, spec, MemoryPass::forward_backward));
      }
      const std::int64_t E0 = c.num_experts, H0 = c.hidden_size, I0 = c.intermediate_size, ZW0 = c.z_width();
      std::int64_t params = checked_add(checked_mul(E0, checked_mul(ZW0, H0 + 1, "z_width*(H+1)"), "E*z_width*(H+1)"),
                                        checked_mul(E0, checked_mul(H0, I0 + 2, "H*(I+2)"), "E*H*(I+2)"),
                                        "parameters");
      const std::int64_t ds = static_cast<std::int64_t>(dtype_size(dt));
      // teacher: f32 master + stored copy; each student: f32 master, Adam's m and v, stored copy, gradient, and the
      // f32 download/upload copies of the optimiser step; per step x, d_out, target and output (f32 and stored).
      const std::int64_t per_param = checked_add(4 + ds, checked_mul(models, 20 + 2 * ds, "bytes per parameter"),
                                                 "bytes per parameter");
      std::int64_t need = checked_mul(params, per_param, "parameter bytes");
      need = checked_add(need, checked_mul(checked_mul(T, H0, "T*H"), 16 + 3 * ds, "activation bytes"), "bytes");
      need = checked_add(need, checked_mul(static_cast<std::int64_t>(layer), models + 1, "layer bytes"), "bytes");
      if (ctx.backend == Backend::cpu)
        limits::check_host_memory("train_moe", c, T, static_cast<std::size_t>(need),
                                  "the teacher, the students, their Adam state and one step");
    }
    const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size, ZW = cfg.z_width();
    std::mt19937 rng(2024);

    auto randn = [&](std::int64_t n, float stddev) {
      std::vector<float> v(n);
      std::normal_distribution<float> nd(0.0f, stddev);
      for (float& x : v) x = nd(rng);
      return v;
    };
    auto make_weights = [&] {
      const std::vector<std::vector<std::int64_t>> shapes = {{E, H}, {E, ZW, H}, {E, ZW}, {E, H, I}, {E, H}};
      const float scales[5] = {1.0f / std::sqrt(float(H)), 1.0f / std::sqrt(float(H)), 0.1f,
                               1.0f / std::sqrt(float(I)), 0.1f};
      std::vector<Param> p(5);
      for (int i = 0; i < 5; ++i) {
        std::int64_t n = 1;
        for (std::int64_t d : shapes[i]) n *= d;
        p[i].shape = shapes[i];
        p[i].w = randn(n, scales[i]);
        p[i].value = upload(p[i].w, p[i].shape, dt, dev);
      }
      return p;
    };
    Student teacher{cfg, make_weights()};
    std::vector<Student> students{{cfg, make_weights()}};
    if (fp8) {  // the same initial weights, trained in FP8
      students.push_back(students[0]);
      students[1].cfg.precision = Precision::fp8_blockwise;
    }

    std::printf("train_moe: T=%lld H=%lld I=%lld E=%lld K=%lld %s, routing %s, backend %s, %s storage, %d steps of "
                "Adam%s\n", (long long)T, (long long)H, (long long)I, (long long)E, (long long)cfg.top_k,
                activation_name(cfg.activation), routing_mode_name(spec.mode), backend_name(ctx.backend),
                dtype_name(dt), steps, fp8 ? ", a bf16 and an FP8 blockwise student" : "");
    double worst_gap = 0;
    int worst_step = 0;
    for (int step = 1; step <= steps; ++step) {
      const Tensor x = upload(randn(T * H, 1.0f), {T, H}, dt, dev);
      const std::vector<float> target = download(moe_forward(ctx, cfg, x, teacher.weights(), spec).output);
      for (Student& s : students) {
        ForwardResult fr = moe_forward(ctx, s.cfg, x, s.weights(), spec);
        const std::vector<float> out = download(fr.output);
        std::vector<float> d_out(out.size());
        double loss = 0;
        for (std::size_t i = 0; i < out.size(); ++i) {
          const double diff = double(out[i]) - target[i];
          loss += diff * diff;
          d_out[i] = static_cast<float>(2.0 * diff / double(out.size()));
        }
        s.loss = loss / double(out.size());
        Gradients g = moe_backward(ctx, x, s.weights(), fr.saved, upload(d_out, {T, H}, dt, dev), 1e-2f);
        const Tensor* grads[] = {&g.drouter, &g.dw1, &g.db1, &g.dw2, &g.db2};
        for (int i = 0; i < 5; ++i) adam(s.params[i], *grads[i], step, 3e-3f, dt, dev);
        if (step == 1) s.first = s.loss;
        s.last = s.loss;
      }
      const double gap = fp8 ? std::fabs(students[1].loss - students[0].loss) / students[0].loss : 0.0;
      if (gap > worst_gap) worst_gap = gap, worst_step = step;
      if (step == 1 || step % 25 == 0 || step == steps) {
        if (fp8)
          std::printf("step %4d/%d  mse bf16 %.6f  fp8 %.6f  gap %.2f%%\n", step, steps, students[0].loss,
                      students[1].loss, 100.0 * gap);
        else
          std::printf("step %4d/%d  mse %.6f\n", step, steps, students[0].loss);
        std::fflush(stdout);
      }
    }
    bool learned = true;
    for (const Student& s : students) {
      char ratio[64];  // a zero loss (e.g. token rounding that routed no pair at this size) has no ratio: not "-nan"
      if (s.last > 0) std::snprintf(ratio, sizeof ratio, "%.1fx lower", s.first / s.last);
      else std::snprintf(ratio, sizeof ratio, "%s", s.first > 0 ? "now zero" : "zero throughout: nothing to learn");
      std::printf("%s%smse went from %.6f to %.6f (%s)\n", fp8 ? precision_name(s.cfg.precision) : "",
                  fp8 ? ": " : "", s.first, s.last, ratio);
      learned = learned && s.last < s.first;
    }
    if (fp8)
      std::printf("fp8 vs bf16 loss: largest relative gap %.2f%% (step %d), at the last step %.2f%%\n",
                  100.0 * worst_gap, worst_step, 100.0 * std::fabs(students[1].last - students[0].last) /
                                                     students[0].last);
    return learned ? 0 : 1;
  });
}

// Trains a small MoE layer (student) to imitate a fixed random MoE layer (teacher) on random inputs, with
// Adam on the mean squared error, using only the public API: moe_forward + moe_backward.
//   train_moe [--steps N>=1] [--backend cpu|cuda] [--activation NAME] [--routing topk|round-nearest|...]
// Bad arguments print "error: ..." and exit with code 2.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli.h"  // tools/cli.h: integer parsing and the "error: ..." exit path shared with sonicmoe-bench
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"

using namespace sonicmoe;

namespace {

struct Param {
  const char* name;
  Tensor value;  // on the context's device
  std::vector<float> m, v;
};

Tensor randn(const std::vector<std::int64_t>& shape, float stddev, std::mt19937& rng, Device dev) {
  Tensor t = Tensor::empty(shape, DType::f32);
  std::normal_distribution<float> nd(0.0f, stddev);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = nd(rng);
  return t.to(dev);
}

// Adam step on host copies (an example, not a fast optimiser).
void adam(Param& p, const Tensor& grad, int step, float lr) {
  Tensor w = p.value.to(Device::cpu());
  Tensor g = grad.to(Device::cpu());
  if (p.m.empty()) p.m.assign(w.numel(), 0.0f), p.v.assign(w.numel(), 0.0f);
  const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const float c1 = 1.0f - std::pow(b1, step), c2 = 1.0f - std::pow(b2, step);
  for (std::int64_t i = 0; i < w.numel(); ++i) {
    const float gi = g.ptr<float>()[i];
    p.m[i] = b1 * p.m[i] + (1 - b1) * gi;
    p.v[i] = b2 * p.v[i] + (1 - b2) * gi * gi;
    w.ptr<float>()[i] -= lr * (p.m[i] / c1) / (std::sqrt(p.v[i] / c2) + eps);
  }
  copy(p.value, w);
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main([&] {
    int steps = 300;
    Context ctx;
    MoEConfig cfg{8, 2, 32, 16, Activation::swiglu, true};
    RoutingSpec spec;
    cli::for_each_option(argc, argv, "train_moe", [&](const std::string& a, auto next) {
      // At least one step: the loss report divides by the last step's loss.
      const std::string flag = "train_moe: " + a;
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
      } else throw Error("train_moe: unknown option '" + a + "' (use --steps, --backend, --activation, --routing)");
    });
    SONICMOE_CHECK(ctx.backend == Backend::cpu || cuda_backend_available(),
                   "train_moe: --backend cuda, but this build has no CUDA or no CUDA device is visible");
    const Device dev = ctx.device();
    const std::int64_t T = 256, E = cfg.num_experts, H = cfg.hidden_size, I = cfg.intermediate_size;
    const std::int64_t ZW = cfg.z_width();
    std::mt19937 rng(2024);

    auto make_weights = [&](float scale) {
      return std::vector<Param>{{"router", randn({E, H}, scale / std::sqrt(float(H)), rng, dev), {}, {}},
                                {"w1", randn({E, ZW, H}, scale / std::sqrt(float(H)), rng, dev), {}, {}},
                                {"b1", randn({E, ZW}, 0.1f * scale, rng, dev), {}, {}},
                                {"w2", randn({E, H, I}, scale / std::sqrt(float(I)), rng, dev), {}, {}},
                                {"b2", randn({E, H}, 0.1f * scale, rng, dev), {}, {}}};
    };
    auto as_weights = [](const std::vector<Param>& p) {
      return MoEWeights{p[0].value, p[1].value, p[2].value, p[3].value, p[4].value};
    };
    std::vector<Param> teacher = make_weights(1.0f), student = make_weights(1.0f);

    std::printf("train_moe: T=%lld H=%lld I=%lld E=%lld K=%lld %s, routing %s, backend %s, %d steps of Adam\n",
                (long long)T, (long long)H, (long long)I, (long long)E, (long long)cfg.top_k,
                activation_name(cfg.activation), routing_mode_name(spec.mode), backend_name(ctx.backend), steps);
    double first = 0, last = 0;
    for (int step = 1; step <= steps; ++step) {
      Tensor x = randn({T, H}, 1.0f, rng, dev);
      Tensor target = moe_forward(ctx, cfg, x, as_weights(teacher), spec).output.to(Device::cpu());
      ForwardResult fr = moe_forward(ctx, cfg, x, as_weights(student), spec);
      Tensor out = fr.output.to(Device::cpu());
      Tensor d_out = Tensor::empty({T, H}, DType::f32);
      double loss = 0;
      for (std::int64_t i = 0; i < out.numel(); ++i) {
        const double diff = double(out.ptr<float>()[i]) - target.ptr<float>()[i];
        loss += diff * diff;
        d_out.ptr<float>()[i] = static_cast<float>(2.0 * diff / double(out.numel()));
      }
      loss /= double(out.numel());
      Gradients g = moe_backward(ctx, x, as_weights(student), fr.saved, d_out.to(dev), 1e-2f);
      const Tensor* grads[] = {&g.drouter, &g.dw1, &g.db1, &g.dw2, &g.db2};
      for (int i = 0; i < 5; ++i) adam(student[i], *grads[i], step, 3e-3f);
      if (step == 1) first = loss;
      last = loss;
      if (step == 1 || step % 25 == 0 || step == steps) {
        const float aux = fr.aux_loss.to(Device::cpu()).ptr<float>()[0];
        std::printf("step %4d/%d  mse %.6f  aux %.4f\n", step, steps, loss, aux);
        std::fflush(stdout);
      }
    }
    std::printf("mse went from %.6f to %.6f (%.1fx lower)\n", first, last, first / last);
    return last < first ? 0 : 1;
  });
}

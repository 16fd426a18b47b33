#include <algorithm>
#include <atomic>
#include <cctype>

#include "core/device_ops.h"
#include "sonicmoe/error.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/types.h"

namespace sonicmoe {

namespace {
std::atomic<int> g_gemm_sm_margin{0};
}  // namespace

void set_gemm_sm_margin(int sms) {
  SONICMOE_CHECK(sms >= 0, "sonicmoe::set_gemm_sm_margin: argument 'sms' = ", sms, ", expected >= 0");
  g_gemm_sm_margin.store(sms, std::memory_order_relaxed);
}

int gemm_sm_margin() { return g_gemm_sm_margin.load(std::memory_order_relaxed); }

const char* dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::i32: return "int32";
    case DType::f8e4m3: return "f8e4m3";
    case DType::f16: return "f16";
  }
  return "?";
}

std::string device_name(Device d) {
  return d.type == DeviceType::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

const char* backend_name(Backend b) { return b == Backend::cpu ? "cpu" : "cuda"; }

Backend parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  throw Error("parse_backend: unknown backend '" + name + "', expected one of cpu, cuda");
}

namespace {
constexpr const char* kActNames[kNumActivations] = {"swiglu", "geglu", "reglu",      "gelu",     "relu",
                                                    "silu",   "relu_sq", "geglu_tanh", "gelu_tanh"};
std::string normalise(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return c == '-' ? '_' : std::tolower(c); });
  return s;
}
}  // namespace

const char* activation_name(Activation a) {
  int i = static_cast<int>(a);
  return i >= 0 && i < kNumActivations ? kActNames[i] : "?";
}

Activation parse_activation(const std::string& name) {
  std::string n = normalise(name);
  for (int i = 0; i < kNumActivations; ++i)
    if (n == kActNames[i]) return static_cast<Activation>(i);
  if (n == "relu2" || n == "squared_relu") return Activation::relu_sq;
  if (n == "gelu_pytorch_tanh" || n == "gelu_new" || n == "gelu_fast") return Activation::gelu_tanh;
  if (n == "geglu_pytorch_tanh") return Activation::geglu_tanh;
  throw Error("parse_activation: unknown activation '" + name +
              "', expected one of swiglu, geglu, reglu, gelu, relu, silu, relu_sq, geglu_tanh, gelu_tanh");
}

DType parse_dtype(const std::string& name) {
  std::string n = normalise(name);
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "f16" || n == "fp16" || n == "half" || n == "float16") return DType::f16;
  if (n == "f32" || n == "fp32" || n == "float" || n == "float32") return DType::f32;
  throw Error("parse_dtype: unknown dtype '" + name + "', expected one of bf16, f16 (fp16), f32");
}

const char* routing_mode_name(RoutingMode m) {
  switch (m) {
    case RoutingMode::topk: return "topk";
    case RoutingMode::general: return "general";
    case RoutingMode::round_down: return "round-down";
    case RoutingMode::round_up: return "round-up";
    case RoutingMode::round_nearest: return "round-nearest";
  }
  return "?";
}

RoutingMode parse_routing_mode(const std::string& name) {
  std::string n = normalise(name);
  if (n == "topk" || n == "top_k") return RoutingMode::topk;
  if (n == "general") return RoutingMode::general;
  if (n == "round_down") return RoutingMode::round_down;
  if (n == "round_up") return RoutingMode::round_up;
  if (n == "round_nearest" || n == "round") return RoutingMode::round_nearest;
  throw Error("parse_routing_mode: unknown routing '" + name +
              "', expected one of topk, general, round-down, round-up, round-nearest");
}

const char* precision_name(Precision p) {
  if (p == Precision::bf16) return "bf16";
  return p == Precision::fp8_blockwise ? "fp8_blockwise" : "?";
}

Precision parse_precision(const std::string& name) {
  std::string n = normalise(name);
  if (n == "bf16") return Precision::bf16;
  if (n == "fp8" || n == "fp8_blockwise") return Precision::fp8_blockwise;
  throw Error("parse_precision: unknown precision '" + name + "', expected one of bf16, fp8, fp8_blockwise");
}

const char* w1_layout_name(W1Layout l) {
  if (l == W1Layout::interleaved) return "interleaved";
  if (l == W1Layout::concatenated) return "concatenated";
  return l == W1Layout::separate ? "separate" : "?";
}

W1Layout parse_w1_layout(const std::string& name) {
  std::string n = normalise(name);
  if (n == "interleaved") return W1Layout::interleaved;
  if (n == "concatenated" || n == "concat") return W1Layout::concatenated;
  if (n == "separate") return W1Layout::separate;
  throw Error("parse_w1_layout: unknown W1 layout '" + name +
              "', expected one of interleaved, concatenated, concat, separate");
}

bool cuda_backend_available() { return devops::cuda_compiled() && devops::cuda_device_count() > 0; }

}  // namespace sonicmoe

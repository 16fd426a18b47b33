// Basic enums of the public API: element types, devices, backends, activations, routing modes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace sonicmoe {

// f8e4m3: FP8 e4m3 (OCP "E4M3FN": bias 7, no infinities, 0x7f / 0xff are NaN, largest finite 448), one byte;
// the storage of quantised operands (docs/ALGORITHM.md, "FP8 blockwise recipe"). f16: IEEE half (largest finite
// 65504; larger values round to inf, as in PyTorch). The 16-bit layer runs in bf16 or f16 storage, fp32 accumulation.
enum class DType : int { bf16 = 0, f32 = 1, i32 = 2, f8e4m3 = 3, f16 = 4 };

inline std::size_t dtype_size(DType t) {
  return t == DType::bf16 || t == DType::f16 ? 2 : t == DType::f8e4m3 ? 1 : 4;
}
// bf16 or f16: the storage types of the 16-bit layer.
constexpr bool is_16bit_float(DType t) { return t == DType::bf16 || t == DType::f16; }
const char* dtype_name(DType t);  // "bf16", "f16", "f32", "int32", "f8e4m3"
// "bf16", "f16" / "fp16" / "half", "f32" / "fp32" / "float"; throws Error naming the accepted values.
DType parse_dtype(const std::string& name);

enum class DeviceType : int { cpu = 0, cuda = 1 };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; ignored for cpu
  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device& o) const {
    return type == o.type && (type == DeviceType::cpu || index == o.index);
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_name(Device d);

// Which implementation runs a call. `cpu` is the reference backend (fp32 accumulation, OpenMP);
// `cuda` runs the Hopper kernels (only when the library was built with CUDA).
enum class Backend : int { cpu = 0, cuda = 1 };
const char* backend_name(Backend b);
Backend parse_backend(const std::string& name);  // "cpu" or "cuda"; throws Error naming the accepted values
bool cuda_backend_available();  // built with CUDA and a device is visible

// DESIGN.md section 1. GLU kinds read W1 rows interleaved (gate at 2j, up at 2j+1). gelu / geglu: the exact (erf)
// GELU; gelu_tanh / geglu_tanh: its tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (PyTorch's
// approximate="tanh", Hugging Face's gelu_pytorch_tanh, the original SonicMoE kernels' GELU).
enum class Activation : int { swiglu = 0, geglu, reglu, gelu, relu, silu, relu_sq, geglu_tanh, gelu_tanh };
constexpr int kNumActivations = 9;
constexpr bool is_glu(Activation a) {
  return a == Activation::swiglu || a == Activation::geglu || a == Activation::reglu || a == Activation::geglu_tanh;
}
const char* activation_name(Activation a);
// Parses the names above (also the original's spellings "swiglu", "relu_sq", ..., and the tanh GELU's other names:
// "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "geglu_pytorch_tanh"); throws Error.
Activation parse_activation(const std::string& name);

// How W1's 2I rows of a GLU activation hold gate and up (DESIGN.md section 2, "Other W1 layouts"). interleaved: gate_j
// at row 2j, up_j at row 2j + 1 (this library's layout, the kernels' own order). concatenated: [gate_0 .. gate_{I-1},
// up_0 .. up_{I-1}] (the original SonicMoE's concat_layout=True, Hugging Face, Megatron). separate: gate [E, I, H] and
// up [E, I, H] in two tensors (torchtitan's w1 / w3; MoEWeights::w1 and w1_up), which the stages see as one
// [2, E, I, H] view whose part stride is up - gate (w1_separate_view, sonicmoe/moe.h). b1 and the gradients dW1 /
// db1 follow the same layout. Plain activations have no gate/up halves: every layout names the same tensor.
enum class W1Layout : int { interleaved = 0, concatenated = 1, separate = 2 };
const char* w1_layout_name(W1Layout l);
// "interleaved", "concatenated" / "concat", "separate"; throws Error
W1Layout parse_w1_layout(const std::string& name);

// How the weight-gradient stages (weight_grad_w1 / weight_grad_w2, sonicmoe/stages.h) write dW. store: dW in the
// layer's dtype, overwritten. accumulate: dW += the gradient into an f32 tensor (a framework's fp32 main_grad:
// gradient-accumulation fusion), the fp32 sum never rounded to 16 bits; deterministic.
enum class GradWrite : int { store = 0, accumulate = 1 };

// DESIGN.md section 4.
enum class RoutingMode : int { topk = 0, general, round_down, round_up, round_nearest };
constexpr bool is_token_rounding(RoutingMode m) {
  return m == RoutingMode::round_down || m == RoutingMode::round_up || m == RoutingMode::round_nearest;
}
const char* routing_mode_name(RoutingMode m);
RoutingMode parse_routing_mode(const std::string& name);  // "topk", "general", "round-up", ...

// Arithmetic of the expert GEMMs. bf16: bf16 operands. fp8_blockwise: e4m3 operands with fp32 scales per 1x128
// (activations) and 128x128 (weights) blocks (docs/ALGORITHM.md, "FP8 blockwise recipe"; MoEConfig::precision).
enum class Precision : int { bf16 = 0, fp8_blockwise = 1 };
const char* precision_name(Precision p);
Precision parse_precision(const std::string& name);  // "bf16", "fp8" / "fp8_blockwise"; throws Error

// bfloat16 storage type for host code; round-to-nearest-even like the GPU's cvt.rn.bf16.f32.
struct bf16 {
  std::uint16_t bits = 0;
};
inline float bf16_to_float(bf16 v) {
  std::uint32_t u = static_cast<std::uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  bf16 r;
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {  // NaN stays NaN
    r.bits = static_cast<std::uint16_t>((u >> 16) | 0x0040u);
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  r.bits = static_cast<std::uint16_t>(u >> 16);
  return r;
}
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// IEEE half storage type for host code; round-to-nearest-even like the GPU's cvt.rn.f16.f32 (subnormals kept,
// |f| >= 65520 to inf, NaN stays NaN).
struct f16 {
  std::uint16_t bits = 0;
};
inline float f16_to_float(f16 v) {
  const std::uint32_t sign = static_cast<std::uint32_t>(v.bits & 0x8000u) << 16;
  const std::uint32_t e = (v.bits >> 10) & 0x1fu, m = v.bits & 0x3ffu;
  std::uint32_t u;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  if (e == 31) u = sign | 0x7f800000u | (m << 13);
  else u = sign | ((e + 112u) << 23) | (m << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline f16 float_to_f16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  f16 r;
  if (a >= 0x7f800000u) {  // inf, or NaN (kept quiet)
    r.bits = static_cast<std::uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
  } else if (a >= 0x477ff000u) {  // >= 65520: rounds past 65504
    r.bits = static_cast<std::uint16_t>(sign | 0x7c00u);
  } else if (a >= 0x38800000u) {  // normal: rebias the exponent, round the 13 dropped bits to nearest even
    std::uint32_t b = a - 0x38000000u;
    b += 0xfffu + ((b >> 13) & 1u);
    r.bits = static_cast<std::uint16_t>(sign | (b >> 13));
  } else {  // subnormal (or zero): m = a * 2^24 rounded to nearest even, by the integer mantissa
    const std::uint32_t e = a >> 23;  // < 113
    if (e < 102) {                     // below 2^-25: rounds to zero
      r.bits = static_cast<std::uint16_t>(sign);
    } else {
      const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;  // value = mant * 2^(e-150)
      std::uint32_t q = mant >> shift;
      const std::uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (q & 1u))) ++q;
      r.bits = static_cast<std::uint16_t>(sign | q);
    }
  }
  return r;
}
inline float round_to_f16(float f) { return f16_to_float(float_to_f16(f)); }

}  // namespace sonicmoe

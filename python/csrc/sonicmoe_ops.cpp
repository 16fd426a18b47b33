// PyTorch binding of sonicmoe: the ops registered with TORCH_LIBRARY(sonicmoe, m).
//
//   sonicmoe::forward  -> (output, aux_loss, <the saved state>)
//   sonicmoe::backward (..., <the saved state>, ...) -> (dx, dw1, db1, dw2, db2, drouter, dscore)
//   sonicmoe::backward_act (the same arguments, dw2_in_part1) -> (dx, drouter, dscore, dz, a_s, dw2, db2), then
//   sonicmoe::backward_weights (..., <the saved state>, dz, a_s, ...) -> (dw1, db1, dw2, db2): the backward in two
//     parts (the expert-parallel layer sends dx back while the weight gradients run; bitwise the same results)
//   backward, backward_weights (and backward_act for its dw2) take optional fp32 w1_main_grad / w2_main_grad last
//     (backward also router_main_grad): the weight-gradient GEMMs add dW1 / dW2 (dWr) into them
//     (MoEWeights::w1_main_grad) and return dw1 / dw2 (drouter) empty
//   sonicmoe::inference -> output (dropped_out, optional: gets the pairs a capacity factor dropped)
//   sonicmoe::gather_sum (rows, rev, token_offsets) -> each token's rows summed (the aggregation stage alone)
//   sonicmoe::topk (logits, k) -> ids, scores, counts (the top-K selection stage alone)
//   sonicmoe::fp8_quantize_weights (w1, w2, activation, transposed) -> the 8 tensors of sonicmoe::Fp8ExpertWeights
//
// forward, inference and backward take, under precision "fp8", optional pre-quantised weights as their last argument
// (fp8_weights: fp8_quantize_weights' 8 tensors, in its order; sonicmoe::MoEWeights::fp8): then the forward
// quantises nothing and keeps no quantised weights in its state, and the backward reads them again. Without them the
// training forward quantises W1 and W2 once, W1 with its transposed copy, and returns that copy as state (w1_t_fp8,
// w1_t_scale) for the backward (the dgated GEMM runs on bf16 operands: no W2^T).
//
// The saved state (z, or z_fp8 / z_scale under precision fp8, and the routing) is listed once, in SONICMOE_PY_STATE
// below: the schema strings, the forward's
// outputs, the backward's arguments and the Python fake kernels (sonicmoe_cpp/_ops.py, through _C.state_fields())
// all come from it. Under fp8 without pre-quantised weights the state also holds the forward's quantised W1^T.
//
// Torch tensors are wrapped as non-owning sonicmoe::TensorView after checking dtype, device and contiguity
// (messages name the argument). Every buffer the library allocates comes from torch's allocator (the CUDA
// caching allocator on the current stream, or the CPU allocator) through TorchAllocator, and the returned
// sonicmoe::Tensor objects become torch tensors without a copy (from_blob with a deleter that holds them).
// State tensors that do not exist for a routing mode or precision are returned as empty 1-D tensors of size 0.
// forward, inference and backward end with the layer's precision ("bf16", or "fp8": MoEConfig::precision
// fp8_blockwise), its W1 layout ("interleaved", "concat": MoEConfig::w1_layout concatenated, or "separate": w1 / b1
// the gate, w1_up / b1_up the up tensors, dw1 / db1 returned [2, E, I, H] / [2, E, I]), fp8_weights, w1_up and b1_up;
// the two-part backward (backward_act / backward_weights) is bf16 and interleaved only.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sonicmoe/dispatched.h"
#include "sonicmoe/error.h"
#include "sonicmoe/expert_rows.h"
#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"
#include "sonicmoe/stages.h"

#if defined(SONICMOE_WITH_CUDA) && SONICMOE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define SONICMOE_PY_CUDA 1
#else
#define SONICMOE_PY_CUDA 0
#endif

// The saved state of sonicmoe::forward (its outputs after output and aux_loss) and of sonicmoe::backward (its
// arguments after routing), in order: X(name, dtype, shape, present, member of sonicmoe::SavedState). The FP8 Z comes
// last, so that the positions of the others do not depend on the precision.
//   dtype: input (x's dtype), f32, i32, f8 (torch.float8_e4m3fn).
//   shape: comma-separated dims over T, E, K (top_k), N (pairs), H, I, ZW (z_width), and HB, IB, ZB (H, I, z_width
//          / 128), each optionally "+1"; read by the fake (meta) kernels, the real shapes come from the library.
//   present: the routing modes that have it: always, routed (all but general: the router's outputs), paired (all
//          but topk, whose pair expert/score are the top-K arrays reshaped), rounding (token rounding); or the
//          precision that has it: bf16 (Z in x's dtype), fp8 (Z quantised 1x128: codes and scales), fp8_own (fp8
//          without pre-quantised weights: the forward's quantised W1^T), fp8_own_w2 (the same for W2^T, made only for
//          a dgated GEMM on FP8 operands: never under the binding's MoEConfig, whose dgated_precision is the default,
//          bf16); capacity (top-K under a capacity factor). Otherwise the tensor is an empty 1-D tensor of its dtype.
#define SONICMOE_PY_STATE(X)                                                 \
  X(z, input, "N,ZW", bf16, z)                                               \
  X(logits, f32, "T,E", routed, routing.logits)                              \
  X(topk_expert, i32, "T,K", routed, routing.topk_expert)                    \
  X(topk_score, f32, "T,K", routed, routing.topk_score)                      \
  X(pair_token, i32, "N", always, routing.pair_token)                        \
  X(pair_expert, i32, "N", paired, routing.pair_expert)                      \
  X(pair_score, f32, "N", paired, routing.pair_score)                        \
  X(pair_slot, i32, "N", rounding, routing.pair_slot)                        \
  X(counts, i32, "E", always, routing.meta.counts)                           \
  X(offsets, i32, "E+1", always, routing.meta.offsets)                       \
  X(pair, i32, "N", always, routing.meta.pair)                               \
  X(gather, i32, "N", always, routing.meta.gather)                           \
  X(rev, i32, "N", always, routing.meta.rev)                                 \
  X(token_offsets, i32, "T+1", always, routing.meta.token_offsets)           \
  X(z_fp8, f8, "N,ZW", fp8, z_fp8)                                           \
  X(z_scale, f32, "N,ZB", fp8, z_scale)                                      \
  X(demand, i32, "E", capacity, routing.meta.demand)                         \
  X(dropped, i32, "1", capacity, routing.meta.dropped)                       \
  X(w1_t_fp8, f8, "E,H,ZW", fp8_own, w1_t_fp8)                               \
  X(w1_t_scale, f32, "E,HB,ZB", fp8_own, w1_t_scale)                         \
  X(w2_t_fp8, f8, "E,I,H", fp8_own_w2, w2_t_fp8)                             \
  X(w2_t_scale, f32, "E,IB,HB", fp8_own_w2, w2_t_scale)

// Schema fragments: ", Tensor z, Tensor logits, ..." (forward returns) and "Tensor z, Tensor logits, ..., " (backward
// arguments).
#define SONICMOE_PY_STATE_RETURN(name, dtype, shape, present, member) ", Tensor " #name
#define SONICMOE_PY_STATE_ARG(name, dtype, shape, present, member) "Tensor " #name ", "

namespace sonicmoe_py {

using sonicmoe::DType;

enum class StateDType { input, f32, i32, f8 };
// capacity: top-K routing under a capacity_factor (an empty tensor otherwise, also in the backward's arguments).
// fp8_own: precision fp8 and no pre-quantised weights given (the forward's quantised transposed weights); fp8_own_w2:
// the same where the backward reads W2^T (sonicmoe::fp8_backward_reads_w2_t of the binding's config: never).
enum class Present { always, routed, paired, rounding, bf16, fp8, capacity, fp8_own, fp8_own_w2 };

struct StateField {
  const char* name;
  StateDType dtype;
  const char* shape;
  Present present;
};

#define SONICMOE_PY_STATE_FIELD(name, dtype, shape, present, member) \
  StateField{#name, StateDType::dtype, shape, Present::present},
constexpr StateField kStateFields[] = {SONICMOE_PY_STATE(SONICMOE_PY_STATE_FIELD)};
#undef SONICMOE_PY_STATE_FIELD
constexpr std::size_t kNumState = sizeof(kStateFields) / sizeof(kStateFields[0]);

bool present_in(Present p, sonicmoe::RoutingMode mode, sonicmoe::Precision precision, bool capacity,
                bool fp8_pre_quantised) {
  switch (p) {
    case Present::fp8_own: return precision == sonicmoe::Precision::fp8_blockwise && !fp8_pre_quantised;
    case Present::fp8_own_w2:
      return present_in(Present::fp8_own, mode, precision, capacity, fp8_pre_quantised) &&
             sonicmoe::MoEConfig{}.dgated_precision == sonicmoe::Precision::fp8_blockwise;
    case Present::capacity: return capacity && mode == sonicmoe::RoutingMode::topk;
    case Present::routed: return mode != sonicmoe::RoutingMode::general;
    case Present::paired: return mode != sonicmoe::RoutingMode::topk;
    case Present::rounding: return sonicmoe::is_token_rounding(mode);
    case Present::bf16: return precision == sonicmoe::Precision::bf16;
    case Present::fp8: return precision == sonicmoe::Precision::fp8_blockwise;
    default: return true;
  }
}

// The last N tensors an op remembered, each with a value: an entry matches a tensor of the same storage, address and
// version. The storage is held weakly: once it is freed the entry matches nothing, so a new tensor that the allocator
// places at the same address (with the same version number) is not taken for it. Undefined, empty and inference
// tensors (no version) are neither remembered nor found.
template <class V, std::size_t N = 256>
class TensorRegistry {
 public:
  void remember(const at::Tensor& t, V value) {
    if (!trackable(t)) return;
    std::lock_guard<std::mutex> lock(mu_);
    entries_[next_++ % N] = {t.storage().getWeakStorageImpl(), t.data_ptr(), static_cast<int64_t>(t._version()),
                             std::move(value)};
  }
  std::optional<V> find(const at::Tensor& t) const {
    if (!trackable(t)) return std::nullopt;
    const void* ptr = t.data_ptr();
    const int64_t version = static_cast<int64_t>(t._version());
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : entries_) {
      if (!e.storage || e.ptr != ptr || e.version != version) continue;
      const c10::intrusive_ptr<c10::StorageImpl> alive = e.storage->lock();
      if (alive && alive.get() == storage) return e.value;
    }
    return std::nullopt;
  }

 private:
  static bool trackable(const at::Tensor& t) { return t.defined() && t.numel() > 0 && !t.is_inference(); }
  struct Entry {
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    const void* ptr = nullptr;
    int64_t version = -1;
    V value{};
  };
  mutable std::mutex mu_;
  std::array<Entry, N> entries_;
  std::size_t next_ = 0;
};

// consume_z: a backward writes dZ over the saved z (under fp8: dZ's codes over z_fp8 / z_scale, on the GPU). A later
// backward given the same z (same storage, same address, same version) would read dZ as Z and return wrong gradients
// silently: the ops bump z's (z_fp8's) version when they consume it and remember the last consumed ones, and a
// backward that validates its state (validate_state=True: state from outside the autograd path) refuses such a z.
TensorRegistry<bool> g_consumed;

void mark_consumed(const at::Tensor& z) {
  if (!z.defined() || z.numel() == 0 || z.is_inference()) return;
  z.unsafeGetTensorImpl()->bump_version();
  g_consumed.remember(z, true);
}

bool was_consumed(const at::Tensor& z) { return g_consumed.find(z).has_value(); }

// A raw backward (validate_state=True: state handed in from outside the autograd path) must run the forward's own
// layer: another activation, top-K, routing mode, precision, W1 layout or router would return wrong gradients with no
// error (the state does not hold them). The forward ops remember, per returned state, what they ran, keyed by the
// state's pair_token tensor (as consumed z's are); a raw backward given a state found there refuses arguments that
// differ, naming them. A state from elsewhere (another process, a copy) is not found and not checked.
[[noreturn]] void fail(const std::string& msg);

struct ForwardSig {
  sonicmoe::Activation act{};
  int64_t top_k = 0;
  sonicmoe::RoutingMode mode{};
  sonicmoe::Precision precision{};
  sonicmoe::W1Layout w1_layout{};
  sonicmoe::RouterSpec router;  // top-K: the fields the backward takes (score function, softmax_over_topk, norm, scale)
};
TensorRegistry<ForwardSig> g_forward_sigs;

void remember_forward(const at::Tensor& key, const sonicmoe::MoEConfig& cfg, sonicmoe::RoutingMode mode,
                      const sonicmoe::RouterSpec& router) {
  ForwardSig sig{cfg.activation, cfg.top_k, mode, cfg.precision, cfg.effective_w1_layout(), router};
  sig.router.e_score_correction_bias = sonicmoe::TensorView();  // (selection only: not the backward's)
  g_forward_sigs.remember(key, std::move(sig));
}

// Throws naming the first argument of a raw backward that differs from the forward that made its state (when that
// forward is remembered).
void check_against_forward(const char* fn, const at::Tensor& key, const sonicmoe::MoEConfig& cfg,
                           sonicmoe::RoutingMode mode, const sonicmoe::RouterSpec& router) {
  const std::optional<ForwardSig> found = g_forward_sigs.find(key);
  if (!found) return;
  const ForwardSig& f = *found;
  auto differ = [&](const char* arg, const std::string& got, const std::string& want) {
    if (got != want)
      fail(std::string("sonicmoe_cpp.") + fn + ": argument '" + arg + "' is " + got + " but the forward that made "
           "this saved state ran " + want + " (pass the forward's own arguments)");
  };
  differ("routing", sonicmoe::routing_mode_name(mode), sonicmoe::routing_mode_name(f.mode));
  differ("activation", sonicmoe::activation_name(cfg.activation), sonicmoe::activation_name(f.act));
  differ("precision", sonicmoe::precision_name(cfg.precision), sonicmoe::precision_name(f.precision));
  differ("w1_layout", sonicmoe::w1_layout_name(cfg.effective_w1_layout()), sonicmoe::w1_layout_name(f.w1_layout));
  if (mode == sonicmoe::RoutingMode::general) return;
  differ("top_k", std::to_string(cfg.top_k), std::to_string(f.top_k));
  if (mode != sonicmoe::RoutingMode::topk) return;
  const sonicmoe::RouterSpec& a = router;
  const sonicmoe::RouterSpec& b = f.router;
  differ("scoring_func", a.score_function == sonicmoe::ScoreFunction::sigmoid ? "sigmoid" : "softmax",
         b.score_function == sonicmoe::ScoreFunction::sigmoid ? "sigmoid" : "softmax");
  differ("softmax_over_topk", a.softmax_over_topk ? "True" : "False", b.softmax_over_topk ? "True" : "False");
  differ("norm_topk_probs", a.norm_topk_probs ? "True" : "False", b.norm_topk_probs ? "True" : "False");
  if (a.routed_scaling_factor != b.routed_scaling_factor)
    differ("routed_scaling_factor", std::to_string(a.routed_scaling_factor), std::to_string(b.routed_scaling_factor));
}

// The index of the state tensor `name` in kStateFields.
std::size_t state_index(const char* name) {
  for (std::size_t i = 0; i < kNumState; ++i)
    if (std::string(kStateFields[i].name) == name) return i;
  return kNumState;
}

// Rows [offsets[E], N) of a per-pair-row tensor [N, ...] hold no pair under a capacity (the dropped pairs): the library
// leaves them unwritten. They are zeroed before the tensor leaves an op, so that no output holds uninitialised memory
// (device ops, no host read; a pass over the whole tensor, so only where such rows exist: token rounding sizes N by
// offsets[E] on both backends).
void zero_rows_past(const at::Tensor& t, const at::Tensor& offsets) {
  if (!t.defined() || t.dim() < 1 || t.numel() == 0 || offsets.numel() == 0) return;
  const at::Tensor end = offsets.select(0, offsets.size(0) - 1).to(at::kLong);
  const at::Tensor rows = at::arange(t.size(0), offsets.options().dtype(at::kLong));
  std::vector<int64_t> mshape(static_cast<std::size_t>(t.dim()), 1);
  mshape[0] = t.size(0);
  const at::Tensor past = rows.ge(end).view(mshape);
  // fp8 has no masked_fill: its zero is the zero byte
  (t.scalar_type() == at::kFloat8_e4m3fn ? t.view(at::kByte) : t).masked_fill_(past, 0);
}

const char* dtype_name(StateDType d) {
  switch (d) {
    case StateDType::f32: return "f32";
    case StateDType::i32: return "i32";
    case StateDType::f8: return "f8";
    default: return "input";
  }
}

// ---------------------------------------------------------------------------------------------------
// Allocators

// Memory for sonicmoe comes from torch: each allocation is a uint8 torch tensor kept in a table until the
// library frees it, so torch.cuda.max_memory_allocated() and the caching allocator see everything.
class TorchAllocator final : public sonicmoe::Allocator {
 public:
  void* allocate(std::size_t bytes, sonicmoe::Device device, void* /*stream*/) override {
    if (bytes == 0) return nullptr;
    at::TensorOptions opt = at::TensorOptions().dtype(at::kByte);
    if (device.is_cuda()) opt = opt.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device.index)));
    at::Tensor t = at::empty({static_cast<int64_t>(bytes)}, opt);
    void* p = t.data_ptr();
    std::lock_guard<std::mutex> lock(mu_);
    live_.emplace(p, std::move(t));
    return p;
  }
  void deallocate(void* ptr, std::size_t, sonicmoe::Device, void*) override {
    if (!ptr) return;
    at::Tensor t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return;
      t = std::move(it->second);
      live_.erase(it);
    }
    // t released here, outside the lock (the caching allocator records the stream of the block).
  }

 private:
  std::mutex mu_;
  std::unordered_map<void*, at::Tensor> live_;
};

TorchAllocator& torch_allocator() {
  static TorchAllocator* a = new TorchAllocator();  // never destroyed: tensors may outlive static teardown
  return *a;
}

// Makes an owning-looking sonicmoe::Tensor over memory torch owns (the saved state passed to backward):
// allocate() hands out the pointer set just before, deallocate() does nothing. The caller keeps the torch
// tensor alive for as long as the sonicmoe::Tensor is used.
class BorrowAllocator final : public sonicmoe::Allocator {
 public:
  void* allocate(std::size_t, sonicmoe::Device, void*) override { return next(); }
  void deallocate(void*, std::size_t, sonicmoe::Device, void*) override {}
  static void*& next() {
    thread_local void* p = nullptr;
    return p;
  }
};
BorrowAllocator& borrow_allocator() {
  static BorrowAllocator* a = new BorrowAllocator();
  return *a;
}

// ---------------------------------------------------------------------------------------------------
// Conversions

[[noreturn]] void fail(const std::string& msg) { throw sonicmoe::Error(msg); }

// "[a, b, c]" without iostreams: on the H100 machine's torch build, ostream code instantiated in this extension
// (c10::str included) crashes the process (cuda-gdb: inside std::ostream::_M_insert<long>).
std::string sizes_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

DType to_dtype(const at::Tensor& t, const char* fn, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kFloat: return DType::f32;
    case at::kInt: return DType::i32;
    default:
      fail(std::string("sonicmoe_cpp.") + fn + ": argument '" + name + "' has dtype " +
           std::string(c10::toString(t.scalar_type())) + ", expected bfloat16, float16, float32 or int32");
  }
}

sonicmoe::Device to_device(const at::Device& d) {
  return d.is_cuda() ? sonicmoe::Device::cuda(d.index() < 0 ? 0 : d.index()) : sonicmoe::Device::cpu();
}

at::ScalarType to_scalar(DType d) {
  switch (d) {
    case DType::bf16: return at::kBFloat16;
    case DType::f16: return at::kHalf;
    case DType::f32: return at::kFloat;
    case DType::f8e4m3: return at::kFloat8_e4m3fn;
    default: return at::kInt;
  }
}

// The library's dtype of a torch tensor whose dtype the caller has checked (bf16, f16, f32, i32 or float8_e4m3fn).
DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kFloat: return DType::f32;
    case at::kFloat8_e4m3fn: return DType::f8e4m3;
    default: return DType::i32;
  }
}

at::ScalarType state_scalar(StateDType d, at::ScalarType input) {
  switch (d) {
    case StateDType::f32: return at::kFloat;
    case StateDType::i32: return at::kInt;
    case StateDType::f8: return at::kFloat8_e4m3fn;
    default: return input;
  }
}

// "bf16", "fp8" (also "fp8_blockwise") or "fp8_wgrad": the layer's MoEConfig::precision ("fp8_wgrad": fp8_blockwise
// with weight_grad_precision fp8_blockwise too, weight_grad_precision_of).
sonicmoe::Precision parse_precision_arg(const char* fn, const std::string& precision) {
  if (precision == "bf16") return sonicmoe::Precision::bf16;
  if (precision == "fp8" || precision == "fp8_blockwise" || precision == "fp8_wgrad")
    return sonicmoe::Precision::fp8_blockwise;
  fail(std::string("sonicmoe_cpp.") + fn + ": argument 'precision' is '" + precision +
       "', expected 'bf16', 'fp8' or 'fp8_wgrad'");
}
// MoEConfig::weight_grad_precision of a precision argument parse_precision_arg accepted.
sonicmoe::Precision weight_grad_precision_of(const std::string& precision) {
  return precision == "fp8_wgrad" ? sonicmoe::Precision::fp8_blockwise : sonicmoe::Precision::bf16;
}

// "interleaved", "concat" / "concatenated" or "separate": the layer's MoEConfig::w1_layout (W1 / b1 rows, and the
// gradients dW1 / db1, as [gate; up] halves, or as gate tensors w1 / b1 with the up tensors w1_up / b1_up; read and
// written by the kernels without a copy).
sonicmoe::W1Layout parse_w1_layout_arg(const char* fn, const std::string& w1_layout) {
  if (w1_layout == "interleaved") return sonicmoe::W1Layout::interleaved;
  if (w1_layout == "concat" || w1_layout == "concatenated") return sonicmoe::W1Layout::concatenated;
  if (w1_layout == "separate") return sonicmoe::W1Layout::separate;
  fail(std::string("sonicmoe_cpp.") + fn + ": argument 'w1_layout' is '" + w1_layout +
       "', expected 'interleaved', 'concat' or 'separate'");
}

// Boundary checks: defined, dtype, device (same as x), contiguity.
struct Checker {
  const char* fn;
  at::Device device;

  // (the messages are built only on failure: every call checks some 30 tensors)
  void check(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> dtypes) const {
    auto where = [&] { return std::string("sonicmoe_cpp.") + fn + ": argument '" + name + "'"; };
    if (!t.defined()) fail(where() + " is required but was not given");
    bool ok = false;
    for (auto s : dtypes) ok = ok || t.scalar_type() == s;
    if (!ok) {
      std::string names;
      for (auto s : dtypes) names += (names.empty() ? "" : " or ") + std::string(c10::toString(s));
      fail(where() + " has dtype " + std::string(c10::toString(t.scalar_type())) + ", expected " + names);
    }
    if (t.device() != device)
      fail(where() + " is on " + t.device().str() + " but 'x' is on " + device.str() +
           "; all tensors must be on one device");
    if (t.device().type() != at::kCPU && t.device().type() != at::kCUDA)
      fail(where() + " is on " + t.device().str() + ", expected a cpu or cuda tensor");
    if (!t.is_contiguous()) fail(where() + " is not contiguous; call .contiguous() first");
  }
  void check_opt(const c10::optional<at::Tensor>& t, const char* name,
                 std::initializer_list<at::ScalarType> dtypes) const {
    if (t.has_value() && t->defined()) check(*t, name, dtypes);
  }
  // The experts' weights and optional biases, all of dtype dt (x's).
  void check_expert_weights(at::ScalarType dt, const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
                            const at::Tensor& w2, const c10::optional<at::Tensor>& b2) const {
    check(w1, "w1", {dt});
    check(w2, "w2", {dt});
    check_opt(b1, "b1", {dt});
    check_opt(b2, "b2", {dt});
  }

  // The checker of an entry whose tensors must all be on the device of its leading tensor t (argument `name`),
  // after checking t itself: given, bf16, f16 or f32, contiguous.
  static Checker of_leading(const char* fn, const at::Tensor& t, const char* name) {
    if (!t.defined()) fail(std::string("sonicmoe_cpp.") + fn + ": argument '" + name + "' is required");
    Checker c{fn, t.device()};
    c.check(t, name, {at::kBFloat16, at::kHalf, at::kFloat});
    return c;
  }
};

sonicmoe::TensorView view_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  if (shape.empty()) shape.push_back(1);  // 0-d -> [1]
  return sonicmoe::TensorView(t.data_ptr(), dtype_of(t), shape, to_device(t.device()));
}
sonicmoe::TensorView view_of(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined()) ? view_of(*t) : sonicmoe::TensorView();
}

// A torch tensor over a sonicmoe::Tensor's memory (no copy); the deleter keeps the Tensor alive.
at::Tensor to_torch(const sonicmoe::Tensor& t, const at::Device& device) {
  if (!t.defined()) return at::empty({0}, at::TensorOptions().dtype(at::kInt).device(device));
  std::vector<int64_t> shape(t.view().shape.begin(), t.view().shape.begin() + t.ndim());
  auto opt = at::TensorOptions().dtype(to_scalar(t.dtype())).device(device);
  if (t.numel() == 0 || t.data() == nullptr) return at::empty(shape, opt);
  auto* keep = new sonicmoe::Tensor(t);
  // target_device: the memory's device is known (without it, from_blob asks the driver for each tensor:
  // cudaPointerGetAttributes, host time on every call).
  return at::for_blob(t.data(), shape)
      .deleter([keep](void*) { delete keep; })
      .options(opt)
      .target_device(device)
      .make_tensor();
}

// A sonicmoe::Tensor over a torch tensor's memory (borrowed).
sonicmoe::Tensor borrow(const at::Tensor& t) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  if (shape.empty()) shape.push_back(1);
  BorrowAllocator::next() = t.data_ptr();
  sonicmoe::Tensor r = sonicmoe::Tensor::empty(shape, dtype_of(t), to_device(t.device()), &borrow_allocator(), nullptr);
  BorrowAllocator::next() = nullptr;
  return r;
}

sonicmoe::Context make_context(const at::Device& device) {
  sonicmoe::Context ctx;
  ctx.allocator = &torch_allocator();
  if (device.is_cuda()) {
#if SONICMOE_PY_CUDA
    ctx.backend = sonicmoe::Backend::cuda;
    ctx.device_index = device.index() < 0 ? 0 : device.index();
    ctx.stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(ctx.device_index).stream());
#else
    fail("sonicmoe_cpp: the tensors are on " + device.str() +
         " but sonicmoe was built without CUDA (rebuild with nvcc on PATH, SONICMOE_CUDA=1)");
#endif
  }
  return ctx;
}

sonicmoe::RoutingMode parse_mode(const std::string& routing) {
  if (routing == "topk") return sonicmoe::RoutingMode::topk;
  if (routing == "general") return sonicmoe::RoutingMode::general;
  if (routing == "round_down" || routing == "round-down" || routing == "down") return sonicmoe::RoutingMode::round_down;
  if (routing == "round_up" || routing == "round-up" || routing == "up") return sonicmoe::RoutingMode::round_up;
  if (routing == "round_nearest" || routing == "round-nearest" || routing == "nearest")
    return sonicmoe::RoutingMode::round_nearest;
  fail("sonicmoe_cpp: argument 'routing' is '" + routing +
       "', expected one of topk, general, round_down, round_up, round_nearest");
}

// The ops' router arguments (Hugging Face names) but the bias tensor.
struct RouterArgs {
  const std::string& scoring_func;
  bool softmax_over_topk, norm_topk_probs;
  int64_t n_group, topk_group;
  double routed_scaling_factor;
  double capacity_factor = 0.0;
};

// RouterArgs as a sonicmoe::RouterSpec (the library validates the values; this names a bad scoring_func).
sonicmoe::RouterSpec make_router(const char* fn, const RouterArgs& a) {
  const std::string& scoring_func = a.scoring_func;
  sonicmoe::RouterSpec r;
  if (scoring_func == "softmax") {
    r.score_function = sonicmoe::ScoreFunction::softmax;
  } else if (scoring_func == "sigmoid") {
    r.score_function = sonicmoe::ScoreFunction::sigmoid;
  } else {
    fail(std::string("sonicmoe_cpp.") + fn + ": argument 'scoring_func' is '" + scoring_func +
         "', expected 'softmax' or 'sigmoid'");
  }
  r.softmax_over_topk = a.softmax_over_topk;
  r.norm_topk_probs = a.norm_topk_probs;
  r.n_group = a.n_group;
  r.topk_group = a.topk_group;
  r.routed_scaling_factor = static_cast<float>(a.routed_scaling_factor);
  r.capacity_factor = a.capacity_factor;
  return r;
}

sonicmoe::MoEConfig make_config(const char* fn, const at::Tensor& w1, const at::Tensor& w2,
                                const c10::optional<at::Tensor>& b1, const std::string& activation, int64_t top_k,
                                sonicmoe::RoutingMode mode, bool separate = false) {
  const bool glu_act = sonicmoe::is_glu(sonicmoe::parse_activation(activation));
  // w1_layout separate (GLU): w1 is the gate [E, I, H]
  const int64_t zw = separate && glu_act ? 2 * w1.size(1) : w1.size(1), I = w2.size(2);
  if (zw != (glu_act ? 2 * I : I) || w1.size(0) != w2.size(0) || w1.size(2) != w2.size(1))
    fail(std::string("sonicmoe_cpp.") + fn + ": arguments 'w1' " + sizes_str(w1) + " and 'w2' " +
         sizes_str(w2) + " disagree: expected w1 [E, " + (glu_act ? "2*I" : "I") +
         ", H] and w2 [E, H, I] for activation '" + activation + "'");
  sonicmoe::MoEConfig cfg;
  cfg.activation = sonicmoe::parse_activation(activation);
  cfg.num_experts = w2.size(0);
  cfg.hidden_size = w2.size(1);
  cfg.intermediate_size = w2.size(2);
  cfg.top_k = mode == sonicmoe::RoutingMode::general ? 1 : top_k;
  cfg.add_bias = b1.has_value() && b1->defined();
  return cfg;
}

// Errors leave the ops as sonicmoe::Error (a std::invalid_argument) and torch turns them into Python
// exceptions at its boundary. There is deliberately no try/catch in this file: on the H100 machine's torch
// build any exception that crosses a catch clause compiled into this extension (even `catch (c10::Error&)`
// with a rethrow) crashes inside the C++ runtime, while exceptions that only pass through our frames are
// handled by torch as usual.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  return f();
}

// ---------------------------------------------------------------------------------------------------
// Ops

// (output, aux_loss, the kNumState state tensors).
template <std::size_t... I>
auto tensor_tuple(std::index_sequence<I...>) -> std::tuple<decltype((void)I, at::Tensor())...>;
using ForwardOut = decltype(tensor_tuple(std::make_index_sequence<2 + kNumState>()));

template <std::size_t... I>
ForwardOut to_forward_out(const std::vector<at::Tensor>& v, std::index_sequence<I...>) {
  return {v[I]...};
}

// The ops' optional pre-quantised weights (argument fp8_weights): the 8 tensors of sonicmoe::Fp8ExpertWeights in its
// order, as fp8_quantize_weights returns them. An empty list is "not given"; an empty tensor in it (a transposed copy
// that was not made) stays undefined. Checked here for dtype, device and contiguity, by the library for shapes.
using Fp8WeightsArg = std::optional<at::TensorList>;
constexpr std::size_t kNumFp8Weights = 8;
constexpr const char* kFp8WeightNames[kNumFp8Weights] = {"w1", "w1_t", "w1_scale", "w1_scale_t",
                                                         "w2", "w2_t", "w2_scale", "w2_scale_t"};
sonicmoe::Tensor sonicmoe::Fp8ExpertWeights::* const kFp8WeightMembers[kNumFp8Weights] = {
    &sonicmoe::Fp8ExpertWeights::w1, &sonicmoe::Fp8ExpertWeights::w1_t,
    &sonicmoe::Fp8ExpertWeights::w1_scale, &sonicmoe::Fp8ExpertWeights::w1_scale_t,
    &sonicmoe::Fp8ExpertWeights::w2, &sonicmoe::Fp8ExpertWeights::w2_t,
    &sonicmoe::Fp8ExpertWeights::w2_scale, &sonicmoe::Fp8ExpertWeights::w2_scale_t};

bool fp8_weights_given(const Fp8WeightsArg& t) { return t.has_value() && !t->empty(); }

// The borrowed weights, or nullptr when not given.
std::shared_ptr<sonicmoe::Fp8ExpertWeights> fp8_weights_of(const char* fn, const Checker& c,
                                                           sonicmoe::Precision precision, const Fp8WeightsArg& t) {
  if (!fp8_weights_given(t)) return nullptr;
  const std::string where = std::string("sonicmoe_cpp.") + fn + ": argument 'fp8_weights'";
  if (precision != sonicmoe::Precision::fp8_blockwise) fail(where + " needs precision 'fp8'");
  if (t->size() != kNumFp8Weights)
    fail(where + " has " + std::to_string(t->size()) + " tensors, expected " + std::to_string(kNumFp8Weights) +
         " (w1, w1_t, w1_scale, w1_scale_t, w2, w2_t, w2_scale, w2_scale_t: fp8_quantize_weights' result)");
  auto q = std::make_shared<sonicmoe::Fp8ExpertWeights>();
  for (std::size_t i = 0; i < kNumFp8Weights; ++i) {
    const at::Tensor& v = (*t)[i];
    if (!v.defined() || v.numel() == 0) continue;
    const std::string name = std::string("fp8_weights[") + std::to_string(i) + "] (" + kFp8WeightNames[i] + ")";
    const bool codes = i % 4 < 2;  // w1, w1_t, w2, w2_t (the others are scales)
    c.check(v, name.c_str(), {codes ? at::kFloat8_e4m3fn : at::kFloat});
    (*q).*kFp8WeightMembers[i] = borrow(v);
  }
  return q;
}

// w1_up / b1_up: given exactly under w1_layout "separate" with a GLU activation (b1_up with b1), of w1's / b1's
// dtype, device and shape (the layer checks their addresses: sonicmoe::w1_separate_view).
void check_up_halves(const char* fn, sonicmoe::W1Layout layout, const std::string& activation, const at::Tensor& w1,
                     const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w1_up,
                     const c10::optional<at::Tensor>& b1_up) {
  const std::string where = std::string("sonicmoe_cpp.") + fn + ": ";
  const bool has_up = w1_up.has_value() && w1_up->defined(), has_b1_up = b1_up.has_value() && b1_up->defined();
  const bool separate = layout == sonicmoe::W1Layout::separate &&
                        sonicmoe::is_glu(sonicmoe::parse_activation(activation));
  if (!separate) {
    if (has_up || has_b1_up)
      fail(where + "arguments 'w1_up' / 'b1_up' are for w1_layout 'separate' with a GLU activation only");
    return;
  }
  const Checker c{fn, w1.device()};
  if (!has_up) fail(where + "w1_layout 'separate' needs argument 'w1_up' (the up half; 'w1' is the gate)");
  c.check(*w1_up, "w1_up", {w1.scalar_type()});
  if (!w1_up->sizes().equals(w1.sizes()))
    fail(where + "arguments 'w1' (gate) " + sizes_str(w1) + " and 'w1_up' " + sizes_str(*w1_up) + " differ");
  const bool has_b1 = b1.has_value() && b1->defined();
  if (has_b1 != has_b1_up) fail(where + "w1_layout 'separate': arguments 'b1' and 'b1_up' must be given together");
  if (has_b1) {
    c.check(*b1_up, "b1_up", {w1.scalar_type()});
    if (!b1_up->sizes().equals(b1->sizes()))
      fail(where + "arguments 'b1' (gate) " + sizes_str(*b1) + " and 'b1_up' " + sizes_str(*b1_up) + " differ");
  }
}

// The forward ops' arguments, checked (dtype, device, contiguity, ranks, routing inputs) and converted.
struct ForwardArgs {
  sonicmoe::MoEConfig cfg;
  sonicmoe::MoEWeights weights;
  sonicmoe::RoutingSpec spec;
  std::shared_ptr<sonicmoe::Fp8ExpertWeights> fp8;  // pre-quantised weights (weights.fp8 points here) or null
  bool expert_rows = false;  // forward: the output is Y [N, H] before step 6 (sonicmoe::moe_forward_expert_rows)
};

ForwardArgs check_forward_args(const char* fn, const at::Tensor& x, const c10::optional<at::Tensor>& router_weight,
                               const at::Tensor& w1, const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                               const c10::optional<at::Tensor>& b2, const std::string& activation, int64_t top_k,
                               const std::string& routing, int64_t tile, const c10::optional<at::Tensor>& token_idx,
                               const c10::optional<at::Tensor>& expert_idx, const c10::optional<at::Tensor>& scores,
                               const RouterArgs& router, const c10::optional<at::Tensor>& bias,
                               const std::string& precision, const std::string& w1_layout,
                               const Fp8WeightsArg& fp8_weights, const c10::optional<at::Tensor>& w1_up,
                               const c10::optional<at::Tensor>& b1_up) {
  const std::string where = std::string("sonicmoe_cpp.") + fn + ": ";
  const Checker c = Checker::of_leading(fn, x, "x");
  const auto dt = x.scalar_type();
  c.check_expert_weights(dt, w1, b1, w2, b2);
  const bool has_b1 = b1.has_value() && b1->defined(), has_b2 = b2.has_value() && b2->defined();
  if (has_b1 != has_b2) fail(where + "arguments 'b1' and 'b2' must be given together (add_bias)");
  ForwardArgs a;
  a.spec.mode = parse_mode(routing);
  a.spec.tile = tile;
  const bool general = a.spec.mode == sonicmoe::RoutingMode::general;
  // Arguments of the other routing modes are refused rather than ignored.
  const auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  if (general) {
    if (given(router_weight))
      fail(where + "argument 'router_weight' is given but routing 'general' does not route (pass None)");
    if (router.scoring_func != "softmax" || !router.softmax_over_topk || router.norm_topk_probs ||
        router.n_group != 1 || router.topk_group != 1 || router.routed_scaling_factor != 1.0 ||
        router.capacity_factor != 0.0 || given(bias))
      fail(where + "the router arguments (scoring_func, softmax_over_topk, norm_topk_probs, n_group, topk_group, "
           "routed_scaling_factor, e_score_correction_bias, capacity_factor) are for the routing modes that route, "
           "not 'general': leave them at their defaults");
    c.check_opt(token_idx, "token_idx", {at::kInt});
    c.check_opt(expert_idx, "expert_idx", {at::kInt});
    c.check_opt(scores, "scores", {at::kFloat});
    if (!token_idx || !expert_idx || !scores) fail(where + "general routing needs 'token_idx', 'expert_idx' and 'scores'");
    a.spec.token = view_of(token_idx);
    a.spec.expert = view_of(expert_idx);
    a.spec.score = view_of(scores);
  } else {
    if (given(token_idx) || given(expert_idx) || given(scores))
      fail(where + "arguments 'token_idx', 'expert_idx' and 'scores' are for routing 'general', not '" + routing +
           "' (pass None)");
    if (!router_weight.has_value() || !router_weight->defined())
      fail(where + "argument 'router_weight' is required for routing '" + routing + "'");
    c.check(*router_weight, "router_weight", {dt});
    if (top_k < 1) fail(where + "argument 'top_k' = " + std::to_string(top_k) + ", expected >= 1");
    a.spec.router = make_router(fn, router);  // validated by the library (messages name router.<field>)
    c.check_opt(bias, "e_score_correction_bias", {at::kFloat});
    a.spec.router.e_score_correction_bias = view_of(bias);
  }
  if (w1.dim() != 3 || w2.dim() != 3)
    fail(where + "arguments 'w1' [E, z_width, H] and 'w2' [E, H, I] must have 3 dimensions, got " +
         std::to_string(w1.dim()) + " and " + std::to_string(w2.dim()));
  if (x.dim() != 2) fail(where + "argument 'x' must be [T, H], got " + std::to_string(x.dim()) + " dimensions");
  const sonicmoe::W1Layout layout = parse_w1_layout_arg(fn, w1_layout);
  check_up_halves(fn, layout, activation, w1, b1, w1_up, b1_up);
  a.cfg = make_config(fn, w1, w2, b1, activation, top_k, a.spec.mode, layout == sonicmoe::W1Layout::separate);
  a.cfg.precision = parse_precision_arg(fn, precision);
  a.cfg.w1_layout = layout;
  a.weights = {general ? sonicmoe::TensorView() : view_of(router_weight), view_of(w1), view_of(b1), view_of(w2),
               view_of(b2)};
  a.weights.w1_up = view_of(w1_up);
  a.weights.b1_up = view_of(b1_up);
  a.fp8 = fp8_weights_of(fn, c, a.cfg.precision, fp8_weights);
  a.weights.fp8 = a.fp8.get();
  return a;
}

// The forward ops' outputs: the output, the aux loss and the saved state of `f` (x_dtype: the input's dtype, that of
// the state tensors marked "input").
ForwardOut forward_outputs(sonicmoe::ForwardResult& f, const ForwardArgs& a, at::Device dev, at::ScalarType x_dtype) {
  const sonicmoe::RoutingMode mode = a.spec.mode;
  const sonicmoe::Precision precision = a.cfg.precision;
  // A state tensor the mode does not have is an empty 1-D tensor of its dtype. Under top-K the pair
  // expert/score arrays are the top-K arrays reshaped: not returned twice (outputs of an op must not alias each
  // other); backward rebuilds them.
  auto absent = [&](StateDType d) {
    return at::empty({0}, at::TensorOptions().dtype(state_scalar(d, x_dtype)).device(dev));
  };
  std::vector<at::Tensor> outs = {to_torch(f.output, dev), to_torch(f.aux_loss, dev)};
#define SONICMOE_PY_STATE_OUT(name, dtype, shape, present, member)                                              \
  outs.push_back(present_in(Present::present, mode, precision, a.spec.router.has_capacity(), a.fp8 != nullptr)    \
                     ? to_torch(f.saved.member, dev)                                                           \
                     : absent(StateDType::dtype));
  SONICMOE_PY_STATE(SONICMOE_PY_STATE_OUT)
#undef SONICMOE_PY_STATE_OUT
  if (a.spec.router.has_capacity()) {
    const at::Tensor& offsets = outs[2 + state_index("offsets")];
    for (const char* n : {"z", "z_fp8", "z_scale"}) zero_rows_past(outs[2 + state_index(n)], offsets);
  }
  // Defensive: no two outputs may share memory.
  for (size_t i = 0; i < outs.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (outs[i].numel() > 0 && outs[i].data_ptr() == outs[j].data_ptr()) outs[i] = outs[i].clone();
  remember_forward(outs[2 + state_index("pair_token")], a.cfg, mode, a.spec.router);
  return to_forward_out(outs, std::make_index_sequence<2 + kNumState>());
}

// forward: the output, the aux loss and the saved state (sonicmoe::moe_forward).
struct ForwardOp {
  static constexpr const char* name = "forward";
  static ForwardOut run(const ForwardArgs& a, const at::Tensor& x) {
    const c10::DeviceGuard guard(x.device());
    return translate_errors([&]() -> ForwardOut {
      sonicmoe::Context ctx = make_context(x.device());
      sonicmoe::ForwardResult f = a.expert_rows
                                      ? sonicmoe::moe_forward_expert_rows(ctx, a.cfg, view_of(x), a.weights, a.spec)
                                      : sonicmoe::moe_forward(ctx, a.cfg, view_of(x), a.weights, a.spec);
      return forward_outputs(f, a, x.device(), x.scalar_type());
    });
  }
};

// forward_fp8_rows: forward under routing "general" and precision "fp8" with x given quantised 1x128 (x_q
// float8_e4m3fn [T, H], x_scale float32 [T, ceil(H / 128)]: DeepEP's FP8 dispatch); sonicmoe::moe_forward_general_fp8.
// The outputs of forward (the "input" state tensors in the weights' dtype); its backward is backward's with x the
// dequantised rows.
ForwardOut forward_fp8_rows_op(const at::Tensor& x_q, const at::Tensor& x_scale, const at::Tensor& w1,
                               const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                               const c10::optional<at::Tensor>& b2, const std::string& activation,
                               const at::Tensor& token_idx, const at::Tensor& expert_idx, const at::Tensor& scores,
                               Fp8WeightsArg fp8_weights) {
  const char* fn = "forward_fp8_rows";
  const std::string where = std::string("sonicmoe_cpp.") + fn + ": ";
  if (!x_q.defined()) fail(where + "argument 'x_q' is required");
  const Checker c{fn, x_q.device()};
  c.check(x_q, "x_q", {at::kFloat8_e4m3fn});
  c.check(x_scale, "x_scale", {at::kFloat});
  if (!w1.defined()) fail(where + "argument 'w1' is required");
  c.check(w1, "w1", {at::kBFloat16, at::kFloat});
  c.check_expert_weights(w1.scalar_type(), w1, b1, w2, b2);
  const bool has_b1 = b1.has_value() && b1->defined(), has_b2 = b2.has_value() && b2->defined();
  if (has_b1 != has_b2) fail(where + "arguments 'b1' and 'b2' must be given together (add_bias)");
  if (x_q.dim() != 2 || w1.dim() != 3 || w2.dim() != 3)
    fail(where + "arguments 'x_q' [T, H], 'w1' [E, z_width, H] and 'w2' [E, H, I] have " +
         std::to_string(x_q.dim()) + ", " + std::to_string(w1.dim()) + " and " + std::to_string(w2.dim()) +
         " dimensions");
  c.check(token_idx, "token_idx", {at::kInt});
  c.check(expert_idx, "expert_idx", {at::kInt});
  c.check(scores, "scores", {at::kFloat});
  ForwardArgs a;
  a.spec.mode = sonicmoe::RoutingMode::general;
  a.spec.token = view_of(token_idx);
  a.spec.expert = view_of(expert_idx);
  a.spec.score = view_of(scores);
  a.cfg = make_config(fn, w1, w2, b1, activation, 1, a.spec.mode, false);
  a.cfg.precision = sonicmoe::Precision::fp8_blockwise;
  a.weights = {sonicmoe::TensorView(), view_of(w1), view_of(b1), view_of(w2), view_of(b2)};
  a.fp8 = fp8_weights_of(fn, c, a.cfg.precision, fp8_weights);
  a.weights.fp8 = a.fp8.get();
  const c10::DeviceGuard guard(x_q.device());
  return translate_errors([&]() -> ForwardOut {
    sonicmoe::Context ctx = make_context(x_q.device());
    sonicmoe::ForwardResult f =
        sonicmoe::moe_forward_general_fp8(ctx, a.cfg, {view_of(x_q), view_of(x_scale)}, a.weights, a.spec);
    return forward_outputs(f, a, x_q.device(), w1.scalar_type());
  });
}

// inference: the output alone; no state is kept (sonicmoe::moe_inference). dropped_out (optional, int32 [1] on x's
// device): gets the pairs dropped by the capacity factor (a device copy, no host read; 0 without a capacity).
struct InferenceOp {
  static constexpr const char* name = "inference";
  static at::Tensor run(const ForwardArgs& a, const at::Tensor& x, const c10::optional<at::Tensor>& dropped_out) {
    if (a.expert_rows)
      fail("sonicmoe_cpp.inference: argument 'expert_rows' = True is for the training forward (forward); inference "
           "returns the tokens' rows");
    const bool want_dropped = dropped_out.has_value() && dropped_out->defined();
    if (want_dropped) {
      Checker{"inference", x.device()}.check(*dropped_out, "dropped_out", {at::kInt});
      if (dropped_out->numel() != 1)
        fail("sonicmoe_cpp.inference: argument 'dropped_out' must have one element, got " +
             sizes_str(*dropped_out));
    }
    const c10::DeviceGuard guard(x.device());
    sonicmoe::Context ctx = make_context(x.device());
    sonicmoe::Tensor dropped;
    sonicmoe::Tensor out = sonicmoe::moe_inference(ctx, a.cfg, view_of(x), a.weights, a.spec, &dropped);
    if (want_dropped) {  // (one element each: copy_ broadcasts over the caller's shape)
      if (dropped.defined()) dropped_out->copy_(to_torch(dropped, x.device()));
      else dropped_out->zero_();
    }
    return to_torch(out, x.device());
  }
};

// The forward and inference ops: the same arguments (SONICMOE_PY_FORWARD_PARAMS in the schema), checked the same
// way, then Op::run (with the op's own trailing arguments, `extra`).
template <class Op, class... Extra>
auto forward_like_op(const at::Tensor& x, const c10::optional<at::Tensor>& router_weight, const at::Tensor& w1,
                     const c10::optional<at::Tensor>& b1, const at::Tensor& w2, const c10::optional<at::Tensor>& b2,
                     const std::string& activation, int64_t top_k, const std::string& routing, int64_t tile,
                     const c10::optional<at::Tensor>& token_idx, const c10::optional<at::Tensor>& expert_idx,
                     const c10::optional<at::Tensor>& scores, const std::string& scoring_func, bool softmax_over_topk,
                     bool norm_topk_probs, int64_t n_group, int64_t topk_group, double routed_scaling_factor,
                     const c10::optional<at::Tensor>& e_score_correction_bias, double capacity_factor,
                     const std::string& precision, const std::string& w1_layout, Fp8WeightsArg fp8_weights,
                     const c10::optional<at::Tensor>& w1_up, const c10::optional<at::Tensor>& b1_up,
                     bool expert_rows, const Extra&... extra) {
  ForwardArgs a = check_forward_args(Op::name, x, router_weight, w1, b1, w2, b2, activation, top_k, routing,
                                           tile, token_idx, expert_idx, scores, {scoring_func, softmax_over_topk,
                                           norm_topk_probs, n_group, topk_group, routed_scaling_factor,
                                           capacity_factor},
                                           e_score_correction_bias, precision, w1_layout, fp8_weights, w1_up, b1_up);
  a.expert_rows = expert_rows;
  return Op::run(a, x, extra...);
}

using BackwardOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Which backward: the whole one (backward), or a half of the two-part one (backward_act: dx, drouter, dscore and the
// dZ / A*s that backward_weights then turns into dw1, db1, dw2, db2; sonicmoe::moe_backward_activations / _weights).
enum class BackwardKind { all, activations, weights };

// The parameters after `routing` that follow the state, shared by the three backward ops (dz / a_s: backward_weights).
#define SONICMOE_PY_BWD_TAIL_PARAMS                                                                            \
  const c10::optional<at::Tensor>&d_aux_loss, bool consume_z, bool validate_state,                           \
      const std::string &scoring_func, bool softmax_over_topk, bool norm_topk_probs, double routed_scaling_factor, \
      const std::string &precision_arg

// Every output of the three ops, in BackwardOut order, then dz and a_s (backward_act).
using BackwardAll = std::array<at::Tensor, 9>;

BackwardAll backward_impl(BackwardKind kind, bool dw2_in_part1, const at::Tensor* dz_in, const at::Tensor* as_in,
                          const at::Tensor& d_out,
                          const at::Tensor& x, const c10::optional<at::Tensor>& router_weight, const at::Tensor& w1,
                          const c10::optional<at::Tensor>& b1, const at::Tensor& w2,
                          const c10::optional<at::Tensor>& b2, const std::string& activation, int64_t top_k,
                          const std::string& routing,
#define SONICMOE_PY_STATE_PARAM(name, dtype, shape, present, member) const at::Tensor& name,
                          SONICMOE_PY_STATE(SONICMOE_PY_STATE_PARAM)
#undef SONICMOE_PY_STATE_PARAM
                          SONICMOE_PY_BWD_TAIL_PARAMS, const std::string& w1_layout_arg,
                          const Fp8WeightsArg& fp8_weights, const c10::optional<at::Tensor>& w1_up,
                          const c10::optional<at::Tensor>& b1_up, bool expert_rows,
                          const c10::optional<at::Tensor>& w1_main_grad,
                          const c10::optional<at::Tensor>& w2_main_grad,
                          const c10::optional<at::Tensor>& router_main_grad) {
  const char* fn = kind == BackwardKind::all ? "backward"
                   : kind == BackwardKind::activations ? "backward_act" : "backward_weights";
  const sonicmoe::Precision precision = parse_precision_arg(fn, precision_arg);
  const sonicmoe::W1Layout w1_layout = parse_w1_layout_arg(fn, w1_layout_arg);
  const Checker c = Checker::of_leading(fn, x, "x");
  const auto dt = x.scalar_type();
  c.check(d_out, "d_out", {dt});
  c.check_expert_weights(dt, w1, b1, w2, b2);
  check_up_halves(fn, w1_layout, activation, w1, b1, w1_up, b1_up);
  const sonicmoe::RoutingMode mode = parse_mode(routing);
  const bool general = mode == sonicmoe::RoutingMode::general;
  const bool topk = mode == sonicmoe::RoutingMode::topk;
  if (general && router_weight.has_value() && router_weight->defined())
    fail(std::string("sonicmoe_cpp.") + fn + ": argument 'router_weight' is given but routing 'general' has no "
         "router (pass None)");
  if (general && d_aux_loss.has_value() && d_aux_loss->defined())
    fail(std::string("sonicmoe_cpp.") + fn + ": argument 'd_aux_loss' is given but routing 'general' has no aux "
         "loss (pass None)");
  // The state tensors the mode has, in order; router_weight is checked just before the router's outputs.
  const at::Tensor* const state[] = {
#define SONICMOE_PY_STATE_ADDR(name, dtype, shape, present, member) &name,
      SONICMOE_PY_STATE(SONICMOE_PY_STATE_ADDR)
#undef SONICMOE_PY_STATE_ADDR
  };
  bool router_checked = false;
  // The capacity's state (demand, dropped) is given exactly when the forward ran under a capacity.
  const bool capacity = topk && demand.numel() > 0;
  // Pre-quantised weights: the backward reads them (and the state has no quantised weights of its own).
  const std::shared_ptr<sonicmoe::Fp8ExpertWeights> fp8w = fp8_weights_of(fn, c, precision, fp8_weights);
  // Without them, the forward's quantised W1^T / W2^T are in the state when it made them (a state from elsewhere
  // may lack them: the backward then quantises the weights itself).
  const bool pre_quantised = fp8w != nullptr || w1_t_fp8.numel() == 0;
  for (std::size_t i = 0; i < kNumState; ++i) {
    const StateField& f = kStateFields[i];
    if (!present_in(f.present, mode, precision, capacity, pre_quantised)) {
      // A state this routing / precision does not have is an empty tensor (as the forward returns it): anything
      // else would be silently ignored. (The forward's own FP8 weight copies may stay when fp8_weights is given.)
      if (f.present != Present::fp8_own && f.present != Present::fp8_own_w2 && state[i]->defined() &&
          state[i]->numel() != 0)
        fail(std::string("sonicmoe_cpp.") + fn + ": saved state '" + f.name + "' has " +
             std::to_string(state[i]->numel()) + " elements, but routing '" + routing + "' with precision '" +
             precision_arg + (capacity ? "' under a capacity" : "'") +
             " has no such state: expected an empty tensor (the forward's output for it)");
      continue;
    }
    if (f.present == Present::routed && !router_checked) {
      if (!router_weight.has_value() || !router_weight->defined())
        fail(std::string("sonicmoe_cpp.") + fn + ": argument 'router_weight' is required for routing '" + routing +
             "'");
      c.check(*router_weight, "router_weight", {dt});
      router_checked = true;
    }
    c.check(*state[i], f.name, {state_scalar(f.dtype, dt)});
  }
  // dL/d(aux_loss) stays on the device (no host read: CUDA-graph capturable); a one-element float32 tensor.
  at::Tensor d_aux;
  if (d_aux_loss.has_value() && d_aux_loss->defined()) {
    c.check(*d_aux_loss, "d_aux_loss", {at::kFloat});
    if (d_aux_loss->numel() != 1)
      fail(std::string("sonicmoe_cpp.") + fn + ": argument 'd_aux_loss' must have one element, got " +
           std::to_string(d_aux_loss->numel()));
    d_aux = d_aux_loss->reshape({1}).contiguous();
  }
  const c10::DeviceGuard guard(x.device());

  for (const auto& [mg, name] : {std::pair{&w1_main_grad, "w1_main_grad"}, std::pair{&w2_main_grad, "w2_main_grad"},
                                 std::pair{&router_main_grad, "router_main_grad"}})
    if (mg->has_value() && (*mg)->defined()) c.check(**mg, name, {at::kFloat});
  if (kind == BackwardKind::weights) {
    c.check(*dz_in, "dz", {dt});
    if (as_in->numel() > 0) c.check(*as_in, "a_s", {dt});  // empty: part 1 ran dW2 (dw2_in_part1)
  }
  return translate_errors([&]() -> BackwardAll {
    const at::Tensor& saved_z = precision == sonicmoe::Precision::bf16 ? z : z_fp8;
    if (w1.dim() != 3 || w2.dim() != 3 || x.dim() != 2 || saved_z.dim() != 2)
      fail("sonicmoe_cpp.backward: 'x' [T, H], 'z' (or 'z_fp8') [N, z_width], 'w1' and 'w2' (3-D) have wrong ranks");
    sonicmoe::MoEConfig cfg =
        make_config(fn, w1, w2, b1, activation, top_k, mode, w1_layout == sonicmoe::W1Layout::separate);
    cfg.precision = precision;
    cfg.weight_grad_precision = weight_grad_precision_of(precision_arg);
    cfg.w1_layout = w1_layout;
    sonicmoe::Context ctx = make_context(x.device());
    sonicmoe::MoEWeights w{general ? sonicmoe::TensorView() : view_of(router_weight), view_of(w1), view_of(b1),
                           view_of(w2), view_of(b2)};
    w.w1_up = view_of(w1_up);
    w.b1_up = view_of(b1_up);
    w.fp8 = fp8w.get();
    // fp32 main_grads: the weight-gradient GEMMs add into them (the library checks dtype, shape, device, layout)
    w.w1_main_grad = view_of(w1_main_grad);
    w.w2_main_grad = view_of(w2_main_grad);
    w.router_main_grad = view_of(router_main_grad);
    sonicmoe::SavedState s;
    s.config = cfg;
    sonicmoe::Routing& r = s.routing;
    r.mode = mode;
    r.top_k = cfg.top_k;
    // The router's weight rule (the backward needs no groups or bias: the picks are in topk_expert).
    if (!(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0.0))
      fail(std::string("sonicmoe_cpp.") + fn + ": argument 'routed_scaling_factor' = " +
           std::to_string(routed_scaling_factor) + ", expected a finite value > 0");
    if (topk)
      r.router = make_router(fn, {scoring_func, softmax_over_topk, norm_topk_probs, 1, 1, routed_scaling_factor});
    const int64_t T = x.size(0), N = pair.size(0);  // the metadata defines N; z is checked against it
#define SONICMOE_PY_STATE_BORROW(name, dtype, shape, present, member) \
  if (present_in(Present::present, mode, precision, capacity, pre_quantised)) s.member = borrow(name);
    SONICMOE_PY_STATE(SONICMOE_PY_STATE_BORROW)
#undef SONICMOE_PY_STATE_BORROW
    if (topk) {  // not passed under top-K: the top-K arrays reshaped
      r.pair_expert = r.topk_expert.reshape({r.topk_expert.numel()});
      r.pair_score = r.topk_score.reshape({r.topk_score.numel()});
    }
    r.aux_loss = sonicmoe::Tensor();
    r.meta.num_tokens = T;
    r.meta.num_experts = cfg.num_experts;
    r.meta.num_pairs = N;
    // State handed in from outside the autograd path may be anything: its shapes and index ranges are checked
    // before a kernel indexes with them (one pass over the O(T*K) arrays; a device sync on the GPU).
    if (validate_state && kind != BackwardKind::weights && was_consumed(saved_z))
      fail(std::string("sonicmoe_cpp.") + fn + ": saved state '" +
           (precision == sonicmoe::Precision::bf16 ? "z" : "z_fp8") + "' was consumed by an earlier backward "
           "(consume_z=True wrote dZ over it): a second backward through the same state would read dZ as Z");
    if (validate_state) {
      check_against_forward(fn, pair_token, cfg, mode, r.router);
      sonicmoe::validate_saved_state(ctx, s, T);
    }
    const sonicmoe::AuxLossGrad daux =
        d_aux.defined() ? sonicmoe::AuxLossGrad(view_of(d_aux)) : sonicmoe::AuxLossGrad(0.0f);
    // consume_z: dZ is written over z (the autograd path gives z up; it bumps z's version so that a second backward
    // through the same graph raises instead of reading dZ as Z).
    sonicmoe::Gradients g;
    sonicmoe::WeightGradOperands keep;
    bool dz_is_z = false;
    if (kind == BackwardKind::all) {
      g = consume_z ? sonicmoe::moe_backward(ctx, view_of(x), w, std::move(s), view_of(d_out), daux)
                    : sonicmoe::moe_backward(ctx, view_of(x), w, s, view_of(d_out), daux);
    } else if (kind == BackwardKind::activations && expert_rows) {  // dx: dXe [N, H] (a forward with expert_rows)
      g = sonicmoe::moe_backward_expert_rows(ctx, view_of(x), w, s, view_of(d_out), keep, consume_z);
      dz_is_z = consume_z;
    } else if (kind == BackwardKind::activations) {
      g = sonicmoe::moe_backward_activations(ctx, view_of(x), w, s, view_of(d_out), keep, daux, consume_z,
                                             dw2_in_part1);
      dz_is_z = consume_z;  // dZ is in z's memory: not returned (an output must not alias an input)
    } else {
      keep.dz = borrow(*dz_in);
      if (as_in->numel() > 0) keep.as = borrow(*as_in);
      static_cast<sonicmoe::ExpertWeightGradients&>(g) =
          sonicmoe::moe_backward_weights(ctx, view_of(x), w, s, view_of(d_out), keep);
    }
    if (consume_z && kind != BackwardKind::weights) mark_consumed(saved_z);
    const auto dev = x.device();
    auto empty_like_dt = [&]() { return at::empty({0}, at::TensorOptions().dtype(dt).device(dev)); };
    auto opt = [&](const sonicmoe::Tensor& t) { return t.defined() ? to_torch(t, dev) : empty_like_dt(); };
    if (kind == BackwardKind::activations && capacity) {
      // dZ and A*s per pair row: the rows past offsets[E] hold no pair (zero_rows_past). to_torch views the same
      // memory as the outputs below.
      if (keep.dz.defined() && !dz_is_z) zero_rows_past(to_torch(keep.dz, dev), offsets);
      if (keep.as.defined()) zero_rows_past(to_torch(keep.as, dev), offsets);
    }
    return {opt(g.dx),
            opt(g.dw1),
            opt(g.db1),
            opt(g.dw2),
            opt(g.db2),
            opt(g.drouter),
            g.dscore.defined() ? to_torch(g.dscore, dev)
                               : at::empty({0}, at::TensorOptions().dtype(at::kFloat).device(dev)),
            dz_is_z ? empty_like_dt() : opt(keep.dz),
            opt(keep.as)};
  });
}

#define SONICMOE_PY_BWD_HEAD_PARAMS                                                                               \
  const at::Tensor &d_out, const at::Tensor &x, const c10::optional<at::Tensor>&router_weight, const at::Tensor &w1, \
      const c10::optional<at::Tensor>&b1, const at::Tensor &w2, const c10::optional<at::Tensor>&b2,                 \
      const std::string &activation, int64_t top_k, const std::string &routing
#define SONICMOE_PY_STATE_PARAM(name, dtype, shape, present, member) const at::Tensor& name,
#define SONICMOE_PY_STATE_NAME(name, dtype, shape, present, member) name,
#define SONICMOE_PY_BWD_ARGS                                                                                   \
  d_out, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, SONICMOE_PY_STATE(SONICMOE_PY_STATE_NAME) \
      d_aux_loss, consume_z, validate_state, scoring_func, softmax_over_topk, norm_topk_probs,                     \
      routed_scaling_factor, precision_arg

BackwardOut moe_backward_op(SONICMOE_PY_BWD_HEAD_PARAMS, SONICMOE_PY_STATE(SONICMOE_PY_STATE_PARAM)
                                SONICMOE_PY_BWD_TAIL_PARAMS, const std::string& w1_layout_arg,
                                Fp8WeightsArg fp8_weights, const c10::optional<at::Tensor>& w1_up,
                                const c10::optional<at::Tensor>& b1_up, const c10::optional<at::Tensor>& w1_main_grad,
                                const c10::optional<at::Tensor>& w2_main_grad,
                                const c10::optional<at::Tensor>& router_main_grad) {
  BackwardAll a = backward_impl(BackwardKind::all, false, nullptr, nullptr, SONICMOE_PY_BWD_ARGS, w1_layout_arg,
                                fp8_weights, w1_up, b1_up, false, w1_main_grad, w2_main_grad, router_main_grad);
  return {a[0], a[1], a[2], a[3], a[4], a[5], a[6]};
}

// backward_act -> (dx, drouter, dscore, dz, a_s, dw2, db2): dz empty when consume_z (dZ was written over z); with
// dw2_in_part1, dw2 / db2 computed here and a_s empty (else dw2 / db2 empty). expert_rows (the state of a forward
// with expert_rows, which takes dw2_in_part1): dx is dXe [N, H] before its per-token sum
// (sonicmoe::moe_backward_expert_rows).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_act_op(
    SONICMOE_PY_BWD_HEAD_PARAMS, SONICMOE_PY_STATE(SONICMOE_PY_STATE_PARAM) SONICMOE_PY_BWD_TAIL_PARAMS,
    bool dw2_in_part1, const c10::optional<at::Tensor>& w2_main_grad, bool expert_rows) {
  if (expert_rows && !dw2_in_part1)
    fail("sonicmoe_cpp.backward_act: argument 'expert_rows' = True takes dw2_in_part1=True (dW2 is computed with the "
         "expert rows' first half)");
  BackwardAll a =
      backward_impl(BackwardKind::activations, dw2_in_part1, nullptr, nullptr, SONICMOE_PY_BWD_ARGS, "interleaved",
                    std::nullopt, std::nullopt, std::nullopt, expert_rows, std::nullopt, w2_main_grad, std::nullopt);
  return {a[0], a[5], a[6], a[7], a[8], a[3], a[4]};
}

// backward_weights (..., dz, a_s, ...) -> (dw1, db1, dw2, db2): dw2 / db2 empty when a_s is (part 1 ran them). The
// tail's d_aux_loss and consume_z are not read.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_weights_op(
    SONICMOE_PY_BWD_HEAD_PARAMS, SONICMOE_PY_STATE(SONICMOE_PY_STATE_PARAM) const at::Tensor& dz,
    const at::Tensor& a_s, SONICMOE_PY_BWD_TAIL_PARAMS, const c10::optional<at::Tensor>& w1_main_grad,
    const c10::optional<at::Tensor>& w2_main_grad) {
  BackwardAll a = backward_impl(BackwardKind::weights, false, &dz, &a_s, SONICMOE_PY_BWD_ARGS, "interleaved",
                                std::nullopt, std::nullopt, std::nullopt, false, w1_main_grad, w2_main_grad,
                                std::nullopt);
  return {a[1], a[2], a[3], a[4]};
}
#undef SONICMOE_PY_STATE_PARAM
#undef SONICMOE_PY_STATE_NAME

// gather_sum: out[t] = sum of scores[p] * rows[rev[p]] (rows[rev[p]] without scores) over p in [token_offsets[t],
// token_offsets[t+1]), in p order, fp32 accumulation and one rounding to rows' dtype: the layer's own aggregation
// stage (step 6, 10b without scores; on the GPU one vectorised gather-sum kernel, no atomics) over caller-given rev /
// token_offsets (absolute pair indices: a slice of the layer's token_offsets sums a range of its tokens). The
// expert-parallel layer sums each token's rows from the ranks with it, and the forward's expert rows
// (forward(..., expert_rows=True)) in parts (sonicmoe_cpp/ep.py). Nothing is read on the host.
at::Tensor gather_sum_op(const at::Tensor& rows, const at::Tensor& rev, const at::Tensor& token_offsets,
                         const c10::optional<at::Tensor>& scores) {
  const char* fn = "gather_sum";
  const Checker c = Checker::of_leading(fn, rows, "rows");
  c.check(rev, "rev", {at::kInt});
  c.check(token_offsets, "token_offsets", {at::kInt});
  c.check_opt(scores, "scores", {at::kFloat});
  const bool scored = scores.has_value() && scores->defined();
  if (scored && (scores->dim() != 1 || scores->size(0) != rev.size(0)))
    fail("sonicmoe_cpp.gather_sum: argument 'scores' has shape " + sizes_str(*scores) + ", expected [P] with P = " +
         std::to_string(rev.size(0)) + " (one per entry of 'rev')");
  if (rows.dim() != 2 || rev.dim() != 1 || token_offsets.dim() != 1 || token_offsets.size(0) < 1)
    fail("sonicmoe_cpp.gather_sum: expected rows [N, H], rev [P] and token_offsets [T+1], got " + sizes_str(rows) +
         ", " + sizes_str(rev) + " and " + sizes_str(token_offsets));
  const int64_t T = token_offsets.size(0) - 1, P = rev.size(0);
  if (P != rows.size(0))
    fail("sonicmoe_cpp.gather_sum: argument 'rev' has " + std::to_string(P) + " entries, expected one per row of "
         "'rows' (" + std::to_string(rows.size(0)) + ")");
  // On the CPU (free: no device read) every index is checked first, so that a bad rev / token_offsets is an error
  // naming it. On CUDA they are not read on the host (that would cost a device sync per call): the kernel gives a
  // token whose offsets or rows are out of range a NaN row, and reads nothing out of bounds (rev = -1, the layer's
  // dropped pair, adds nothing there).
  if (rows.device().is_cpu()) {
    const int32_t* off = token_offsets.data_ptr<int32_t>();
    const int32_t* rv = rev.data_ptr<int32_t>();
    for (int64_t t = 0; t <= T; ++t) {
      const int64_t lo = t == 0 ? 0 : off[t - 1];
      if (off[t] < lo || off[t] > P)
        fail("sonicmoe_cpp.gather_sum: argument 'token_offsets'[" + std::to_string(t) + "] = " +
             std::to_string(off[t]) + ", expected non-decreasing values in [0, P = " + std::to_string(P) +
             "] (P: the entries of 'rev')");
    }
    for (int64_t p = 0; p < P; ++p)
      if (rv[p] < 0 || rv[p] >= rows.size(0))
        fail("sonicmoe_cpp.gather_sum: argument 'rev'[" + std::to_string(p) + "] = " + std::to_string(rv[p]) +
             ", expected a row of 'rows' in [0, " + std::to_string(rows.size(0)) + ")");
  }
  at::Tensor out = at::empty({T, rows.size(1)}, rows.options());
  if (T == 0) return out;
  if (P == 0 || rows.size(0) == 0) return out.zero_();
  const c10::DeviceGuard guard(rows.device());
  return translate_errors([&]() -> at::Tensor {
    sonicmoe::Context ctx = make_context(rows.device());
    // The stage reads rev and token_offsets only; the other metadata arrays get valid shapes, no values.
    const auto ints = at::TensorOptions().dtype(at::kInt).device(rows.device());
    at::Tensor one = at::zeros({2}, ints), unused = at::empty({P}, ints);
    sonicmoe::RoutingMetadata meta;
    meta.num_tokens = T;
    meta.num_experts = 1;
    meta.num_pairs = P;
    meta.counts = borrow(one.narrow(0, 0, 1));
    meta.offsets = borrow(one);
    meta.pair = borrow(unused);
    meta.gather = borrow(unused);
    meta.rev = borrow(rev);
    meta.token_offsets = borrow(token_offsets);
    sonicmoe::aggregate(ctx, view_of(rows), scored ? view_of(*scores) : sonicmoe::TensorView(), meta, view_of(out));
    return out;
  });
}

// topk: the layer's top-K selection (sonicmoe::topk_softmax, the default router) on caller-given fp32 logits [T, E]:
// per token the K largest logits (ties: lower expert id first; order: descending logit) as int32 ids [T, K], the
// softmax over those K (fp32 [T, K]) and the top-K rows per expert (int32 [E]). One kernel on the GPU, no host read;
// the expert-parallel layer routes with it (sonicmoe_cpp/ep.py). Not differentiable: a caller that needs the scores'
// gradient recomputes them from the logits at these ids. A non-finite logit is refused on the CPU; on the GPU the
// logits are not read on the host (as in the layer) and every id stays in [0, E).
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_op(const at::Tensor& logits, int64_t k) {
  const char* fn = "topk";
  if (!logits.defined()) fail("sonicmoe_cpp.topk: argument 'logits' is required");
  const Checker c{fn, logits.device()};
  c.check(logits, "logits", {at::kFloat});
  if (logits.dim() != 2) fail("sonicmoe_cpp.topk: argument 'logits' must be [T, E], got " + sizes_str(logits));
  const int64_t T = logits.size(0), E = logits.size(1);
  if (k < 1 || k > E)
    fail("sonicmoe_cpp.topk: argument 'k' = " + std::to_string(k) + ", expected 1 <= k <= E = " + std::to_string(E));
  const auto ints = logits.options().dtype(at::kInt);
  at::Tensor ids = at::empty({T, k}, ints), scores = at::empty({T, k}, logits.options());
  at::Tensor counts = at::empty({E}, ints);
  const c10::DeviceGuard guard(logits.device());
  translate_errors([&] {
    sonicmoe::topk_softmax(make_context(logits.device()), view_of(logits), k, view_of(ids), view_of(scores),
                           view_of(counts));
  });
  return {ids, scores, counts};
}

// fp8_quantize_weights: W1 [E, z_width, H] and W2 [E, H, I] (x's dtype: bf16 or f32) quantised 128x128 as the FP8
// layer quantises them (sonicmoe::fp8_quantize_expert_weights): the 8 tensors of the ops' fp8_weights argument, the
// transposed copies the backward reads (w1_t, w1_scale_t) empty unless `transposed` (a forward-only caller can skip
// them); w2_t and w2_scale_t always empty (the binding's dgated GEMM runs on bf16 operands and reads no W2^T).
// fp8_dequantize_rows: the values of rows quantised 1x128 (sonicmoe::fp8_dequantize_rows), in `dtype` (bfloat16, or
// float32 on the CPU).
at::Tensor fp8_dequantize_rows_op(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  const char* fn = "fp8_dequantize_rows";
  if (!q.defined()) fail("sonicmoe_cpp.fp8_dequantize_rows: argument 'q' is required");
  const Checker c{fn, q.device()};
  c.check(q, "q", {at::kFloat8_e4m3fn});
  c.check(scale, "scale", {at::kFloat});
  if (q.dim() != 2) fail("sonicmoe_cpp.fp8_dequantize_rows: argument 'q' must be [M, K], got " + sizes_str(q));
  const at::Tensor out = at::empty(q.sizes(), q.options().dtype(dtype));
  const c10::DeviceGuard guard(q.device());
  translate_errors([&] {
    sonicmoe::fp8_dequantize_rows(make_context(q.device()), view_of(q), view_of(scale), view_of(out));
  });
  return out;
}

std::vector<at::Tensor> fp8_quantize_weights_op(const at::Tensor& w1, const at::Tensor& w2,
                                                const std::string& activation, bool transposed) {
  const char* fn = "fp8_quantize_weights";
  const Checker c = Checker::of_leading(fn, w1, "w1");
  c.check(w2, "w2", {w1.scalar_type()});
  if (w1.dim() != 3 || w2.dim() != 3)
    fail("sonicmoe_cpp.fp8_quantize_weights: arguments 'w1' [E, z_width, H] and 'w2' [E, H, I] must have 3 "
         "dimensions, got " + std::to_string(w1.dim()) + " and " + std::to_string(w2.dim()));
  sonicmoe::MoEConfig cfg = make_config(fn, w1, w2, c10::nullopt, activation, 1, sonicmoe::RoutingMode::topk);
  cfg.precision = sonicmoe::Precision::fp8_blockwise;
  const c10::DeviceGuard guard(w1.device());
  return translate_errors([&]() -> std::vector<at::Tensor> {
    sonicmoe::Context ctx = make_context(w1.device());
    sonicmoe::MoEWeights w;
    w.w1 = view_of(w1);
    w.w2 = view_of(w2);
    const sonicmoe::Fp8ExpertWeights q = sonicmoe::fp8_quantize_expert_weights(ctx, cfg, w, transposed);
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < kNumFp8Weights; ++i) {
      const sonicmoe::Tensor& t = q.*kFp8WeightMembers[i];
      out.push_back(t.defined() ? to_torch(t, w1.device())
                                : at::empty({0}, at::TensorOptions()
                                                     .dtype(i % 4 < 2 ? at::kFloat8_e4m3fn : at::kFloat)
                                                     .device(w1.device())));
    }
    return out;
  });
}

bool built_with_cuda() { return SONICMOE_PY_CUDA != 0; }

}  // namespace sonicmoe_py

// The parameters of forward and inference (forward_like_op).
#define SONICMOE_PY_FORWARD_PARAMS                                                                               \
  "Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, int top_k, "    \
  "str routing, int tile, Tensor? token_idx, Tensor? expert_idx, Tensor? scores, str scoring_func=\"softmax\", " \
  "bool softmax_over_topk=True, bool norm_topk_probs=False, int n_group=1, int topk_group=1, "                     \
  "float routed_scaling_factor=1.0, Tensor? e_score_correction_bias=None, float capacity_factor=0.0, "           \
  "str precision=\"bf16\", str w1_layout=\"interleaved\", Tensor[]? fp8_weights=None, Tensor? w1_up=None, " \
  "Tensor? b1_up=None, bool expert_rows=False"

TORCH_LIBRARY(sonicmoe, m) {
  m.def("forward(" SONICMOE_PY_FORWARD_PARAMS ") -> (Tensor output, Tensor aux_loss" SONICMOE_PY_STATE(
      SONICMOE_PY_STATE_RETURN) ")");
  m.def(
      "backward(Tensor d_out, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "str activation, int top_k, str routing, " SONICMOE_PY_STATE(SONICMOE_PY_STATE_ARG)
      "Tensor? d_aux_loss, bool consume_z=False, bool validate_state=True, str scoring_func=\"softmax\", "
      "bool softmax_over_topk=True, bool norm_topk_probs=False, float routed_scaling_factor=1.0, "
      "str precision=\"bf16\", str w1_layout=\"interleaved\", Tensor[]? fp8_weights=None, Tensor? w1_up=None, "
      "Tensor? b1_up=None, Tensor(a!)? w1_main_grad=None, Tensor(b!)? w2_main_grad=None, "
      "Tensor(c!)? router_main_grad=None) -> "
      "(Tensor dx, Tensor dw1, Tensor db1, Tensor dw2, Tensor db2, Tensor drouter, Tensor dscore)");
  // The two-part backward (sonicmoe::moe_backward_activations / moe_backward_weights; bf16 only, so no fp8_weights): the
  // same arguments as backward,
  // backward_weights with part 1's dz (z itself when part 1 consumed z) and a_s after the state.
  m.def(
      "backward_act(Tensor d_out, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "str activation, int top_k, str routing, " SONICMOE_PY_STATE(SONICMOE_PY_STATE_ARG)
      "Tensor? d_aux_loss, bool consume_z=False, bool validate_state=True, str scoring_func=\"softmax\", "
      "bool softmax_over_topk=True, bool norm_topk_probs=False, float routed_scaling_factor=1.0, "
      "str precision=\"bf16\", bool dw2_in_part1=False, Tensor(a!)? w2_main_grad=None, bool expert_rows=False) -> "
      "(Tensor dx, Tensor drouter, Tensor dscore, Tensor dz, Tensor a_s, Tensor dw2, Tensor db2)");
  m.def(
      "backward_weights(Tensor d_out, Tensor x, Tensor? router_weight, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "str activation, int top_k, str routing, " SONICMOE_PY_STATE(SONICMOE_PY_STATE_ARG)
      "Tensor dz, Tensor a_s, Tensor? d_aux_loss=None, bool consume_z=False, bool validate_state=True, "
      "str scoring_func=\"softmax\", bool softmax_over_topk=True, bool norm_topk_probs=False, "
      "float routed_scaling_factor=1.0, str precision=\"bf16\", Tensor(a!)? w1_main_grad=None, "
      "Tensor(b!)? w2_main_grad=None) -> (Tensor dw1, Tensor db1, Tensor dw2, Tensor db2)");
  m.def("forward_fp8_rows(Tensor x_q, Tensor x_scale, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
        "Tensor token_idx, Tensor expert_idx, Tensor scores, Tensor[]? fp8_weights=None) -> (Tensor output, "
        "Tensor aux_loss" SONICMOE_PY_STATE(SONICMOE_PY_STATE_RETURN) ")");
  m.def("inference(" SONICMOE_PY_FORWARD_PARAMS ", Tensor(a!)? dropped_out=None) -> Tensor");
  m.def("gather_sum(Tensor rows, Tensor rev, Tensor token_offsets, Tensor? scores=None) -> Tensor");
  m.def("topk(Tensor logits, int k) -> (Tensor ids, Tensor scores, Tensor counts)");
  m.def("fp8_quantize_weights(Tensor w1, Tensor w2, str activation, bool transposed=True) -> Tensor[]");
  m.def("fp8_dequantize_rows(Tensor q, Tensor scale, ScalarType dtype) -> Tensor");
}

namespace sonicmoe_py {
// The same kernels serve both dispatch keys (the library picks its backend from the tensors' device).
void register_impls(torch::Library& m) {
  m.impl("forward", &forward_like_op<ForwardOp>);
  m.impl("backward", &moe_backward_op);
  m.impl("backward_act", &moe_backward_act_op);
  m.impl("backward_weights", &moe_backward_weights_op);
  m.impl("forward_fp8_rows", &forward_fp8_rows_op);
  m.impl("inference", &forward_like_op<InferenceOp, c10::optional<at::Tensor>>);
  m.impl("gather_sum", &gather_sum_op);
  m.impl("topk", &topk_op);
  m.impl("fp8_quantize_weights", &fp8_quantize_weights_op);
  m.impl("fp8_dequantize_rows", &fp8_dequantize_rows_op);
}
}  // namespace sonicmoe_py

TORCH_LIBRARY_IMPL(sonicmoe, CPU, m) { sonicmoe_py::register_impls(m); }

#if SONICMOE_PY_CUDA
TORCH_LIBRARY_IMPL(sonicmoe, CUDA, m) { sonicmoe_py::register_impls(m); }
#endif

// A minimal Python module: importing sonicmoe_cpp._C loads the library and runs the registrations above.
static PyObject* py_built_with_cuda(PyObject*, PyObject*) {
  if (sonicmoe_py::built_with_cuda()) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}
// ((name, dtype, shape, present), ...) of SONICMOE_PY_STATE, for the fake kernels of sonicmoe_cpp/_ops.py.
static PyObject* py_state_fields(PyObject*, PyObject*) {
  static const char* const kPresent[] = {"always", "routed", "paired", "rounding", "bf16", "fp8", "capacity",
                                         "fp8_own", "fp8_own_w2"};
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(sonicmoe_py::kNumState));
  if (!t) return nullptr;
  for (std::size_t i = 0; i < sonicmoe_py::kNumState; ++i) {
    const sonicmoe_py::StateField& f = sonicmoe_py::kStateFields[i];
    PyObject* row = Py_BuildValue("(ssss)", f.name, sonicmoe_py::dtype_name(f.dtype), f.shape,
                                  kPresent[static_cast<int>(f.present)]);
    if (!row) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), row);
  }
  return t;
}
static PyObject* py_set_gemm_sm_margin(PyObject*, PyObject* arg) {
  const long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) return nullptr;
  if (v < 0 || v > 4096) {
    PyErr_SetString(PyExc_ValueError, "sonicmoe_cpp.set_gemm_sm_margin: argument 'sms' must be in [0, 4096]");
    return nullptr;
  }
  sonicmoe::set_gemm_sm_margin(static_cast<int>(v));
  Py_RETURN_NONE;
}
static PyObject* py_gemm_sm_margin(PyObject*, PyObject*) { return PyLong_FromLong(sonicmoe::gemm_sm_margin()); }
static PyMethodDef kMethods[] = {
    {"built_with_cuda", py_built_with_cuda, METH_NOARGS, "True when the library was built with the cuda backend"},
    {"state_fields", py_state_fields, METH_NOARGS,
     "((name, dtype, shape, present), ...): the saved state of sonicmoe::forward / backward, in order"},
    {"set_gemm_sm_margin", py_set_gemm_sm_margin, METH_O, "SMs the GEMM kernels leave idle (sonicmoe/moe.h)"},
    {"gemm_sm_margin", py_gemm_sm_margin, METH_NOARGS, "SMs the GEMM kernels leave idle (sonicmoe/moe.h)"},
    {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "sonicmoe ops (torch.ops.sonicmoe)", -1, kMethods};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kModule); }

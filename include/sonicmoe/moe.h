// The MoE layer: configuration, routing state, forward and memory-efficient backward.
// Step numbers refer to DESIGN.md sections 2-3; docs/ALGORITHM.md spells out every formula.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sonicmoe/tensor.h"
#include "sonicmoe/types.h"

namespace sonicmoe {

// Where and how a call runs.
struct Context {
  Backend backend = Backend::cpu;
  void* stream = nullptr;          // cudaStream_t for the cuda backend
  Allocator* allocator = nullptr;  // nullptr: default_allocator()
  int device_index = 0;            // CUDA ordinal for the cuda backend
  Device device() const { return backend == Backend::cuda ? Device::cuda(device_index) : Device::cpu(); }
};

// SMs the persistent GEMM kernels leave idle (default 0): their grids take the device's SM count less this many,
// so that another stream's kernels (NCCL's, under expert parallelism) run beside them instead of holding back the
// tiles of the CTAs they displace (the tile schedule is static). Process-wide, read at each GEMM launch: change it
// between layer calls, not during one. Negative values are refused (Error).
void set_gemm_sm_margin(int sms);
int gemm_sm_margin();

struct MoEConfig {
  std::int64_t num_experts = 0;        // E
  std::int64_t top_k = 0;              // K (top-K and token-rounding routing)
  std::int64_t hidden_size = 0;        // H
  std::int64_t intermediate_size = 0;  // I
  Activation activation = Activation::swiglu;
  bool add_bias = false;
  // Number format of the expert GEMMs (docs/ALGORITHM.md, "FP8 blockwise recipe"). fp8_blockwise needs hidden_size
  // and intermediate_size multiples of 128 (every reduction of the layer then runs over whole 128-blocks); it runs on
  // the cpu reference and on the cuda backend (DESIGN.md section 9).
  Precision precision = Precision::bf16;
  // Under fp8_blockwise, the format of the weight-gradient GEMMs (steps 8-9): bf16 (unquantised operands, in the
  // input dtype) or fp8_blockwise (both operands quantised 128x1 along the token dimension, per expert). Ignored
  // under bf16.
  Precision weight_grad_precision = Precision::bf16;
  // Under fp8_blockwise, the format of the dgated GEMM's operands (step 7, G = dO W2^T): bf16 (the stored dO and W2;
  // default: ds, dx and dW1 within the precision gate, docs/ALGORITHM.md) or fp8_blockwise (dO 1x128, W2^T 128x128;
  // 0-4% faster backward on an H100, ds 0.2 points past the gate). Either way the saved Z is read in FP8 and dZ leaves
  // quantised 1x128 for step 10a. Ignored under bf16.
  Precision dgated_precision = Precision::bf16;
  // Order of W1's rows (and b1's, dW1's, db1's) for GLU activations: interleaved gate/up pairs (default),
  // concatenated [gate; up] halves, or separate gate and up tensors (W1Layout in sonicmoe/types.h; MoEWeights::w1_up).
  // All run on the cpu and cuda backends without a copy of W1 (the cuda GEMMs read a concatenated or separate W1
  // through a 4-mode TMA descriptor in the interleaved order and write dW1 through its store twin; Z stays interleaved,
  // internal to the layer): the interleaved layer's values on the permuted weights (DESIGN.md section 2). Ignored for
  // plain activations (W1 has no halves: the same tensor, MoEWeights::w1 [E, I, H]). Not with precision
  // fp8_blockwise (refused, Error): W1's 128x128 quantisation blocks depend on the row order.
  W1Layout w1_layout = W1Layout::interleaved;
  // The layout the stages get: w1_layout for GLU activations, interleaved otherwise.
  W1Layout effective_w1_layout() const { return is_glu(activation) ? w1_layout : W1Layout::interleaved; }
  // Width of Z and of W1's rows: 2I for GLU activations, I otherwise.
  std::int64_t z_width() const { return is_glu(activation) ? 2 * intermediate_size : intermediate_size; }
};

struct Fp8ExpertWeights;  // sonicmoe/quant.h

// Parameters, in the original module's layout (DESIGN.md section 1). All of one dtype (bf16 or f32).
struct MoEWeights {
  TensorView router;  // Wr [E, H]; not given for general routing
  TensorView w1;      // [E, z_width, H], rows in MoEConfig::w1_layout's order; W1Layout::separate: the gate [E, I, H]
  TensorView b1;      // [E, z_width] (only with add_bias), in the same order; W1Layout::separate: the gate's [E, I]
  TensorView w2;      // [E, H, I]
  TensorView b2;      // [E, H] (only with add_bias)
  // fp8_blockwise only, optional: W1 and W2 already quantised (fp8_quantize_expert_weights, sonicmoe/quant.h), used
  // instead of quantising w1 / w2 in the call; must be of the same weights (w1 / w2 stay required: the bf16
  // weight-gradient path and the checks read them). Ignored under bf16.
  const Fp8ExpertWeights* fp8 = nullptr;
  // W1Layout::separate only (a GLU activation): the up half [E, I, H] and its bias [E, I] (with add_bias). The pair
  // (w1, w1_up) must satisfy w1_separate_view's address rule, and so must (b1, b1_up). Not given otherwise. (Last,
  // so that the aggregate initialisations {router, w1, b1, w2, b2} keep their meaning.)
  TensorView w1_up;
  TensorView b1_up;
  // Optional: a framework's fp32 main_grad of w1 / w2 / the router (f32, the weight's shape, contiguous, on its
  // device; W1Layout interleaved or concatenated). Every backward adds the weight's gradient into it
  // (GradWrite::accumulate: on the cuda backend in the weight-gradient GEMM's epilogue, the fp32 sums never rounded to
  // 16 bits; deterministic) and returns that dw1 / dw2 / drouter undefined (no 16-bit gradient buffer). The biases
  // keep their gradients. router_main_grad only where the layer has a router (not general routing nor the dispatched
  // entries).
  TensorView w1_main_grad;
  TensorView w2_main_grad;
  TensorView router_main_grad;
};

// How logits become scores under top-K routing (RouterSpec).
enum class ScoreFunction : int { softmax = 0, sigmoid = 1 };

// The router of top-K routing (DESIGN.md section 4, "Routers"; Hugging Face names in the comments). The default is
// this library's top-K: the K largest logits, weights = softmax over those K (Mixtral, is_softmax_over_topk).
// Otherwise: s = softmax over all E (softmax_over_topk = false) or sigmoid(logit); an expert is picked by
// s + e_score_correction_bias (the bias steers the choice only), optionally inside the best topk_group of n_group
// groups; weights w_k = s_k, divided by sum_j s_j when norm_topk_probs (+1e-20 under sigmoid), then times
// routed_scaling_factor. The backward runs through the scores to the logits; the bias gets no gradient.
struct RouterSpec {
  ScoreFunction score_function = ScoreFunction::softmax;  // scoring_func
  bool softmax_over_topk = true;       // softmax only: weights = softmax over the K selected logits (selection by
                                       // logit); false: s = softmax over all E, selection by s (+ bias)
  bool norm_topk_probs = false;        // norm_topk_prob: weights renormalised over the K picks
  std::int64_t n_group = 1;            // experts in n_group equal groups of E / n_group (1: no groups)
  std::int64_t topk_group = 1;         // groups kept per token, ranked by the sum of their two best s + bias
  float routed_scaling_factor = 1.0f;  // multiplies every weight
  TensorView e_score_correction_bias;  // optional f32 [E] on the context's device: selection only, no gradient
  // > 0: every expert takes at most C = expert_capacity(T, K, E) = ceil(T*K / E * capacity_factor) pairs (capped at
  // T), the first C in pair order p = t*K + k (earlier tokens first); the others are dropped: they get no row (no GEMM
  // work), add nothing to the output and get no gradient. The kept pairs' weights are the router's, unchanged.
  // 0: no capacity.
  double capacity_factor = 0.0;
  // The router's scoring and selection are this library's default top-K (the capacity aside).
  bool scores_default() const {
    return score_function == ScoreFunction::softmax && softmax_over_topk && n_group == 1 &&
           routed_scaling_factor == 1.0f && !e_score_correction_bias.given();
  }
  bool is_default() const { return scores_default() && capacity_factor == 0.0; }
  bool has_capacity() const { return capacity_factor > 0.0; }
  // C of capacity_factor for T tokens, K picks, E experts (DESIGN.md section 4 "Capacity"): the rule of Megatron-LM's
  // get_capacity(T*K, E, capacity_factor), computed in double, capped at T (a token picks an expert at most once).
  std::int64_t expert_capacity(std::int64_t T, std::int64_t K, std::int64_t E) const;
};

// Which routing a forward uses. General routing takes the caller's (token, expert, score) triples,
// sorted by token (non-decreasing), N of them; experts per token may vary (also zero).
struct RoutingSpec {
  RoutingMode mode = RoutingMode::topk;
  std::int64_t tile = 128;  // token-rounding tile (multiple of rows every expert gets)
  TensorView token;         // int32 [N]   (general)
  TensorView expert;        // int32 [N]   (general)
  TensorView score;         // f32   [N]   (general)
  RouterSpec router;        // topk only (token rounding and general routing refuse a non-default router)
};

// Step 3: routing metadata over N (token, expert) pairs. A pair p (in token order; p = t*K + k under
// top-K) lands in sorted row r: rows are grouped by expert, and inside an expert ordered by p (stable).
// Under the cuda backend with token rounding N is a capacity: the valid row count is offsets[E].
struct RoutingMetadata {
  std::int64_t num_tokens = 0;   // T
  std::int64_t num_experts = 0;  // E
  std::int64_t num_pairs = 0;    // N (capacity of the pair arrays)
  Tensor counts;                 // int32 [E]    rows of expert e
  Tensor offsets;                // int32 [E+1]  exclusive scan of counts
  Tensor pair;                   // int32 [N]    row r -> pair p
  Tensor gather;                 // int32 [N]    row r -> token t of pair[r]
  Tensor rev;                    // int32 [N]    pair p -> row r
  Tensor token_offsets;          // int32 [T+1]  pairs of token t are [token_offsets[t], token_offsets[t+1])
  // Under a capacity (RouterSpec::capacity_factor > 0; otherwise both undefined) the pairs beyond their expert's
  // capacity have no row: rev[p] = -1, counts are the kept pairs, offsets[E] <= N and rows [offsets[E], N) are unused.
  Tensor demand;                 // int32 [E]    pairs that chose expert e before the capacity (the aux loss's f_e)
  Tensor dropped;                // int32 [1]    pairs dropped: sum over e of demand[e] - counts[e]
};

// Steps 1-3 (+ token rounding): everything the layer knows about where tokens go.
struct Routing {
  RoutingMode mode = RoutingMode::topk;
  std::int64_t top_k = 0;
  Tensor logits;       // f32 [T, E]   router logits (topk, rounding)
  Tensor topk_expert;  // int32 [T, K] the router's top-K choice (topk, rounding)
  Tensor topk_score;   // f32 [T, K]   combine weights: softmax over the K selected logits (default router)
  Tensor pair_token;   // int32 [N]
  Tensor pair_expert;  // int32 [N]
  Tensor pair_score;   // f32 [N]      combine weight s of each pair
  Tensor pair_slot;    // int32 [N]    k if the pair is the token's k-th top-K choice, else -1 (rounding)
  Tensor aux_loss;     // f32 [1]      switch load-balancing loss (topk, rounding); zero for general
  RoutingMetadata meta;
  RouterSpec router;   // the router that chose (topk); its bias view is dropped (the backward does not read it)
};

// What forward keeps for backward: exactly Z, the routing, and nothing of size [N, H]. X and the weights
// are not copied; the caller passes the same X and weights to backward.
struct SavedState {
  MoEConfig config;
  Routing routing;
  Tensor z;        // [N, z_width], dtype of X (bf16 precision; not defined under fp8_blockwise)
  Tensor z_fp8;    // fp8_blockwise: Z quantised 1x128, f8e4m3 [N, z_width]
  Tensor z_scale;  // fp8_blockwise: its scales, f32 [N, z_width / 128]
  // fp8_blockwise, when the forward quantised W1 and W2 itself (no MoEWeights::fp8): the backward's weight operands,
  // the transposed copies that fp8_quantize_blocks wrote in the forward's pass over each weight (sonicmoe/quant.h,
  // Fp8ExpertWeights::w1_t ... w2_scale_t), so that the backward quantises nothing. Not defined otherwise (bf16, or
  // pre-quantised weights: the backward reads the caller's MoEWeights::fp8 again). They are per layer, not per
  // token: E * (z_width * H + H * I) bytes of codes plus their scales, kept from the forward to the backward.
  Tensor w1_t_fp8;    // W1^T codes, f8e4m3 [E, H, z_width]
  Tensor w1_t_scale;  // its scales, f32 [E, H / 128, z_width / 128]
  Tensor w2_t_fp8;    // W2^T codes, f8e4m3 [E, I, H]
  Tensor w2_t_scale;  // its scales, f32 [E, I / 128, H / 128]
};

// Bytes held by a saved state's tensors: Z (or the FP8 Z and its scales), the routing and, under fp8_blockwise, the
// forward's quantised transposed weights when it kept them.
std::size_t saved_state_bytes(const SavedState& saved);

struct ForwardResult {
  Tensor output;    // [T, H], dtype of X
  Tensor aux_loss;  // f32 [1] (same as saved.routing.aux_loss)
  SavedState saved;
};

// The experts' weight gradients, part of every backward's result (Gradients here, DispatchedGradients in
// sonicmoe/dispatched.h, EPGradients in sonicmoe/ep.h: there E is the local experts).
// dw1 / dw2 are undefined where MoEWeights::w1_main_grad / w2_main_grad received them (drouter: router_main_grad).
struct ExpertWeightGradients {
  Tensor dw1;  // [E, z_width, H] (rows in MoEConfig::w1_layout's order, as W1); W1Layout::separate: [2, E, I, H],
               // dw1[0] the gate's gradient, dw1[1] the up's (each contiguous [E, I, H])
  Tensor db1;  // [E, z_width]   (add_bias; as b1); W1Layout::separate: [2, E, I] (gate, up)
  Tensor dw2;  // [E, H, I]
  Tensor db2;  // [E, H]         (add_bias)
};

struct Gradients : ExpertWeightGradients {
  Tensor dx;       // [T, H]
  Tensor drouter;  // [E, H]         (topk, rounding)
  Tensor dscore;   // f32 [N]        gradient of every pair's score (all modes; the input for general)
};

// W1Layout::separate: the view of a gate / up pair that the stages take (stages.h): [2, E, I, H] for W1 (or
// [2, E, I] for b1) with strides (up - gate, then the pair's own row-major strides), so part p of it is the gate
// (p = 0) or the up (p = 1) tensor. Throws Error naming both arguments (and their addresses) unless both are given,
// of one dtype, shape and device, contiguous, and w1_separate_addresses_ok holds on their device.
TensorView w1_separate_view(const char* fn, const char* gate_name, const TensorView& gate, const char* up_name,
                            const TensorView& up);
// The address rule of W1Layout::separate (DESIGN.md section 2, "Other W1 layouts"): up lies above gate, past its
// end (the two do not overlap); on a cuda device also by a multiple of 16 bytes below 2^40 bytes (the part stride of the GEMMs' 4-mode TMA descriptor: TMA
// strides are unsigned multiples of 16 bytes, < 2^40). Two halves of one [2, E, I, H] allocation satisfy it when
// E * I * H elements fill whole 16 bytes (always under the cuda backend's sizes: H and I multiples of 8); two
// independent allocations only by chance (the PyTorch binding then copies them into one such allocation).
bool w1_separate_addresses_ok(const void* gate, const void* up, Device device);

// Checks a config (positive sizes, K <= E, sizes within the int32 limit below, ...); throws Error naming the field.
void validate_config(const MoEConfig& cfg);

// The library's index contract, on every backend: the kernels index rows and the GEMM dimensions with int32 and
// element offsets with int64. Entry points reject larger problems (Error naming the quantity).
constexpr std::int64_t kMaxDim = 2147483647;       // E, H, I, z_width (2^31 - 1)
constexpr std::int64_t kMaxRows = kMaxDim - 4096;  // T and N (pairs): int32 rows, less the cuda metadata's headroom

// Which part of a training step moe_memory_estimate covers.
enum class MemoryPass : int {
  forward,          // moe_forward: its result (output, saved Z and routing) and its scratch
  backward,         // moe_backward (const& state): the gradients and its scratch (the saved state already exists);
                    // the overload that consumes the state needs one [N, z_width] buffer less
  forward_backward, // one forward, then one backward while the forward's result is alive
  inference         // moe_inference: the output, the routing and its scratch
};

// Peak bytes the layer itself allocates for T tokens of `dtype` under `spec` (not X, the weights or d_out, which
// the caller holds). Token rounding counts its upper bound on pairs, min(T*E, T*K + E*min(tile-1, T)); general
// routing reads N from spec.token's length. Validates cfg, T and the index contract (Error names the quantity).
// moe_forward / moe_backward on the cpu backend compare their pass against the host's available memory. Under
// cfg.precision = fp8_blockwise: the cuda FP8 layer's buffers, the saved Z in FP8, the quantised operands and the
// weights it quantises in the call (counted as if MoEWeights::fp8 were not given, an upper bound when it is): the
// training forward quantises W1 and W2 with their transposed copies and keeps the copies in its saved state
// (SavedState::w1_t_fp8 ...; counted in forward), which the backward reads, so backward counts no weights;
// inference quantises them without the copies.
std::size_t moe_memory_estimate(const MoEConfig& cfg, std::int64_t T, DType dtype, const RoutingSpec& spec = {},
                                MemoryPass pass = MemoryPass::forward_backward);

// Steps 1-3: router + top-K (or token rounding) + metadata, or metadata for general triples.
Routing route(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const TensorView& router_weight,
              const RoutingSpec& spec);

// dL/d(aux_loss): a host value, or a one-element f32 tensor on the context's device that the kernels read (no
// host read, so a backward that takes it stays CUDA-graph capturable; the PyTorch binding passes autograd's
// gradient of aux_loss so). A zero host value skips the aux term; a tensor always adds it.
struct AuxLossGrad {
  float value = 0.0f;
  TensorView tensor;  // when given: [1] f32 on ctx's device, and `value` is not used
  AuxLossGrad(float v = 0.0f) : value(v) {}            // NOLINT(google-explicit-constructor): a float converts
  AuxLossGrad(const TensorView& t) : tensor(t) {}      // NOLINT(google-explicit-constructor)
};

// The whole forward (steps 1-6) and backward (steps 7-11). `d_aux_loss` is dL/d(aux_loss).
ForwardResult moe_forward(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                          const RoutingSpec& spec = {});
// Backward that leaves `saved` intact (it can be run again).
Gradients moe_backward(const Context& ctx, const TensorView& x, const MoEWeights& w, const SavedState& saved,
                       const TensorView& d_out, const AuxLossGrad& d_aux_loss = {});
// Backward that consumes `saved`: dZ is written over saved.z, so the peak holds one [N, z_width] buffer instead
// of two (pass std::move(f.saved) when the forward's state is not needed again). Under precision fp8 on the GPU, dZ's
// 1x128 codes and scales (the dXe GEMM's operand) are written over saved.z_fp8 / z_scale instead.
Gradients moe_backward(const Context& ctx, const TensorView& x, const MoEWeights& w, SavedState&& saved,
                       const TensorView& d_out, const AuxLossGrad& d_aux_loss = {});

// The backward in two parts, for callers that overlap communication with the weight gradients (the
// expert-parallel layer, DESIGN.md section 10: dx travels back by all-to-all while dW1 and dW2 are computed).
// moe_backward_activations runs steps 7 (dgated), 10 (dX) and 11 (router): the result has dx, dscore and drouter,
// and no weight gradients; it leaves dZ and A*s in `keep` (dZ written over saved.z when dz_over_z, as the
// consuming moe_backward does: saved.z is then dZ, and `keep.dz` shares its memory). moe_backward_weights runs
// steps 8 (dW2, db2) and 9 (dW1, db1) from the same saved state (only its routing is read), d_out and `keep`.
// Together they compute what moe_backward computes, bitwise (the same stages on the same operands; dgated is not
// run twice). Peak memory: A*s [N, I] lives until part 2 (moe_backward drops it before dX). With dw2_in_part1, part 1
// also runs step 8 (dw2, db2 in its result) and keeps no A*s (keep.as undefined): moe_backward's peak, and part 2
// runs step 9 only (it skips step 8 when keep.as is not given). bf16 precision only.
struct WeightGradOperands {
  Tensor dz;  // [N, z_width]
  Tensor as;  // [N, I]
};
Gradients moe_backward_activations(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                   const SavedState& saved, const TensorView& d_out, WeightGradOperands& keep,
                                   const AuxLossGrad& d_aux_loss = {}, bool dz_over_z = false,
                                   bool dw2_in_part1 = false);
ExpertWeightGradients moe_backward_weights(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                           const SavedState& saved, const TensorView& d_out,
                                           const WeightGradOperands& keep);

// Forward for inference (steps 1-6): only the output [T, H]. Keeps no state for a backward, and drops Z right
// after the up-projection (peak max(Z + A, A + Y) instead of the training forward's Z + A + Y).
// dropped (optional): gets the pairs the router's capacity factor dropped (RoutingMetadata::dropped, int32 [1] on
// x's device, no host read); undefined without a capacity.
Tensor moe_inference(const Context& ctx, const MoEConfig& cfg, const TensorView& x, const MoEWeights& w,
                     const RoutingSpec& spec = {}, Tensor* dropped = nullptr);

// Checks a saved state that comes from outside this library's own forward (e.g. handed back through an FFI) before
// a backward indexes with it: shapes, and every index array's values (offsets consistent with counts, pair / rev
// inverse permutations, gather and pair_token agreeing, ids in range). Throws Error naming the first bad entry.
// Copies the index arrays to the host: synchronises ctx.stream on the GPU.
void validate_saved_state(const Context& ctx, const SavedState& saved, std::int64_t num_tokens);

// FLOPs of the expert GEMMs of one forward (DESIGN.md section 8): 2*N*H*(z_width + I).
double moe_forward_flops(const MoEConfig& cfg, std::int64_t num_pairs);

}  // namespace sonicmoe

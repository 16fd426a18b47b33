// Entries for tokens a training framework has already dispatched to this rank's experts (DESIGN.md section 10).
// Both run the layer's general routing (section 4) over the local experts and return the gradient of the
// routing weights; neither has a router or an aux loss.
//
//   DeepEP normal dispatch: recv_x [N, H], recv_topk_idx int32 [N, K] (local expert ids, -1 where the expert is on
//     another rank), recv_topk_weights f32 [N, K]. out[n] = sum over k with idx[n, k] >= 0 of
//     weights[n, k] * expert_{idx[n, k]}(recv_x[n]). Rows are not expanded per expert: the pairs with id -1 are
//     dropped before the GEMMs. Backward: dx, the weight gradients and d(weights) [N, K] (zero where idx = -1).
//   DeepEP FP8 dispatch (moe_forward_deepep_fp8): recv_x as e4m3 codes [N, H] with one f32 scale per 1x128 block
//     [N, H / 128] (Fp8Rows, sonicmoe/quant.h), under MoEConfig::precision = fp8_blockwise: the FP8 layer reads the
//     codes as its quantised X (no quantisation of X in the call; bitwise moe_forward_deepep on an X whose 1x128
//     quantisation these codes are). Its backward (moe_backward_dispatched_fp8) takes the codes again and uses
//     their dequantised values, in the weights' dtype, for dW1; dx comes back in the weights' dtype (bf16 on the
//     cuda backend), as DeepEP's combine sends gradients back.
//   Megatron-Core / torchtitan experts: x_perm [N, H] with the rows of local expert 0 first, then expert 1, ...;
//     tokens_per_expert int32 [E_local] (or offsets int32 [E_local + 1], offsets[0] = 0), on the host or on the
//     context's device; probs f32 [N]. out[r] = probs[r] * expert_{e(r)}(x_perm[r]), same order. Backward: dx, the
//     weight gradients and d(probs) [N].
//
// MoEConfig: num_experts = E_local, hidden_size, intermediate_size, activation, add_bias (top_k is not used).
// MoEWeights: w1 [E_local, z_width, H], w2 [E_local, H, I] (+ biases); no router.
//
// Validation (Error naming the argument): shapes, dtypes and devices always; O(E) checks always (tokens_per_expert
// or offsets on the host: non-negative, summing to N; DispatchedOptions::num_pairs within [0, N K]); the full scans
// (every id in [-1, E_local), the count of ids >= 0 equal to num_pairs, device counts summing to N) always on the
// cpu backend (the pairs are built on the host there anyway) and with `debug` on the cuda backend (a host copy).
//
// Host synchronisation on the cuda backend: none for the Megatron contract and none for DeepEP when num_pairs is
// given (DeepEP's dispatch reports it; the expert-parallel layer exchanges it); without it, one read of the count of
// ids >= 0 (the general-routing pair arrays are sized by it). Without `debug`, a contract the cuda backend cannot
// check for free is not reported, only kept memory-safe: an id outside [-1, E_local) counts as -1, rows past the
// counts' sum go to the last expert, pairs past the true count of a too-large num_pairs get score 0.
#pragma once

#include <cstdint>

#include "sonicmoe/moe.h"
#include "sonicmoe/quant.h"

namespace sonicmoe {

struct DispatchedOptions {
  std::int64_t num_pairs = -1;  // DeepEP: the number of ids >= 0 when the caller knows it (-1: counted)
  bool debug = false;           // full contract scans on the cuda backend (host copies)
};

enum class DispatchContract : int { deepep = 0, permuted = 1 };

// What the forward returns and the backward needs (besides x and the weights, passed again as for moe_backward).
struct DispatchedForward {
  DispatchContract contract = DispatchContract::deepep;
  std::int64_t rows = 0;  // N
  std::int64_t k = 0;     // K (deepep), 1 (permuted)
  Tensor output;          // [N, H], dtype of x
  SavedState saved;       // the general-routing state over the local experts (empty when N = 0)
  Tensor pair_slot;       // deepep: int32 [P], pair p's slot n*K + k in recv_topk_idx
};

// dw1, db1, dw2, db2 (ExpertWeightGradients): over the E_local experts.
struct DispatchedGradients : ExpertWeightGradients {
  Tensor dx;        // [N, H]
  Tensor dweights;  // f32: deepep [N, K] (0 where idx = -1); permuted [N]
};

DispatchedForward moe_forward_deepep(const Context& ctx, const MoEConfig& cfg, const TensorView& recv_x,
                                     const TensorView& recv_topk_idx, const TensorView& recv_topk_weights,
                                     const MoEWeights& w, const DispatchedOptions& opt = {});

DispatchedForward moe_forward_permuted(const Context& ctx, const MoEConfig& cfg, const TensorView& x_perm,
                                       const TensorView& tokens_per_expert, const TensorView& probs,
                                       const MoEWeights& w, const DispatchedOptions& opt = {});

// recv_x given in FP8 (DeepEP's FP8 dispatch); cfg.precision must be fp8_blockwise; w in bf16 (or f32 on the cpu
// backend). The result's output and saved state are in the weights' dtype.
DispatchedForward moe_forward_deepep_fp8(const Context& ctx, const MoEConfig& cfg, const Fp8Rows& recv_x,
                                         const TensorView& recv_topk_idx, const TensorView& recv_topk_weights,
                                         const MoEWeights& w, const DispatchedOptions& opt = {});

// Backward of either forward: x is its recv_x / x_perm, d_out [N, H].
DispatchedGradients moe_backward_dispatched(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                            const DispatchedForward& fwd, const TensorView& d_out);

// The layer on tokens given in FP8 with general routing (the pairs of RoutingSpec, mode general; what
// moe_forward_deepep_fp8 runs, and the PyTorch binding's FP8 DeepEP entry): moe_forward under cfg.precision =
// fp8_blockwise with X's 1x128 quantisation given as xq (codes [T, H], scales [T, H / 128]) instead of X; bitwise
// moe_forward on an X that quantises to xq. Output and saved state in the weights' dtype (bf16; f32 too on the cpu
// backend). The backward is moe_backward with X = the dequantised rows.
ForwardResult moe_forward_general_fp8(const Context& ctx, const MoEConfig& cfg, const Fp8Rows& xq,
                                      const MoEWeights& w, const RoutingSpec& spec);

// Backward of moe_forward_deepep_fp8: x is its recv_x (codes and scales), d_out [N, H] in the weights' dtype.
DispatchedGradients moe_backward_dispatched_fp8(const Context& ctx, const Fp8Rows& x, const MoEWeights& w,
                                                const DispatchedForward& fwd, const TensorView& d_out);

// The same backward in two parts (moe_backward_activations / moe_backward_weights of sonicmoe/moe.h), for a caller
// that sends dx back to its source ranks while the weight gradients run: part 1 returns dx and dweights (and, with
// dw2_in_part1, dw2 / db2) and leaves dZ and A*s in `keep`; part 2 returns the remaining weight gradients from them
// (dw2 / db2 only when keep.as is given; zeros for N = 0). Together bitwise moe_backward_dispatched's results. `fwd`
// is left intact (dZ gets its own buffer). MoEConfig::precision bf16 only.
DispatchedGradients moe_backward_dispatched_activations(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                                        const DispatchedForward& fwd, const TensorView& d_out,
                                                        WeightGradOperands& keep, bool dw2_in_part1 = false);
ExpertWeightGradients moe_backward_dispatched_weights(const Context& ctx, const TensorView& x, const MoEWeights& w,
                                                      const DispatchedForward& fwd, const TensorView& d_out,
                                                      const WeightGradOperands& keep);

}  // namespace sonicmoe

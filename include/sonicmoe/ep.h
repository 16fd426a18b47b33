// Expert parallelism (DESIGN.md section 10): the layer with its E experts split over the R ranks of a communicator,
// rank r holding experts [r E/R, (r+1) E/R). The transport is an abstract Communicator: an in-process one (R ranks
// as R threads of one process, host memory: the CPU tests) and an NCCL one (an ncclComm_t, device memory; built when
// CMake finds NCCL, SONICMOE_NCCL).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "sonicmoe/dispatched.h"
#include "sonicmoe/moe.h"

namespace sonicmoe {

// Collectives over the ranks of a group. Every rank calls each collective in the same order (blocking semantics on
// the host for the in-process one; stream-ordered on `stream` for NCCL). Tensors are contiguous, on device().
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;  // where the buffers it exchanges live
  // Rows along dim 0 (a row: the product of the other dims, one dtype): the send_rows[r] rows of `send` starting at
  // sum(send_rows[0..r)) go to rank r; the recv_rows[r] rows from rank r land in `recv` in rank order.
  // send_rows[r] on this rank must equal recv_rows[this rank] on rank r.
  virtual void all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_rows,
                            const TensorView& recv, const std::vector<std::int64_t>& recv_rows, void* stream) = 0;
  // In place: data = the elementwise sum of every rank's data (f32 or i32; the same on every rank).
  virtual void all_reduce_sum(const TensorView& data, void* stream) = 0;
};

// R ranks as R threads of this process, exchanging host memory (the cpu backend). Deterministic: sums run in rank
// order. run_in_process(R, fn) starts R threads, calls fn(comm) with each rank's communicator, joins them and
// rethrows the first exception; a rank that throws aborts the group (the others' next collective throws Error
// instead of waiting forever).
void run_in_process(int world_size, const std::function<void(Communicator&)>& fn);

// An NCCL communicator over `nccl_comm` (an ncclComm_t whose ranks each own one GPU, `device_index` here). Throws
// Error when the library was built without NCCL (nccl_available() is false).
std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm, int device_index);
bool nccl_available();

// What the forward keeps for the backward (besides x and the weights, passed again).
struct EPSavedState {
  MoEConfig config;                  // the whole layer: num_experts = E (all ranks)
  Routing routing;                   // this rank's router and top-K over its T tokens (undefined when T = 0)
  Tensor counts_all;                 // int32 [E]: top-K rows of every expert over the group
  std::int64_t tokens_all = 0;       // tokens of the group
  RoutingMetadata combine;           // pairs (token, destination rank) in token order; rows = sent rows
  std::vector<std::int64_t> send_rows, recv_rows;  // rows to / from each rank
  std::vector<std::int32_t> slot_row;  // [T*K]: the sent row that carries token t's slot k
  Tensor recv_x;                     // [N_recv, H]: the rows this rank's experts received
  DispatchedForward local;           // the local experts over the received rows (DeepEP contract)
};

struct EPForwardResult {
  Tensor output;    // [T, H], dtype of x
  Tensor aux_loss;  // f32 [1]: the switch loss of the group's whole batch (the same on every rank)
  EPSavedState saved;
};

// dw1, db1, dw2, db2 (ExpertWeightGradients): this rank's experts.
struct EPGradients : ExpertWeightGradients {
  Tensor dx;       // [T, H]
  Tensor drouter;  // [E, H]: this rank's share; summed over the ranks it is the whole batch's router gradient
};

// The layer over the group (default top-K router; top_k from cfg). x [T, H] is this rank's tokens (T may differ
// between ranks, 0 included). w.router [E, H] (every rank the same), w.w1 [E/R, z_width, H], w.w2 [E/R, H, I]
// (+ biases [E/R, ...]): this rank's experts. Steps: router and top-K locally (route); f and T all-reduced;
// each token sent once to every rank holding at least one of its experts, with its K ids local to that rank (-1
// otherwise) and weights (DeepEP's convention); the local experts through moe_forward_deepep; the outputs sent back
// and summed per token in rank order (aggregate: deterministic, no atomics). aux_loss as ExpertParallelMoE's
// (python/sonicmoe_cpp/ep.py): E * sum_e (P_e / T) * (f_e / sum f) over the group's batch; its gradient in the
// backward is this rank's share. Host reads on the cuda backend (the plan is built on the host): the routing and
// the exchanged counts in the forward, the weights' gradients in the backward. The communicator's device must be
// ctx's device. A rank whose arguments are refused still joins the first collective (the forward's stats
// all-reduce; in the backward, one all-reduce of a flag before the exchanges), so that every rank throws instead of
// waiting for it: the refusing rank its own Error, the others one saying how many ranks "refused their arguments".
EPForwardResult ep_moe_forward(const Context& ctx, Communicator& comm, const MoEConfig& cfg, const TensorView& x,
                               const MoEWeights& w);
// d_aux_loss: dL/d(aux_loss) (a host value). Every rank calls it (the exchanges are collectives).
EPGradients ep_moe_backward(const Context& ctx, Communicator& comm, const TensorView& x, const MoEWeights& w,
                            const EPSavedState& saved, const TensorView& d_out, float d_aux_loss = 0.0f);

}  // namespace sonicmoe

// The expert-parallel layer (include/sonicmoe/ep.h, DESIGN.md section 10) over any Communicator. Rows move in the
// input dtype; the plan (which token goes to which rank, in which row) is built on the host from the top-K ids.
#include "sonicmoe/ep.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "moe/dispatch_util.h"
#include "moe/grad_buffers.h"
#include "sonicmoe/stages.h"
#ifdef SONICMOE_WITH_CUDA
#include "cuda/dispatch/dispatch_kernels.h"
#endif

namespace sonicmoe {

namespace {

using check::Arg;

std::int64_t sum_of(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

// The message of the Error that `checks` throws, or "" when it throws none.
template <class F>
std::string refusal_of(F&& checks) {
  try {
    checks();
  } catch (const Error& e) {
    return e.what();
  }
  return std::string();
}

// After the collective that counted the ranks refusing their arguments: this rank stops too if any did.
void stop_if_refused(const char* fn, std::int32_t refusals) {
  SONICMOE_CHECK(refusals == 0, "sonicmoe::", fn, ": ", refusals, " rank(s) of the group refused their arguments "
                 "(their own errors name them); every rank stops before the exchanges");
}

// dst[j] = src[idx[j]] for the rows of dst; idx int32 on ctx's device.
void gather_rows(const Context& ctx, const TensorView& src, const TensorView& idx, const Tensor& dst) {
  const std::int64_t rows = dst.size(0), cols = dst.size(1);
  if (rows == 0) return;
  if (ctx.backend == Backend::cpu) {
    const std::size_t rb = static_cast<std::size_t>(cols) * dtype_size(src.dtype);
    const std::int32_t* ix = idx.ptr<const std::int32_t>();
    for (std::int64_t j = 0; j < rows; ++j)
      std::memcpy(static_cast<char*>(dst.data()) + j * rb, static_cast<const char*>(src.data) + ix[j] * rb, rb);
  } else {
#ifdef SONICMOE_WITH_CUDA
    cuda::gather_rows_any(ctx, src.data, src.dtype, idx.ptr<const std::int32_t>(), rows, cols, dst.data());
#endif
  }
}

// The local experts' config and weights (no router).
MoEConfig local_config(const MoEConfig& cfg, int R) {
  MoEConfig c = cfg;
  c.num_experts = cfg.num_experts / R;
  c.top_k = 1;
  return c;
}
MoEWeights local_weights(const MoEWeights& w) {
  MoEWeights l = w;
  l.router = TensorView();
  l.router_main_grad = TensorView();  // (the router's step runs here, not in the local experts)
  return l;
}

void check_group(const char* fn, const Context& ctx, const Communicator& comm, const MoEConfig& cfg) {
  check::backend(ctx, fn);
  validate_config(cfg);
  SONICMOE_CHECK(cfg.effective_w1_layout() != W1Layout::separate, "sonicmoe::", fn, ": the expert-parallel layer "
                 "does not take w1_layout separate (give W1 interleaved or concatenated)");
  const int R = comm.size();
  SONICMOE_CHECK(R >= 1 && comm.rank() >= 0 && comm.rank() < R, "sonicmoe::", fn, ": communicator rank ",
                 comm.rank(), " of ", R);
  SONICMOE_CHECK(cfg.num_experts % R == 0, "sonicmoe::", fn, ": config.num_experts = ", cfg.num_experts,
                 " is not divisible by the world size ", R);
  SONICMOE_CHECK(comm.device() == ctx.device(), "sonicmoe::", fn, ": the communicator exchanges memory on ",
                 device_name(comm.device()), " but the context runs on ", device_name(ctx.device()));
}

// The dispatch plan of this rank's T tokens (DeepEP's convention: a token goes once to each rank holding one of its
// experts). Rows are ordered by destination rank, then token.
struct Plan {
  std::vector<std::int64_t> send_rows, send_pairs;  // [R]
  std::vector<std::int32_t> ids;                    // [S, K]: local ids at the destination, -1 elsewhere
  std::vector<float> weights;                       // [S, K]
  std::vector<std::int32_t> slot_row;               // [T, K]: the row carrying slot k of token t
  std::vector<std::int32_t> pair_token, pair_rank;  // combine pairs (t, r) in token order
};

Plan make_plan(const std::vector<std::int32_t>& topk, const std::vector<float>& topw, std::int64_t T, std::int64_t K,
               std::int64_t El, int R) {
  Plan p;
  p.send_rows.assign(static_cast<std::size_t>(R), 0);
  p.send_pairs.assign(static_cast<std::size_t>(R), 0);
  std::vector<std::int32_t> row_of(static_cast<std::size_t>(T * R), -1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t r = topk[static_cast<std::size_t>(t * K + k)] / El;
      ++p.send_pairs[static_cast<std::size_t>(r)];
      row_of[static_cast<std::size_t>(t * R + r)] = 0;
    }
  std::int32_t j = 0;
  for (int r = 0; r < R; ++r)
    for (std::int64_t t = 0; t < T; ++t) {
      std::int32_t& row = row_of[static_cast<std::size_t>(t * R + r)];
      if (row < 0) continue;
      row = j++;
      ++p.send_rows[static_cast<std::size_t>(r)];
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int32_t e = topk[static_cast<std::size_t>(t * K + k)];
        const bool here = e / El == r;
        p.ids.push_back(here ? static_cast<std::int32_t>(e - r * El) : -1);
        p.weights.push_back(here ? topw[static_cast<std::size_t>(t * K + k)] : 0.0f);
      }
    }
  p.slot_row.resize(static_cast<std::size_t>(T * K));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t r = topk[static_cast<std::size_t>(t * K + k)] / El;
      p.slot_row[static_cast<std::size_t>(t * K + k)] = row_of[static_cast<std::size_t>(t * R + r)];
    }
    for (int r = 0; r < R; ++r)
      if (row_of[static_cast<std::size_t>(t * R + r)] >= 0) {
        p.pair_token.push_back(static_cast<std::int32_t>(t));
        p.pair_rank.push_back(r);
      }
  }
  return p;
}

// One all_to_all_v of a [rows, width] tensor made here.
Tensor exchange(const Context& ctx, Communicator& comm, const TensorView& send, const std::vector<std::int64_t>& sr,
                const std::vector<std::int64_t>& rr, std::int64_t width, DType dt) {
  Tensor recv = alloc_on(ctx, {sum_of(rr), width}, dt);
  comm.all_to_all_v(send, sr, recv, rr, ctx.stream);
  return recv;
}

}  // namespace

EPForwardResult ep_moe_forward(const Context& ctx, Communicator& comm, const MoEConfig& cfg, const TensorView& x,
                               const MoEWeights& w) {
  const char* fn = "ep_moe_forward";
  check_group(fn, ctx, comm, cfg);
  const int R = comm.size();
  const std::int64_t E = cfg.num_experts, El = E / R, K = cfg.top_k, H = cfg.hidden_size;
  // This rank's arguments. A rank that refuses them still joins the first collective (the stats all-reduce below)
  // with its refusal counted, so that every rank stops there instead of waiting for it in the next one.
  const std::string refusal = refusal_of([&] {
    Arg(fn, "x", x).given().float_dtype().shape({-1, H}, "[T, H]").on(ctx.device()).contiguous();
    SONICMOE_CHECK(x.dtype != DType::f16, "sonicmoe::", fn,
                   ": argument 'x' has dtype f16; the expert-parallel layer supports bf16 or f32 (f16 is not built)");
    Arg(fn, "router", w.router).given().dtype(x.dtype).shape({E, H}, "[E, H]").on(ctx.device()).contiguous();
    Arg(fn, "w1", w.w1).given().dtype(x.dtype).shape({El, cfg.z_width(), H}, "[E / R, z_width, H]");
  });
  if (!refusal.empty()) {
    std::vector<std::int32_t> stats(static_cast<std::size_t>(E + 2), 0);
    stats[static_cast<std::size_t>(E + 1)] = 1;
    comm.all_reduce_sum(hostcopy::upload(ctx, stats, {E + 2}, DType::i32, ctx.device()), ctx.stream);
    throw Error(refusal);
  }
  const std::int64_t T = x.shape[0];

  EPForwardResult res;
  EPSavedState& s = res.saved;
  s.config = cfg;
  // 1. Router and top-K on this rank's tokens.
  std::vector<std::int32_t> topk, stats(static_cast<std::size_t>(E + 2), 0);  // f, T, refusals
  std::vector<float> topw;
  if (T > 0) {
    s.routing = route(ctx, cfg, x, w.router, RoutingSpec{});
    topk = hostcopy::read<std::int32_t>(ctx, s.routing.topk_expert);
    topw = hostcopy::read<float>(ctx, s.routing.topk_score);
    const auto f = hostcopy::read<std::int32_t>(ctx, s.routing.meta.counts);
    std::copy(f.begin(), f.end(), stats.begin());
  }
  stats[static_cast<std::size_t>(E)] = static_cast<std::int32_t>(T);
  // 2. f (top-K rows per expert) and T over the group; the aux loss as the whole batch's.
  Tensor st = hostcopy::upload(ctx, stats, {E + 2}, DType::i32, ctx.device());
  comm.all_reduce_sum(st, ctx.stream);
  s.counts_all = st.carve(0, {E}, DType::i32);
  const auto group_stats = hostcopy::read<std::int32_t>(ctx, st);
  stop_if_refused(fn, group_stats[static_cast<std::size_t>(E + 1)]);
  s.tokens_all = group_stats[static_cast<std::size_t>(E)];
  // aux_loss over (this rank's logits, the group's f) is E sum_e (P_r,e / T_r)(f_e / F); times T_r, summed over the
  // ranks and divided by the group's T, it is the whole batch's loss.
  float part = 0.0f;
  if (T > 0) {
    Tensor l = alloc_on(ctx, {1}, DType::f32);
    aux_loss(ctx, s.routing.logits, s.counts_all, l);
    part = hostcopy::read<float>(ctx, l)[0] * static_cast<float>(T);
  }
  Tensor aux = hostcopy::upload(ctx, std::vector<float>{part}, {1}, DType::f32, ctx.device());
  comm.all_reduce_sum(aux, ctx.stream);
  const float total = hostcopy::read<float>(ctx, aux)[0];
  res.aux_loss = hostcopy::upload(
      ctx, std::vector<float>{s.tokens_all > 0 ? total / static_cast<float>(s.tokens_all) : 0.0f}, {1}, DType::f32,
      ctx.device());

  // 3. The plan and the counts exchange ([R, 2]: rows, pairs).
  Plan p = make_plan(topk, topw, T, K, El, R);
  s.send_rows = p.send_rows;
  s.slot_row = std::move(p.slot_row);
  std::vector<std::int32_t> sc;
  for (int r = 0; r < R; ++r) {
    sc.push_back(static_cast<std::int32_t>(p.send_rows[static_cast<std::size_t>(r)]));
    sc.push_back(static_cast<std::int32_t>(p.send_pairs[static_cast<std::size_t>(r)]));
  }
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(R), 1);
  Tensor sct = hostcopy::upload(ctx, sc, {R, 2}, DType::i32, ctx.device());
  const auto rc = hostcopy::read<std::int32_t>(ctx, exchange(ctx, comm, sct, ones, ones, 2, DType::i32));
  std::int64_t recv_pairs = 0;
  for (int r = 0; r < R; ++r) {
    s.recv_rows.push_back(rc[static_cast<std::size_t>(2 * r)]);
    recv_pairs += rc[static_cast<std::size_t>(2 * r + 1)];
  }
  const std::int64_t S = sum_of(s.send_rows);

  // 4. Dispatch: rows, local ids, weights. combine.gather[j] is the token of sent row j.
  Tensor send_x = alloc_on(ctx, {S, H}, x.dtype);
  if (T > 0) {
    s.combine = build_metadata(ctx, hostcopy::upload(ctx, p.pair_token, {S}, DType::i32, ctx.device()),
                               hostcopy::upload(ctx, p.pair_rank, {S}, DType::i32, ctx.device()), T, R);
    gather_rows(ctx, x, s.combine.gather, send_x);
  }
  Tensor send_ids = hostcopy::upload(ctx, p.ids, {S, K}, DType::i32, ctx.device());
  Tensor send_w = hostcopy::upload(ctx, p.weights, {S, K}, DType::f32, ctx.device());
  s.recv_x = exchange(ctx, comm, send_x, s.send_rows, s.recv_rows, H, x.dtype);
  Tensor recv_ids = exchange(ctx, comm, send_ids, s.send_rows, s.recv_rows, K, DType::i32);
  Tensor recv_w = exchange(ctx, comm, send_w, s.send_rows, s.recv_rows, K, DType::f32);

  // 5. The local experts (DeepEP contract; the pair count came with the counts: no count on the device).
  DispatchedOptions opt;
  opt.num_pairs = recv_pairs;
  s.local = moe_forward_deepep(ctx, local_config(cfg, R), s.recv_x, recv_ids, recv_w, local_weights(w), opt);

  // 6. Combine: the partial sums back to their source, summed per token in rank order (aggregate, no atomics).
  Tensor back = exchange(ctx, comm, s.local.output, s.recv_rows, s.send_rows, H, x.dtype);
  res.output = alloc_on(ctx, {T, H}, x.dtype);
  if (T > 0) aggregate(ctx, back, TensorView(), s.combine, res.output);
  return res;
}

namespace {

void check_backward_args(const char* fn, const Context& ctx, const Communicator& comm, const TensorView& x,
                         const EPSavedState& s, const TensorView& d_out) {
  const MoEConfig& cfg = s.config;
  const int R = comm.size();
  const std::int64_t E = cfg.num_experts, K = cfg.top_k, H = cfg.hidden_size;
  Arg(fn, "x", x).given().float_dtype().shape({-1, H}, "[T, H]").on(ctx.device()).contiguous();
  SONICMOE_CHECK(x.dtype != DType::f16, "sonicmoe::", fn,
                 ": argument 'x' has dtype f16; the expert-parallel layer supports bf16 or f32 (f16 is not built)");
  const std::int64_t T = x.shape[0];
  Arg(fn, "d_out", d_out).given().dtype(x.dtype).shape({T, H}, "[T, H]").on(ctx.device()).contiguous();
  SONICMOE_CHECK(static_cast<std::int64_t>(s.slot_row.size()) == T * K && static_cast<int>(s.send_rows.size()) == R,
                 "sonicmoe::", fn, ": argument 'x' has T = ", T, " tokens, but the saved state was made for ",
                 s.slot_row.size() / static_cast<std::size_t>(K), " tokens on ", s.send_rows.size(), " ranks");
  // The state's plan against itself (each array below is indexed by the others): an edited or foreign state fails
  // here instead of reading or writing out of bounds.
  SONICMOE_CHECK(static_cast<int>(s.recv_rows.size()) == R, "sonicmoe::", fn, ": saved.recv_rows has ",
                 s.recv_rows.size(), " entries, expected the world size ", R);
  for (int r = 0; r < R; ++r)
    SONICMOE_CHECK(s.send_rows[static_cast<std::size_t>(r)] >= 0 && s.recv_rows[static_cast<std::size_t>(r)] >= 0,
                   "sonicmoe::", fn, ": saved.send_rows[", r, "] = ", s.send_rows[static_cast<std::size_t>(r)],
                   ", saved.recv_rows[", r, "] = ", s.recv_rows[static_cast<std::size_t>(r)], ", expected >= 0");
  const std::int64_t S = sum_of(s.send_rows), N_recv = sum_of(s.recv_rows);
  for (std::size_t i = 0; i < s.slot_row.size(); ++i)
    SONICMOE_CHECK(s.slot_row[i] >= 0 && s.slot_row[i] < S, "sonicmoe::", fn, ": saved.slot_row[", i, "] = ",
                   s.slot_row[i], ", expected a sent row in [0, ", S, ")");
  Arg(fn, "saved.recv_x", s.recv_x.view()).given().dtype(x.dtype).shape({N_recv, H}, "[sum(recv_rows), H]")
      .on(ctx.device()).contiguous();
  SONICMOE_CHECK(s.local.rows == N_recv, "sonicmoe::", fn, ": saved.local has ", s.local.rows,
                 " rows, expected sum(recv_rows) = ", N_recv);
  Arg(fn, "saved.counts_all", s.counts_all.view()).given().dtype(DType::i32).shape({E}, "[E]").on(ctx.device());
  if (T > 0) {
    SONICMOE_CHECK(s.combine.num_pairs == S, "sonicmoe::", fn, ": saved.combine has ", s.combine.num_pairs,
                   " pairs, expected sum(send_rows) = ", S);
    check::routing_metadata(fn, ctx, s.combine, T, R);
  }
}

}  // namespace

EPGradients ep_moe_backward(const Context& ctx, Communicator& comm, const TensorView& x, const MoEWeights& w,
                            const EPSavedState& s, const TensorView& d_out, float d_aux_loss) {
  const char* fn = "ep_moe_backward";
  const MoEConfig& cfg = s.config;
  check_group(fn, ctx, comm, cfg);
  const std::int64_t E = cfg.num_experts, K = cfg.top_k, H = cfg.hidden_size;
  // This rank's arguments and saved state, checked before the first exchange; the ranks agree on them in one small
  // all-reduce (a refusing rank would otherwise leave the others waiting in the exchange).
  const std::string refusal = refusal_of([&] {
    check_backward_args(fn, ctx, comm, x, s, d_out);
    // the main_grads too: a bad one found in the local backward would raise on this rank after the exchange
    check_router_main_grad(fn, ctx, E, H, w, true);
    check_expert_main_grads(fn, ctx, cfg.effective_w1_layout(), E / comm.size(), cfg.z_width(), H,
                            cfg.intermediate_size, w);
    check_main_grads_disjoint(fn, w, {{"x", x}, {"d_out", d_out}});
  });
  std::vector<std::int32_t> refused{refusal.empty() ? 0 : 1};
  Tensor rt = hostcopy::upload(ctx, refused, {1}, DType::i32, ctx.device());
  comm.all_reduce_sum(rt, ctx.stream);
  if (!refusal.empty()) throw Error(refusal);
  stop_if_refused(fn, hostcopy::read<std::int32_t>(ctx, rt)[0]);
  const std::int64_t T = x.shape[0];
  const std::int64_t S = sum_of(s.send_rows);

  // Mirror of the forward: dO rows to the experts' ranks, the local backward, dX rows and d(weights) back.
  Tensor d_back = alloc_on(ctx, {S, H}, x.dtype);
  if (T > 0) gather_rows(ctx, d_out, s.combine.gather, d_back);
  Tensor d_y = exchange(ctx, comm, d_back, s.send_rows, s.recv_rows, H, x.dtype);
  DispatchedGradients lg = moe_backward_dispatched(ctx, s.recv_x, local_weights(w), s.local, d_y);
  Tensor d_send_x = exchange(ctx, comm, lg.dx, s.recv_rows, s.send_rows, H, x.dtype);
  Tensor d_send_w = exchange(ctx, comm, lg.dweights, s.recv_rows, s.send_rows, K, DType::f32);

  EPGradients g;
  static_cast<ExpertWeightGradients&>(g) = std::move(static_cast<ExpertWeightGradients&>(lg));
  g.dx = alloc_on(ctx, {T, H}, x.dtype);
  if (T == 0) {
    g.drouter = Tensor::zeros({E, H}, x.dtype, ctx.device(), ctx.allocator, ctx.stream);
    return g;
  }
  aggregate(ctx, d_send_x, TensorView(), s.combine, g.dx);  // sum over the token's ranks, in rank order
  // Score gradients of this rank's top-K slots, then the router backward with the group's f and T (aux share).
  const auto dsw = hostcopy::read<float>(ctx, d_send_w);
  std::vector<float> dscore(static_cast<std::size_t>(T * K));
  for (std::int64_t i = 0; i < T * K; ++i)
    dscore[static_cast<std::size_t>(i)] = dsw[static_cast<std::size_t>(s.slot_row[static_cast<std::size_t>(i)] * K + i % K)];
  Routing r = s.routing;
  r.meta.counts = s.counts_all;  // router_backward's aux term: d_aux E f_e / (T F); with T_r / T_all it is the share
  const float d_aux = s.tokens_all > 0 ? d_aux_loss * static_cast<float>(T) / static_cast<float>(s.tokens_all) : 0.0f;
  Tensor dlogits = alloc_on(ctx, {T, E}, DType::f32);
  router_backward(ctx, r, hostcopy::upload(ctx, dscore, {T * K}, DType::f32, ctx.device()), AuxLossGrad(d_aux),
                  dlogits);
  const DwTarget dr = alloc_drouter(ctx, E, H, x.dtype, w, g.drouter);
  router_weight_grad(ctx, dlogits, x, w.router, dr.view, g.dx, dr.write);
  return g;
}

}  // namespace sonicmoe

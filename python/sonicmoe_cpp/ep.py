"""Expert parallelism and entries for tokens a framework has already dispatched (Python, over torch.distributed).

    from sonicmoe_cpp import moe_permuted, moe_deepep, ExpertParallelMoE

- `moe_permuted(x_perm, tokens_per_expert, probs, w1, b1, w2, b2, activation)`: the Megatron-Core / torchtitan
  experts contract (rows already permuted by expert; one probability per row).
- `moe_deepep(recv_x, recv_topk_idx, recv_topk_weights, w1, b1, w2, b2, activation)`: the DeepEP normal-dispatch
  contract (per received row, K local expert ids, -1 for experts of other ranks, and their weights).
- `ExpertParallelMoE`: the `MoE` layer with its experts split over the ranks of a process group (E/R experts per
  rank, router replicated): router and top-K locally, a dispatch all-to-all, the local experts through
  `moe_deepep`, a combine all-to-all. Works with gloo on CPU tensors and NCCL on CUDA tensors.
- `shard_moe_state_dict` / `unshard_moe_state_dicts`: a `MoE` state dict to one rank's shard and back.

All of them run the library's general-routing op (`torch.ops.sonicmoe.forward(..., routing="general")`), whose
autograd returns the gradients of x, the weights and the per-pair scores.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["moe_permuted", "moe_deepep", "ExpertParallelMoE", "shard_moe_state_dict", "unshard_moe_state_dicts"]

_EXPERT_KEYS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")


def _pkg():
    # The package's __init__ imports this module at its end; read its names lazily so the import order of the two
    # files does not matter.
    import sonicmoe_cpp
    return sonicmoe_cpp


def _err(fn, msg):
    return ValueError(f"sonicmoe_cpp.{fn}: {msg}")


def _nonzero(mask, count: Optional[int] = None):
    """mask.nonzero() ([M, mask.dim()], row-major); on a GPU, with the number of True entries known (`count`),
    through torch.nonzero_static, which needs no host sync (plain nonzero where that op is missing)."""
    if count is not None and mask.is_cuda:
        try:
            return torch.nonzero_static(mask, size=count)
        except (NotImplementedError, RuntimeError):
            pass
    return mask.nonzero()


def _check_weights(fn, x, w1, b1, w2, b2):
    """Shapes the experts need before the op sees them (the op validates the rest: dtypes, devices, contiguity)."""
    if x.dim() != 2:
        raise _err(fn, f"argument '{_XNAME[fn]}' has shape {tuple(x.shape)}, expected [N, H]")
    H = x.shape[1]
    if w1.dim() != 3 or w1.shape[2] != H:
        raise _err(fn, f"argument 'w1' has shape {tuple(w1.shape)}, expected [E_local, 2I or I, {H}]")
    if w2.dim() != 3 or w2.shape[0] != w1.shape[0] or w2.shape[1] != H:
        raise _err(fn, f"argument 'w2' has shape {tuple(w2.shape)}, expected [{w1.shape[0]}, {H}, I]")
    if b1 is not None and tuple(b1.shape) != (w1.shape[0], w1.shape[1]):
        raise _err(fn, f"argument 'b1' has shape {tuple(b1.shape)}, expected [{w1.shape[0]}, {w1.shape[1]}]")
    if b2 is not None and tuple(b2.shape) != (w1.shape[0], H):
        raise _err(fn, f"argument 'b2' has shape {tuple(b2.shape)}, expected [{w1.shape[0]}, {H}]")


_XNAME = {"moe_permuted": "x_perm", "moe_deepep": "recv_x"}


def _no_rows(x, w1, b1, w2, b2, scores, accumulate_main_grad=False):
    """The [0, H] output for N = 0 rows (the op needs T >= 1), still connected to every input so that autograd
    returns zero gradients (not None) for the weights, as the op does for an expert without rows. With
    accumulate_main_grad, weights with a `main_grad` are left out (adding zero to main_grad changes nothing)."""
    if accumulate_main_grad:
        w1, b1, w2, b2 = (None if getattr(t, "main_grad", None) is not None else t for t in (w1, b1, w2, b2))
    anchor = sum(t.sum() for t in (x, w1, b1, w2, b2, scores) if t is not None) * 0
    return x.new_zeros((0, x.shape[1])) + anchor.to(x.dtype)


def moe_permuted(x_perm: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
                 b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation="swiglu",
                 debug: bool = False, accumulate_main_grad: bool = False) -> torch.Tensor:
    """Experts over rows already permuted by expert (the Megatron-Core / torchtitan experts contract).

    x_perm [N, H]: the rows of local expert 0 first, then those of expert 1, ...; tokens_per_expert [E_local]
    (integer; on x_perm's device, or on the CPU); probs [N]: each row's routing probability. w1 [E_local, 2I or I,
    H], w2 [E_local, H, I] (+ biases) as in `moe_general_routing`. Returns [N, H] in the same (permuted) order:
    out[r] = probs[r] * expert_{e(r)}(x_perm[r]). Autograd: gradients for x_perm, the weights and probs.

    Built as general routing with one pair per row (token r, expert e(r), score probs[r]); the expert ids come from
    `torch.repeat_interleave(..., output_size=N)`, so no host sync. The contract sum(tokens_per_expert) == N is
    checked when tokens_per_expert is on the CPU (free), and on the device only with debug=True (a device read);
    debug=True also checks that the counts are non-negative. accumulate_main_grad: as `MoE`'s (weights with an fp32
    `main_grad` get their gradient added there, not in .grad).
    """
    fn = "moe_permuted"
    _check_weights(fn, x_perm, w1, b1, w2, b2)
    N, E_local = x_perm.shape[0], w1.shape[0]
    tpe = tokens_per_expert
    if not isinstance(tpe, torch.Tensor) or tpe.dim() != 1 or tpe.shape[0] != E_local:
        shape = tuple(tpe.shape) if isinstance(tpe, torch.Tensor) else type(tpe).__name__
        raise _err(fn, f"argument 'tokens_per_expert' has shape {shape}, expected [E_local] = [{E_local}]")
    if tpe.dtype.is_floating_point or tpe.dtype.is_complex or tpe.dtype == torch.bool:
        raise _err(fn, f"argument 'tokens_per_expert' has dtype {tpe.dtype}, expected an integer dtype")
    if tpe.device != x_perm.device and tpe.device.type != "cpu":
        raise _err(fn, f"argument 'tokens_per_expert' is on {tpe.device}, expected {x_perm.device} (x_perm's "
                       "device) or the CPU")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] != N:
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise _err(fn, f"argument 'probs' has shape {shape}, expected [N] = [{N}] (one per row of x_perm)")
    if not probs.dtype.is_floating_point:
        raise _err(fn, f"argument 'probs' has dtype {probs.dtype}, expected a floating dtype")
    if tpe.device.type == "cpu" or debug:
        if bool((tpe < 0).any()):
            raise _err(fn, f"argument 'tokens_per_expert' has negative counts: {tpe.tolist()}")
        total = int(tpe.sum())
        if total != N:
            raise _err(fn, f"argument 'tokens_per_expert' sums to {total}, expected N = {N} (the rows of x_perm)")
    if N == 0:
        return _no_rows(x_perm, w1, b1, w2, b2, probs, accumulate_main_grad)
    dev = x_perm.device
    expert_idx = torch.repeat_interleave(torch.arange(E_local, device=dev, dtype=torch.int32),
                                         tpe.to(device=dev, dtype=torch.int64), output_size=N)
    token_idx = torch.arange(N, device=dev, dtype=torch.int32)
    return _pkg().moe_general_routing(x_perm, token_idx, expert_idx, probs.to(torch.float32), w1, b1, w2, b2,
                                      activation, accumulate_main_grad=accumulate_main_grad)


def moe_deepep(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, w1: torch.Tensor,
               b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation="swiglu",
               debug: bool = False, accumulate_main_grad: bool = False,
               num_pairs: Optional[int] = None) -> torch.Tensor:
    """Experts over rows received by a DeepEP normal dispatch.

    recv_x [N, H]; recv_topk_idx [N, K] (integer): each row's local expert ids, -1 where the expert lives on another
    rank; recv_topk_weights [N, K] (floating): the matching weights. Returns [N, H]: row n's weighted sum over its
    local experts, sum_k [idx[n, k] >= 0] * weights[n, k] * expert_{idx[n, k]}(recv_x[n]). Autograd: gradients for
    recv_x, the weights and recv_topk_weights (zero where the id is -1).

    Pairs with id -1 are dropped before the op runs, so they cost no GEMM work. Counting the valid pairs is a host
    sync on CUDA (torch.nonzero) unless the caller passes their number as `num_pairs` (DeepEP's dispatch reports
    it; `ExpertParallelMoE` exchanges it with the row counts); a wrong `num_pairs` is caught only with debug=True.
    debug=True checks that every id is in [-1, E_local) (a device read); without it, an id >= E_local is still
    rejected by the op and an id < -1 counts as -1.
    accumulate_main_grad: as `MoE`'s.
    """
    fn = "moe_deepep"
    _check_weights(fn, recv_x, w1, b1, w2, b2)
    N, E_local = recv_x.shape[0], w1.shape[0]
    idx, wts = recv_topk_idx, recv_topk_weights
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != N:
        shape = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise _err(fn, f"argument 'recv_topk_idx' has shape {shape}, expected [N, K] with N = {N}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise _err(fn, f"argument 'recv_topk_idx' has dtype {idx.dtype}, expected an integer dtype")
    if not isinstance(wts, torch.Tensor) or tuple(wts.shape) != tuple(idx.shape):
        shape = tuple(wts.shape) if isinstance(wts, torch.Tensor) else type(wts).__name__
        raise _err(fn, f"argument 'recv_topk_weights' has shape {shape}, expected {tuple(idx.shape)} "
                       "(recv_topk_idx's shape)")
    if not wts.dtype.is_floating_point:
        raise _err(fn, f"argument 'recv_topk_weights' has dtype {wts.dtype}, expected a floating dtype")
    for name, t in (("recv_topk_idx", idx), ("recv_topk_weights", wts)):
        if t.device != recv_x.device:
            raise _err(fn, f"argument '{name}' is on {t.device}, expected {recv_x.device} (recv_x's device)")
    if debug and idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= E_local:
            raise _err(fn, f"argument 'recv_topk_idx' has ids in [{lo}, {hi}], expected -1 or [0, E_local) = "
                           f"[0, {E_local})")
    valid = idx >= 0
    if num_pairs is not None:
        num_pairs = int(num_pairs)
        if not 0 <= num_pairs <= idx.numel():
            raise _err(fn, f"argument 'num_pairs' = {num_pairs}, expected 0 <= num_pairs <= N * K = {idx.numel()}")
        if debug and int(valid.sum()) != num_pairs:
            raise _err(fn, f"argument 'num_pairs' = {num_pairs}, but recv_topk_idx has {int(valid.sum())} ids >= 0")
    if N == 0:
        return _no_rows(recv_x, w1, b1, w2, b2, wts, accumulate_main_grad)
    rows, cols = _nonzero(valid, num_pairs).unbind(1)  # row-major: sorted by row, as general routing needs
    return _pkg().moe_general_routing(recv_x, rows.to(torch.int32), idx[rows, cols].to(torch.int32),
                                      wts[rows, cols].to(torch.float32), w1, b1, w2, b2, activation,
                                      accumulate_main_grad=accumulate_main_grad)


# ------------------------------------------------------------------------------------------------------------------
# Expert-parallel layer


def _group_info(group) -> Tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) when torch.distributed is not initialised and no group is given."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _a2a_raw(x, out_splits: List[int], in_splits: List[int], group):
    import torch.distributed as dist
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAllSingle(torch.autograd.Function):
    """all_to_all_single along dim 0 whose backward is the reverse exchange. (torch.distributed.nn.functional has
    the same; importing that package pulls in torch.distributed.rpc, after which a gloo process aborts at exit
    ("terminate called without an active exception") in about 1 run of 4 with torch 2.11.)"""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _a2a_raw(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_raw(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


class _MainGradSink(torch.autograd.Function):
    """Identity on a parameter whose backward adds the parameter's (whole) gradient into its fp32 `main_grad` and
    gives autograd none (or Megatron's dummy): main_grad accumulation for a weight used by PyTorch ops (the EP
    router) rather than by the sonicmoe op."""

    @staticmethod
    def forward(ctx, param):
        ctx.param = param
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        from ._ops import add_to_main_grad
        return add_to_main_grad(ctx.param, grad)


class _RouterLogits(torch.autograd.Function):
    """fp32 router logits x @ w^T from 16-bit x and w on the GPU: one 16-bit GEMM with fp32 accumulation and output
    (no fp32 copy of x, no fp32 GEMM). Backward as the library's router backward: the fp32 dlogits split into a
    16-bit high and low half, two GEMMs each for dx and dw with fp32 outputs, summed, then cast to x's / w's dtype."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        hi = g.to(x.dtype)
        lo = (g - hi.float()).to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (torch.mm(hi, w, out_dtype=torch.float32) + torch.mm(lo, w, out_dtype=torch.float32)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (torch.mm(hi.t(), x, out_dtype=torch.float32)
                  + torch.mm(lo.t(), x, out_dtype=torch.float32)).to(w.dtype)
        return dx, dw


def _router_logits(x, w):
    """fp32 logits [T, E] of x [T, H] and the router weight w [E, H]."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.shape[0] > 0:
        return _RouterLogits.apply(x, w)
    return F.linear(x.float(), w.float())


def _split_rows(idx, splits):
    return torch.split(idx, splits) if len(splits) > 1 else (idx,)


class _GatherRows(torch.autograd.Function):
    """out = x[idx] where idx is R runs (lengths `splits`), each run's indices distinct (a token is sent to a rank at
    most once). Backward: the runs' rows added back one run at a time, so the sum over runs is deterministic; it is
    exactly _ScatterAddRows, and that one's backward is this gather."""

    @staticmethod
    def forward(ctx, x, idx, splits):
        ctx.idx, ctx.splits, ctx.T = idx, splits, x.shape[0]
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        return _scatter_add_rows(g, ctx.idx, ctx.splits, ctx.T), None, None


class _ScatterAddRows(torch.autograd.Function):
    """out [T, H] = sum over runs r of rows[run r] placed at idx[run r] (in rows' dtype; run by run, deterministic;
    with two runs the sum is the fp32 sum rounded once). Backward: the gather."""

    @staticmethod
    def forward(ctx, rows, idx, splits, T):
        ctx.idx, ctx.splits = idx, splits
        return _scatter_add_rows(rows, idx, splits, T)

    @staticmethod
    def backward(ctx, g):
        return g.index_select(0, ctx.idx), None, None, None


def _scatter_add_rows(rows, idx, splits, T):
    """Run by run: the first run's rows copied into place, each later run's added to what is there by a gather, an
    add and a copy back (no atomics: index_add_ on 16-bit rows runs an element-wise atomic kernel, ~10x slower)."""
    out = rows.new_zeros((T,) + tuple(rows.shape[1:]))
    first = True
    for r_idx, r_rows in zip(_split_rows(idx, splits), _split_rows(rows, splits)):
        if r_idx.numel() == 0:
            continue
        if first:
            out.index_copy_(0, r_idx, r_rows)
            first = False
        else:
            out.index_copy_(0, r_idx, out.index_select(0, r_idx) + r_rows)
    return out


def _a2a(x, out_splits: List[int], in_splits: List[int], group, differentiable: bool):
    """all_to_all_single along dim 0 (autograd-aware when `differentiable`: its backward is the reverse exchange)."""
    if differentiable:
        return _AllToAllSingle.apply(x, out_splits, in_splits, group)
    return _a2a_raw(x, out_splits, in_splits, group)


class ExpertParallelMoE(nn.Module):
    """The `MoE` layer (top-K routing) with its E experts split over the R ranks of `ep_group` (default: the world
    group; without torch.distributed initialised, R = 1). Rank r holds experts [r E/R, (r+1) E/R).

    Parameters, with `MoE`'s names: router.weight [E, H] (replicated: every rank holds the full router; keep the
    replicas equal, e.g. broadcast them at start and reduce their gradients over the group as for any data-parallel
    parameter), c_fc.weight [E/R, 2I or I, H], c_fc.bias [E/R, 2I or I], c_proj.weight [E/R, H, I], c_proj.bias
    [E/R, H]. `shard_moe_state_dict` / `unshard_moe_state_dicts` convert from and to a full `MoE` state dict.

    forward(x) with x [T, H] or [B, S, H] (this rank's tokens; T may differ between ranks, 0 included) returns
    (output of x's shape, aux_loss scalar fp32). The steps, as in docs/DESIGN.md section 10:
      1. router logits in fp32 (on the GPU one 16-bit GEMM with fp32 output), top-K on the logits (ties to the lower
         expert id), softmax over the K — the same routing math as `MoE`;
      2. per-rank row and pair counts exchanged (one all_to_all_single of [R, 2]; read on the host once);
      3. dispatch: each token sent once to every rank that holds at least one of its experts, with its K local
         expert ids (-1 for the experts of other ranks) and their weights (DeepEP's convention);
      4. the local experts run on the received rows through `moe_deepep`;
      5. combine: the rows' partial sums sent back by the reverse all-to-all and summed at the source, rank by
         rank in x's dtype (deterministic; with two ranks, the fp32 sum rounded once).
    Both exchanges of rows go through an autograd-aware all_to_all_single (its backward is the reverse exchange):
    x, the router, the local experts and the routing weights get their gradients.

    aux_loss: `MoE`'s switch loss E * sum_e (P_e / T) * (f_e / sum f) over the group's whole batch (P_e: sum of the
    softmax over all E, f_e: top-K rows of expert e, T: tokens), from one all_reduce of [2E + 1] values. Its value
    is the whole batch's loss on every rank; its gradient is this rank's share (the derivative through this rank's
    tokens only), so the router gradients summed over the ranks equal `MoE`'s on the concatenated batch.

    Every rank of the group must run the forward and, when training, the backward through the output (the reverse
    exchanges are collectives), with the same requires_grad pattern. Host syncs per forward (CUDA): one, the split sizes
    (all_to_all_single takes Python lists; the pair count rides along). Communication is not overlapped with
    the expert GEMMs; the rows are exchanged in x's dtype, the routing weights in fp32.

    accumulate_main_grad=True: as `MoE`'s; the local experts' gradients are added into their `main_grad` by the
    op's backward, the router's (logits and aux loss together) by an identity autograd Function on the weight.
    """

    def __init__(self, num_experts: int, num_experts_per_tok: int, hidden_size: int, intermediate_size: int,
                 activation_function="swiglu", add_bias: bool = False, std: float = 0.02, ep_group=None,
                 accumulate_main_grad: bool = False):
        super().__init__()
        sm = _pkg()
        self.accumulate_main_grad = bool(accumulate_main_grad)
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = sm._layer_sizes(
            "ExpertParallelMoE", num_experts, num_experts_per_tok, hidden_size, intermediate_size)
        self.activation_function = sm.ActivationType(sm._act_name(activation_function))
        self.add_bias = bool(add_bias)
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = _group_info(ep_group)
        if self.num_experts % self.ep_size != 0:
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'num_experts' = {self.num_experts} is not "
                             f"divisible by the expert-parallel world size {self.ep_size}")
        self.num_local_experts = self.num_experts // self.ep_size
        self.local_expert_offset = self.ep_rank * self.num_local_experts
        H, I, El = self.hidden_size, self.intermediate_size, self.num_local_experts
        z_width = 2 * I if sm.is_glu(self.activation_function) else I
        self.router = nn.Linear(H, self.num_experts, bias=False)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.c_fc = sm.Experts(El, H, z_width, self.add_bias, std)
        self.c_proj = sm.Experts(El, I, H, self.add_bias, std)

    @classmethod
    def from_moe(cls, moe, ep_group=None) -> "ExpertParallelMoE":
        """This rank's shard of a full `MoE` (top-K routing), with copies of its weights."""
        if getattr(moe, "routing", "topk") != "topk":
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE.from_moe: the MoE's routing is {moe.routing!r}, "
                             "expected 'topk'")
        if getattr(moe, "_router_args", lambda: None)() is not None:
            raise ValueError("sonicmoe_cpp.ExpertParallelMoE.from_moe: the MoE has a non-default router "
                             f"({moe.extra_repr()}); ExpertParallelMoE routes with the default top-K softmax only")
        ep = cls(moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.activation_function,
                 moe.add_bias, ep_group=ep_group, accumulate_main_grad=getattr(moe, "accumulate_main_grad", False))
        ep = ep.to(device=moe.router.weight.device, dtype=moe.router.weight.dtype)
        ep.load_state_dict(shard_moe_state_dict(moe.state_dict(), ep.ep_rank, ep.ep_size))
        return ep

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The full `MoE` state dict, gathered from every rank of the group (a collective: call it on every rank)."""
        sd = self.state_dict()
        if self.ep_size == 1:
            return {k: v.detach().clone() for k, v in sd.items()}
        import torch.distributed as dist
        shards: List[Dict[str, torch.Tensor]] = [dict() for _ in range(self.ep_size)]
        for k, v in sd.items():
            if k.endswith(_EXPERT_KEYS):
                parts = [torch.empty_like(v) for _ in range(self.ep_size)]
                dist.all_gather(parts, v.detach().contiguous(), group=self.ep_group)
            else:
                parts = [v.detach()] * self.ep_size
            for r in range(self.ep_size):
                shards[r][k] = parts[r]
        return unshard_moe_state_dicts(shards)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states
        shape = x.shape
        if x.dim() not in (2, 3) or shape[-1] != self.hidden_size:
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states' ('x') has shape "
                             f"{tuple(shape)}, expected [T, {self.hidden_size}] or [B, S, {self.hidden_size}]")
        x2 = x.reshape(-1, self.hidden_size)
        T, E, K, R, El = x2.shape[0], self.num_experts, self.top_k, self.ep_size, self.num_local_experts
        dev, group = x2.device, self.ep_group

        # 1. Routing, as the layer does it: fp32 logits, top-K on the logits with ties to the lower expert id (a
        # stable descending sort), softmax over the K selected logits.
        router_w = self.router.weight
        if self.accumulate_main_grad and torch.is_grad_enabled() and router_w.requires_grad \
                and _pkg()._ops.main_grad_params(router_w, None, None, None, None) is not None:
            router_w = _MainGradSink.apply(router_w)  # its gradient (logits and aux loss) goes to main_grad
        logits = _router_logits(x2, router_w)  # [T, E] fp32
        vals, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        topk_ids = order[:, :K]  # [T, K] int64
        topk_w = torch.softmax(vals[:, :K], dim=-1)  # [T, K] fp32, differentiable

        # aux loss: one all_reduce of (P [E], f [E], T) over the group; the value is the group's, the gradient is
        # this rank's share (P_local).
        p_local = torch.softmax(logits, dim=-1).sum(0)  # [E]
        f_local = torch.bincount(topk_ids.reshape(-1), minlength=E)
        stats = torch.cat([p_local.detach().double(), f_local.double(), p_local.new_full((1,), T, dtype=torch.float64)])
        if R > 1:
            import torch.distributed as dist
            dist.all_reduce(stats, group=group)
        p_all, f_all, t_all = stats[:E], stats[E:2 * E], stats[2 * E]
        f_frac = f_all / f_all.sum().clamp_min(1.0)  # zero when the group has no tokens
        t_all = t_all.clamp_min(1.0)
        share = E * (p_local * (f_frac / t_all).float()).sum()
        total = (E * (p_all / t_all * f_frac).sum()).float()
        aux = share + (total - share.detach())

        # 2. Which ranks each token goes to, and the counts.
        dest = topk_ids // El  # [T, K] rank of each selected expert
        need = torch.zeros(T, R, dtype=torch.bool, device=dev)
        need.scatter_(1, dest, True)  # need[t, r]: token t has at least one expert on rank r
        # rows and (token, expert) pairs each rank is sent: [R, 2]; the pair counts let moe_deepep skip its sync
        send_counts = torch.stack([need.sum(0), torch.bincount(dest.reshape(-1), minlength=R)], dim=1)
        if R > 1:
            recv_counts = torch.empty_like(send_counts)
            import torch.distributed as dist
            dist.all_to_all_single(recv_counts, send_counts, group=group)
        else:
            recv_counts = send_counts
        counts = torch.stack([send_counts, recv_counts]).tolist()  # host read (the only one)
        send_splits, recv_splits = [c[0] for c in counts[0]], [c[0] for c in counts[1]]
        recv_pairs = sum(c[1] for c in counts[1])
        S = sum(send_splits)

        # 3. Dispatch: rows ordered by destination rank, then token; each with its K ids local to that rank.
        send_rank, send_tok = _nonzero(need.t(), S).unbind(1)  # S is known: no second host sync
        ids_rows, dest_rows = topk_ids[send_tok], dest[send_tok]  # [S, K]
        local = dest_rows == send_rank[:, None]
        send_ids = torch.where(local, ids_rows - send_rank[:, None] * El, torch.full_like(ids_rows, -1))
        send_w = torch.where(local, topk_w[send_tok], torch.zeros((), dtype=topk_w.dtype, device=dev))
        # with one rank every token goes to it once, in token order: x itself, no gather (nor scatter below)
        send_x = x2 if R == 1 else _GatherRows.apply(x2, send_tok, send_splits)
        if R > 1:
            recv_x = _a2a(send_x, recv_splits, send_splits, group, differentiable=True)
            recv_w = _a2a(send_w, recv_splits, send_splits, group, differentiable=True)
            recv_ids = _a2a(send_ids.to(torch.int32), recv_splits, send_splits, group, differentiable=False)
        else:
            recv_x, recv_w, recv_ids = send_x, send_w, send_ids

        # 4. The local experts.
        y = moe_deepep(recv_x, recv_ids, recv_w, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                       self.c_proj.bias, self.activation_function, accumulate_main_grad=self.accumulate_main_grad,
                       num_pairs=recv_pairs)

        # 5. Combine: back to the source ranks, summed per token rank by rank (deterministic).
        back = _a2a(y, send_splits, recv_splits, group, differentiable=True) if R > 1 else y
        out = back if R == 1 else _ScatterAddRows.apply(back, send_tok, send_splits, T)
        return out.reshape(shape), aux

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation_function.value}, "
                f"ep_size={self.ep_size}, ep_rank={self.ep_rank}, local_experts=[{self.local_expert_offset}, "
                f"{self.local_expert_offset + self.num_local_experts})")


def shard_moe_state_dict(state_dict: Dict[str, torch.Tensor], rank: int, world_size: int) -> Dict[str, torch.Tensor]:
    """Rank `rank`'s `ExpertParallelMoE` state dict from a full `MoE` state dict (keys may carry a prefix): the
    expert tensors (c_fc.weight/bias, c_proj.weight/bias) sliced to experts [rank E/R, (rank+1) E/R) (copies), every
    other entry (the router) copied whole."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"sonicmoe_cpp.shard_moe_state_dict: rank {rank} / world_size {world_size}, expected "
                         "0 <= rank < world_size")
    out = {}
    for k, v in state_dict.items():
        if k.endswith(_EXPERT_KEYS):
            E = v.shape[0]
            if E % world_size != 0:
                raise ValueError(f"sonicmoe_cpp.shard_moe_state_dict: '{k}' has {E} experts, not divisible by "
                                 f"world_size {world_size}")
            n = E // world_size
            out[k] = v[rank * n:(rank + 1) * n].clone()
        else:
            out[k] = v.clone()
    return out


def unshard_moe_state_dicts(shards: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The full `MoE` state dict from every rank's `ExpertParallelMoE` state dict, in rank order: the expert tensors
    concatenated, the replicated entries (the router) taken from rank 0 after checking that every rank's is equal."""
    if len(shards) == 0:
        raise ValueError("sonicmoe_cpp.unshard_moe_state_dicts: argument 'shards' is empty")
    out = {}
    for k, v in shards[0].items():
        if any(k not in s for s in shards):
            raise ValueError(f"sonicmoe_cpp.unshard_moe_state_dicts: '{k}' is missing from some shards")
        if k.endswith(_EXPERT_KEYS):
            out[k] = torch.cat([s[k] for s in shards], dim=0)
        else:
            for r, s in enumerate(shards[1:], 1):
                if not torch.equal(s[k], v):
                    raise ValueError(f"sonicmoe_cpp.unshard_moe_state_dicts: replicated entry '{k}' differs "
                                     f"between rank 0 and rank {r}")
            out[k] = v.clone()
    return out

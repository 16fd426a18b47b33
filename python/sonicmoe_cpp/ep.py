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
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._ops import FP8_PRECISIONS as _FP8
from .fp8_cache import Fp8CachedModule

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
    for name, t, optional in ((_XNAME[fn], x, False), ("w1", w1, False), ("b1", b1, True), ("w2", w2, False),
                              ("b2", b2, True)):
        if not isinstance(t, torch.Tensor) and not (optional and t is None):
            raise TypeError(f"sonicmoe_cpp.{fn}: argument '{name}' must be a torch.Tensor"
                            f"{' or None' if optional else ''}, got {type(t).__name__}")
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


def _no_rows(x, w1, b1, w2, b2, scores, activation, accumulate_main_grad=False):
    """The [0, H] output for N = 0 rows (the op needs T >= 1), still connected to every input so that autograd
    returns zero gradients (not None) for the weights, as the op does for an expert without rows. With
    accumulate_main_grad, weights with a `main_grad` are left out (adding zero to main_grad changes nothing)."""
    # The op is not run (no rows), but its argument checks are: the general-routing entry on the empty rows checks
    # every argument on one zero token (sonicmoe_cpp._no_tokens), so that bad dtypes / shapes are refused as for N > 0.
    with torch.no_grad():
        empty = torch.zeros(0, dtype=torch.int32, device=x.device)
        _pkg().moe_general_routing(x.detach(), empty, empty, torch.zeros(0, device=x.device), w1, b1, w2, b2,
                                   activation)
    if accumulate_main_grad:
        w1, b1, w2, b2 = (None if getattr(t, "main_grad", None) is not None else t for t in (w1, b1, w2, b2))
    from .torch_backend import zero_anchor
    return x.new_zeros((0, x.shape[1])) + zero_anchor(x, w1, b1, w2, b2, scores).to(x.dtype)


def moe_permuted(x_perm: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor, w1: torch.Tensor,
                 b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation="swiglu",
                 debug: bool = False, accumulate_main_grad: bool = False, precision: str = "bf16") -> torch.Tensor:
    """Experts over rows already permuted by expert (the Megatron-Core / torchtitan experts contract).

    x_perm [N, H]: the rows of local expert 0 first, then those of expert 1, ...; tokens_per_expert [E_local]
    (integer; on x_perm's device, or on the CPU); probs [N]: each row's routing probability. w1 [E_local, 2I or I,
    H], w2 [E_local, H, I] (+ biases) as in `moe_general_routing`. Returns [N, H] in the same (permuted) order:
    out[r] = probs[r] * expert_{e(r)}(x_perm[r]). Autograd: gradients for x_perm, the weights and probs.

    Built as general routing with one pair per row (token r, expert e(r), score probs[r]); the expert ids come from
    `torch.repeat_interleave(..., output_size=N)`, so no host sync. The contract sum(tokens_per_expert) == N is
    checked when tokens_per_expert is on the CPU (free), and on the device only with debug=True (a device read);
    debug=True also checks that the counts are non-negative. accumulate_main_grad: as `MoE`'s (weights with an fp32
    `main_grad` get their gradient added there, not in .grad). precision: as `MoE`'s ("fp8": the expert GEMMs in FP8
    blockwise, H and I multiples of 128).
    """
    fn = "moe_permuted"
    debug = _pkg()._bool_arg("debug", debug, f"sonicmoe_cpp.{fn}")
    accumulate_main_grad = _pkg()._bool_arg("accumulate_main_grad", accumulate_main_grad, f"sonicmoe_cpp.{fn}")
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
        return _no_rows(x_perm, w1, b1, w2, b2, probs, activation, accumulate_main_grad)
    dev = x_perm.device
    expert_idx = torch.repeat_interleave(torch.arange(E_local, device=dev, dtype=torch.int32),
                                         tpe.to(device=dev, dtype=torch.int64), output_size=N)
    token_idx = torch.arange(N, device=dev, dtype=torch.int32)
    return _pkg().moe_general_routing(x_perm, token_idx, expert_idx, probs.to(torch.float32), w1, b1, w2, b2,
                                      activation, accumulate_main_grad=accumulate_main_grad, precision=precision)


def moe_deepep(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, w1: torch.Tensor,
               b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation="swiglu",
               debug: bool = False, accumulate_main_grad: bool = False,
               num_pairs: Optional[int] = None, recv_x_scale: Optional[torch.Tensor] = None,
               recv_x_grad: Optional[torch.Tensor] = None, precision: str = "bf16", fp8_weights=None) -> torch.Tensor:
    """Experts over rows received by a DeepEP normal dispatch.

    recv_x [N, H]; recv_topk_idx [N, K] (integer): each row's local expert ids, -1 where the expert lives on another
    rank; recv_topk_weights [N, K] (floating): the matching weights. Returns [N, H]: row n's weighted sum over its
    local experts, sum_k [idx[n, k] >= 0] * weights[n, k] * expert_{idx[n, k]}(recv_x[n]). Autograd: gradients for
    recv_x, the weights and recv_topk_weights (zero where the id is -1).

    DeepEP's FP8 dispatch: recv_x the float8_e4m3fn codes [N, H] and recv_x_scale their float32 scales [N, H / 128]
    (one per row and 128 channels; any positive values, e.g. DeepEP's amax / 448). The experts then run in FP8
    blockwise (precision "fp8": H and I multiples of 128; w1 / w2 bf16, or float32 on the CPU) on those codes, without
    quantising X again: bitwise the layer on the dequantised rows (codes * scales) where those quantise back to the
    same codes. The output is in the weights' dtype. Autograd gives the weights' and recv_topk_weights' gradients;
    recv_x's, in the weights' dtype, is written into `recv_x_grad` ([N, H], when given) during the backward, since
    autograd would cast a gradient of float8 codes to float8 (recv_x must not require grad). dW1 reads the
    dequantised rows. precision: as `MoE`'s for bf16 rows ("fp8": the FP8 layer
    quantises them); FP8 rows always run in "fp8".

    Pairs with id -1 are dropped before the op runs, so they cost no GEMM work. Counting the valid pairs is a host
    sync on CUDA (torch.nonzero) unless the caller passes their number as `num_pairs` (DeepEP's dispatch reports
    it; `ExpertParallelMoE` exchanges it with the row counts); a wrong `num_pairs` is caught only with debug=True.
    debug=True checks that every id is in [-1, E_local) (a device read); without it, an id >= E_local is still
    rejected by the op and an id < -1 counts as -1. On CPU tensors these checks are always made (no device read).
    accumulate_main_grad: as `MoE`'s. fp8_weights: bf16 rows under precision "fp8" only: w1 and w2 already
    quantised (as moe_topk's; `ExpertParallelMoE`'s weight cache passes them).
    """
    fn = "moe_deepep"
    debug = _pkg()._bool_arg("debug", debug, f"sonicmoe_cpp.{fn}")
    accumulate_main_grad = _pkg()._bool_arg("accumulate_main_grad", accumulate_main_grad, f"sonicmoe_cpp.{fn}")
    precision = _pkg().normalize_precision(precision, f"sonicmoe_cpp.{fn}: argument 'precision'")
    fp8 = recv_x_scale is not None
    if fp8:
        _check_fp8_rows(fn, recv_x, recv_x_scale, recv_x_grad, w1)
        if fp8_weights is not None:
            raise _err(fn, "argument 'fp8_weights' is for bf16 rows under precision 'fp8' (FP8 rows quantise the "
                           "weights in the call)")
    else:
        if recv_x_grad is not None:
            raise _err(fn, "argument 'recv_x_grad' is for FP8 rows (recv_x_scale given); bf16 rows get their "
                           "gradient through autograd")
        if fp8_weights is not None:
            _pkg()._check_fp8_weights_arg(fp8_weights, precision)
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
    # On the CPU the checks of debug=True cost no device read: always done there.
    check = debug or recv_x.device.type == "cpu"
    if check and idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= E_local:
            raise _err(fn, f"argument 'recv_topk_idx' has ids in [{lo}, {hi}], expected -1 or [0, E_local) = "
                           f"[0, {E_local})")
    valid = idx >= 0
    if num_pairs is not None:
        num_pairs = _pkg()._int_arg("num_pairs", num_pairs, f"sonicmoe_cpp.{fn}")
        if not 0 <= num_pairs <= idx.numel():
            raise _err(fn, f"argument 'num_pairs' = {num_pairs}, expected 0 <= num_pairs <= N * K = {idx.numel()}")
        if check and int(valid.sum()) != num_pairs:
            raise _err(fn, f"argument 'num_pairs' = {num_pairs}, but recv_topk_idx has {int(valid.sum())} ids >= 0")
    if N == 0:
        if fp8:
            return _no_rows(recv_x.new_empty((0, recv_x.shape[1]), dtype=w1.dtype), w1, b1, w2, b2, wts, activation,
                            accumulate_main_grad)
        return _no_rows(recv_x, w1, b1, w2, b2, wts, activation, accumulate_main_grad)
    rows, ids, pair_w = _deepep_pairs(valid, idx, wts, num_pairs, E_local)
    if fp8:
        act = _pkg()._act_name(activation)
        targets = None
        if accumulate_main_grad and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                raise _err(fn, "accumulate_main_grad=True is not supported under torch.compile (the backward writes "
                               "into main_grad, outside the graph)")
            targets = _pkg()._ops.main_grad_params(None, w1, b1, w2, b2)
        return _Fp8Rows.apply(recv_x, recv_x_scale, rows, ids, pair_w, w1, b1, w2, b2, act, recv_x_grad, targets)
    return _pkg().moe_general_routing(recv_x, rows, ids, pair_w, w1, b1, w2, b2, activation,
                                      accumulate_main_grad=accumulate_main_grad, precision=precision,
                                      fp8_weights=fp8_weights)


class _PairValues(torch.autograd.Function):
    """v[rows, cols] of v [N, K] at distinct (row, col) places (`flat` = rows K + cols, int64), as fp32. Its backward
    writes the gradient back into a zero [N, K] without accumulating: indexing's own backward accumulates, which on
    CUDA sorts the indices first (five kernels at 65536 x 8 entries, where this is one)."""

    @staticmethod
    def forward(ctx, v, flat):
        ctx.save_for_backward(flat)
        ctx.shape, ctx.dtype = v.shape, v.dtype
        return v.reshape(-1).index_select(0, flat).to(torch.float32)

    @staticmethod
    def backward(ctx, g):
        (flat,) = ctx.saved_tensors
        out = g.new_zeros((math.prod(ctx.shape),), dtype=ctx.dtype)
        out.index_put_((flat,), g.to(ctx.dtype))  # distinct places: no accumulation needed
        return out.view(ctx.shape), None


class _LocalPairs:
    """This rank's pairs among the all-gather dispatch's gathered routing (ids int32 [M, K]: global expert ids, -1 for
    none; weights fp32 [M, K]), row-major (sorted by row, as general routing needs), found on the device before the
    host knows their number: on CUDA at their upper bound M K (torch.nonzero_static, no host read), so that these
    launches queue ahead of the host read instead of after it. cut(P): the first P (the real count, read on the host
    with the group's counts): their rows and local ids (int32 [P], views) and weights (fp32 [P], differentiable in
    the gathered weights)."""

    def __init__(self, ids, w, El: int, me: int):
        local = ids - me * El
        valid = (local >= 0) & (local < El)
        # the pairs first, then (0, 0) entries up to M K: every place in range, the cut drops them
        nz = torch.nonzero_static(valid, size=valid.numel(), fill_value=0)
        self.flat, self.rows, local_ids = _pair_places(nz, local)
        self.ids = local_ids.to(torch.int32)
        self.w = w
        # on the CPU the real count costs no device read: checked against the group's at the cut
        self.count = int(valid.sum()) if not valid.is_cuda else None

    def cut(self, P: int):
        if P > self.flat.shape[0] or (self.count is not None and P != self.count):
            raise RuntimeError(f"sonicmoe_cpp.ExpertParallelMoE: the group's counts give this rank {P} pairs, but its "
                               f"gathered routing holds {self.count if self.count is not None else 'fewer'}: the ranks' "
                               "routing disagrees")
        return self.rows[:P], self.ids[:P], _PairValues.apply(self.w, self.flat[:P])


def _pair_places(nz, idx):
    """The entries nz [P, 2] (row, column) of idx [N, K]: their places in [N, K] (row K + column, int64), their rows
    (int32) and idx's values there."""
    flat = nz[:, 0] * idx.shape[1] + nz[:, 1]
    return flat, nz[:, 0].to(torch.int32), idx.reshape(-1).index_select(0, flat)


def _deepep_pairs(valid, idx, wts, num_pairs, E_local):
    """The pairs of a DeepEP dispatch with an id >= 0 (valid [N, K]), row-major (sorted by row, as general routing
    needs): their rows and local expert ids (int32 [P]) and weights (fp32 [P], differentiable in wts). num_pairs:
    their number when known (no host sync on a GPU)."""
    flat, rows, ids = _pair_places(_nonzero(valid, num_pairs), idx)
    if ids.dtype != torch.int32:  # an id past int32 must not wrap into a valid one: E_local, which the op rejects
        ids = ids.clamp(max=E_local)
    return rows, ids.to(torch.int32), _PairValues.apply(wts, flat)


def _check_fp8_rows(fn, q, scale, grad, w1):
    """moe_deepep's FP8 rows: codes, scales and the gradient buffer against the weights (the op checks the rest)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.dim() != 2:
        desc = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise _err(fn, f"argument 'recv_x' is {desc}; with recv_x_scale it must be the float8_e4m3fn codes [N, H]")
    N, H = q.shape
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or \
            tuple(scale.shape) != (N, (H + 127) // 128) or scale.device != q.device:
        desc = f"{scale.dtype} {tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor) \
            else type(scale).__name__
        raise _err(fn, f"argument 'recv_x_scale' is {desc}, expected torch.float32 {(N, (H + 127) // 128)} on "
                       f"{q.device} (one scale per row and 128 channels)")
    if q.requires_grad:
        raise _err(fn, "argument 'recv_x' (float8 codes) requires grad: autograd would cast its gradient to float8; "
                       "pass recv_x_grad (a [N, H] tensor in the weights' dtype) to receive it")
    if grad is not None and (not isinstance(grad, torch.Tensor) or tuple(grad.shape) != (N, H)
                             or grad.dtype != w1.dtype or grad.device != q.device):
        desc = f"{grad.dtype} {tuple(grad.shape)} on {grad.device}" if isinstance(grad, torch.Tensor) \
            else type(grad).__name__
        raise _err(fn, f"argument 'recv_x_grad' is {desc}, expected {w1.dtype} {(N, H)} on {q.device} (the weights' "
                       "dtype)")


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """FP8 rows' values, decode(q) * scale per 1x128 block ([N, H] codes, [N, ceil(H / 128)] scales), in `dtype`
    (bfloat16, or float32 on the CPU): the library's dequantiser (torch.ops.sonicmoe.fp8_dequantize_rows), the product
    in float32, then one rounding."""
    return torch.ops.sonicmoe.fp8_dequantize_rows(q, scale, dtype)


class _Fp8Rows(torch.autograd.Function):
    """moe_deepep on FP8 rows: torch.ops.sonicmoe.forward_fp8_rows (general routing over the valid pairs); the
    backward is torch.ops.sonicmoe.backward on the dequantised rows, its dx written into the caller's buffer.
    targets (main_grad_params' tuple, or None): the weights whose gradients go to their fp32 main_grad (W1's and W2's
    added by the op's GEMMs where fusable_main_grad allows, the others here)."""

    @staticmethod
    def forward(ctx, q, scale, token, expert, scores, w1, b1, w2, b2, activation, grad_buf, targets):
        outs = torch.ops.sonicmoe.forward_fp8_rows(q, scale, w1, b1, w2, b2, activation, token, expert, scores)
        ctx.activation, ctx.grad_buf, ctx.targets = activation, grad_buf, targets
        ctx.has_b = b1 is not None
        ctx.save_for_backward(q, scale, w1, b1, w2, b2, *outs[2:])
        return outs[0]

    @staticmethod
    def backward(ctx, g):
        from ._ops import fused_main_grads, to_main_grads
        q, scale, w1, b1, w2, b2, *state = ctx.saved_tensors
        params = (None,) * 4 if ctx.targets is None else ctx.targets[1:]  # (w1, b1, w2, b2)
        need = ctx.needs_input_grad[5:9]
        fused = fused_main_grads(params, need, (0, 2))
        x = dequantize_rows(q, scale, w1.dtype)
        dx, dw1, db1, dw2, db2, _, dscore = torch.ops.sonicmoe.backward(
            g.contiguous(), x, None, w1, b1, w2, b2, ctx.activation, 1, "general", *state, None, False, False,
            "softmax", True, False, 1.0, "fp8", w1_main_grad=fused[0], w2_main_grad=fused[2])
        del x
        if ctx.grad_buf is not None:
            ctx.grad_buf.copy_(dx)
        grads = to_main_grads(params, need, fused, [dw1, db1 if ctx.has_b else None, dw2, db2 if ctx.has_b else None])
        return (None, None, None, None, dscore, *grads, None, None, None)


# ------------------------------------------------------------------------------------------------------------------
# Expert-parallel layer


def _check_router(cfg, has_bias, E, K, where="sonicmoe_cpp.ExpertParallelMoE"):
    """The router rules of the library's check_router (src/moe/router.cpp), checked at construction: the ranks route
    in PyTorch (torch_backend.route), which would fail later and less clearly."""
    by_score = cfg["scoring_func"] == "sigmoid" or not cfg["softmax_over_topk"]
    scale = cfg["routed_scaling_factor"]
    # the library's float: 1e300 is inf there, 1e-50 is 0 (on the CPU: also under a torch.device("meta") context)
    scale32 = float(torch.tensor(scale, dtype=torch.float32, device="cpu"))
    if not (math.isfinite(scale32) and scale32 > 0):
        raise ValueError(f"{where}: argument 'routed_scaling_factor' = {scale}, expected a finite value > 0 (as a "
                         "float32)")
    G, kept = cfg["n_group"], cfg["topk_group"]
    if G < 1 or E % G:
        raise ValueError(f"{where}: argument 'n_group' = {G} must be >= 1 and divide num_experts = {E}")
    if not 1 <= kept <= G:
        raise ValueError(f"{where}: argument 'topk_group' = {kept}, expected 1 <= topk_group <= n_group = {G}")
    if G > 1:
        if not by_score:
            raise ValueError(f"{where}: argument 'n_group' = {G} (group-limited selection) needs scoring_func "
                             "'sigmoid', or softmax_over_topk=False (groups are ranked by their scores)")
        if E // G < 2:
            raise ValueError(f"{where}: argument 'n_group' = {G} leaves groups of {E // G} expert(s) for "
                             f"num_experts = {E}; a group is ranked by its two best scores (>= 2)")
        if K > kept * (E // G):
            raise ValueError(f"{where}: top_k = {K} exceeds the {kept * (E // G)} experts of the kept groups "
                             f"(topk_group * num_experts / n_group)")
    if has_bias and not by_score:
        raise ValueError(f"{where}: e_score_correction_bias needs scoring_func 'sigmoid', or softmax_over_topk=False "
                         "(the bias is added to the scores, not to logits)")


def _group_info(group, name="ep_group") -> Tuple[int, int]:
    """(world size, rank) of `group` (argument `name`); (1, 0) when torch.distributed is not initialised and no group
    is given."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    if group is not None and not (dist.is_available() and (isinstance(group, dist.ProcessGroup) or (
            type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER))):  # torch's sentinel for non-members
        raise TypeError(f"sonicmoe_cpp.ExpertParallelMoE: argument '{name}' must be a "
                        f"torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


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
    """fp32 router logits x @ w^T from 16-bit x and w on the GPU, and x again (a view) for the experts' side: one
    16-bit GEMM with fp32 accumulation and output (no fp32 copy of x, no fp32 GEMM). Backward as the library's router
    backward: the fp32 dlogits split into a 16-bit high and low half [hi | lo]; dx = [hi | lo] @ [w ; w], one GEMM
    with fp32 accumulation written in x's dtype (no fp32 [T, H] intermediates), added by that GEMM into the experts'
    side's gradient of x where there is one (beta = 1, as the single-GPU layer's router backward adds into its dx:
    no separate [T, H] sum), dw = the two halves of [hi | lo]^T @ x (one GEMM, fp32 output) summed."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32), x.view_as(x)

    @staticmethod
    def backward(ctx, g, g_x):
        x, w = ctx.saved_tensors
        if g is None:
            return g_x, None
        hi = g.to(x.dtype)
        hl = torch.cat([hi, (g - hi.float()).to(x.dtype)], dim=1)  # [T, 2E]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            ww = torch.cat([w, w], dim=0)
            # g_x is the gradient the exchange's own backward made (a fresh tensor of this module): added into in place
            if g_x is not None and g_x.dtype == x.dtype and g_x.is_contiguous() and g_x.shape == x.shape:
                dx = g_x.addmm_(hl, ww)
            else:
                dx = torch.mm(hl, ww) if g_x is None else g_x + torch.mm(hl, ww)
        if ctx.needs_input_grad[1]:
            E = w.shape[0]
            both = torch.mm(hl.t(), x, out_dtype=torch.float32)  # [2E, H]
            dw = (both[:E] + both[E:]).to(w.dtype)
        return dx, dw


def _router_logits(x, w):
    """fp32 logits [T, E] of x [T, H] and the router weight w [E, H], and the x the experts' side reads (on the GPU a
    view of x whose gradient the router's backward GEMM adds into; else x)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and x.shape[0] > 0:
        return _RouterLogits.apply(x, w)
    return F.linear(x.float(), w.float()), x


def _topk(logits, K):
    """The default router's choice, as the single-GPU layer makes it (torch.ops.sonicmoe.topk: one kernel; the K
    largest logits, ties to the lower expert id): ids int64 [T, K], the softmax over the K chosen logits fp32 [T, K]
    (differentiable in the logits) and the top-K rows per expert, int64 [E]."""
    ids, _, counts = torch.ops.sonicmoe.topk(logits.detach(), K)
    ids = ids.long()
    return ids, torch.softmax(logits.gather(1, ids), dim=-1), counts.long()


# ------------------------------------------------------------------------------------------------------------------
# The exchange: a plan of the rows each chunk sends, four autograd Functions over it, and the streams of the overlap.

_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


class _Streams:
    """The two CUDA streams of the pipelined exchange (DESIGN.md section 10): `main` (the caller's current stream:
    routing, the experts, the combine's sum) and `side` (the row gather, every all-to-all, the dispatch's backward
    sum). A Function applied on `side` also runs its backward there, and autograd makes each stream wait for the
    other only where a gradient crosses, at the time it is produced: that is what overlaps the exchanges of one chunk
    with the experts of another, in the forward and the backward alike. On the CPU both are no-ops."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(dev)
            idx = dev.index if dev.index is not None else torch.cuda.current_device()
            if idx not in _SIDE_STREAMS:
                _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
            self.side = _SIDE_STREAMS[idx]

    def on_side(self):
        from contextlib import nullcontext
        return torch.cuda.stream(self.side) if self.cuda else nullcontext()

    def side_waits_main(self):
        if self.cuda:
            self.side.wait_stream(self.main)

    def main_waits_side(self):
        if self.cuda:
            self.main.wait_stream(self.side)

    def side_event(self):
        return self.side.record_event() if self.cuda else None

    def main_waits(self, event):
        if event is not None:
            self.main.wait_event(event)

    def for_main(self, t):
        """t was allocated on `side` and is read on `main`: the caching allocator must not hand its memory to `side`
        again before `main` is done with it."""
        if self.cuda and t is not None and t.is_cuda and t.numel() > 0:
            t.record_stream(self.main)
        return t

    def for_side(self, *ts):
        """The same for tensors of `main` read on `side`."""
        if self.cuda:
            for t in ts:
                if t is not None and t.is_cuda and t.numel() > 0:
                    t.record_stream(self.side)


def _aux_loss(stats, p_local, E):
    """MoE's switch loss over the group's batch from the all_gathered statistics [R, P (E), f (E), T, ...]: its value
    the whole batch's on every rank, its gradient this rank's share (through p_local)."""
    p_all, f_all, t_all = stats[:, :E].sum(0), stats[:, E:2 * E].sum(0), stats[:, 2 * E].sum()
    f_frac = f_all / f_all.sum().clamp_min(1.0)  # zero when the group has no tokens
    t_all = t_all.clamp_min(1.0)
    share = E * (p_local * (f_frac / t_all).float()).sum()
    total = (E * (p_all / t_all * f_frac).sum()).float()
    return share + (total - share.detach())


def _expert_counts(topk_ids, E):
    """f [E] int64: top-K rows per expert, by scatter_add (torch.bincount reads its input's range on the host)."""
    flat = topk_ids.reshape(-1)
    return torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _expert_capacity(T: int, K: int, E: int, factor: float) -> int:
    """MoE's capacity, the library's RouterSpec::expert_capacity: C = min(T, ceil(T*K / E * factor)), in double."""
    c = math.ceil(float(T) * float(K) / float(E) * factor)
    return T if c >= T else int(c)


def _capacity_keep(topk_ids, E: int, C: int):
    """[T, K] bool: which of the pairs (pair t*K + k) each expert keeps under a capacity of C, its first C in pair order
    (MoE's capacity_factor rule), on the device (no host read): a stable sort by expert, each pair's place among its
    expert's pairs."""
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = _expert_counts(topk_ids, E)
    start = counts.cumsum(0) - counts
    place = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
    keep = torch.empty(flat.shape, dtype=torch.bool, device=flat.device).scatter_(0, order, place < C)
    return keep.view(topk_ids.shape)


def _local_stats(logits, f_local, extra):
    """This rank's row of the statistics all_gather, fp64: [P (E): the softmax over all E summed over the tokens,
    f (E) (_expert_counts), T, extra..., the ok flag (1)], and P (differentiable, for the aux loss)."""
    p_local = torch.softmax(logits, dim=-1).sum(0)  # [E]
    T = logits.shape[0]
    parts = [p_local.detach().double(), f_local.double(), p_local.new_full((1,), T, dtype=torch.float64),
             extra.double(), p_local.new_ones((1,), dtype=torch.float64)]
    return torch.cat(parts), p_local


def _check_flags(rows, where="sonicmoe_cpp.ExpertParallelMoE"):
    """rows: the host copy of the statistics' columns from T on, one list per source rank, the ok flag last. A rank
    whose flag is 0 refused its input (ExpertParallelMoE._refuse): every other rank stops here too."""
    bad = [r for r, row in enumerate(rows) if row[-1] != 1]
    if bad:
        raise RuntimeError(f"{where}: rank(s) {bad} of the ep_group refused their input (their own error names the "
                           "argument); every rank stops this step before its exchanges")


class _EarlyGather:
    """An all_gather_into_tensor of x's rows started before the host read of the counts (async_op): `out` [R M, ...]
    is ready for the current stream after wait()."""

    def __init__(self, x, group, R):
        import torch.distributed as dist
        self.out = x.new_empty((R * x.shape[0],) + tuple(x.shape[1:]))
        self.work = dist.all_gather_into_tensor(self.out, x.detach().contiguous(), group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # the current stream waits for the collective (no host wait on CUDA)
            self.work = None
        return self.out


class _RowsCollective(torch.autograd.Function):
    """gather=True: x [M, ...] -> [R M, ...], every rank's x in rank order (all_gather_into_tensor); gather=False:
    y [R M, ...] -> [M, ...], this rank's block of y summed over the ranks (reduce_scatter_tensor). Each is the
    other's backward. `started`: an _EarlyGather of x already under way (gather=True), whose result is returned."""

    @staticmethod
    def forward(ctx, x, group, R, gather, started=None):
        import torch.distributed as dist
        ctx.group, ctx.R, ctx.gather = group, R, gather
        if started is not None:
            return started.wait()
        out = x.new_empty((R * x.shape[0] if gather else x.shape[0] // R,) + tuple(x.shape[1:]))
        (dist.all_gather_into_tensor if gather else dist.reduce_scatter_tensor)(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _RowsCollective.apply(g, ctx.group, ctx.R, not ctx.gather), None, None, None, None


class _SplitSum:
    """The all-gather dispatch's sums over the ranks (y's in the forward, dx's in the backward) split around their
    exchange: the other ranks' tokens summed first (gather_sum over each rank's range of the gathered tokens), in
    `chunks` row ranges, each range sent to every other rank as soon as it is summed (send / receive pairs with each,
    in one group), this rank's tokens summed while they travel, each received range added after, the other ranks' in
    rank order. At R = 2 bitwise what reduce_scatter_tensor gives (two addends, one rounding of their sum); at R > 2 the
    partial rows are added one rank at a time (a rounding each, as in a ring reduce_scatter). At readme-default on two
    H200s: 1.48-1.58 ms against 1.78-1.85 for gather_sum over every token then reduce_scatter_tensor
    (`python/bench/nccl_bench.py --split-aggregate`; two chunks beat one, three, four and eight:
    docs/notes/ep_all_gather_dispatch.md)."""

    def __init__(self, group, R: int, me: int, rows: int, chunks: int = 2):
        import torch.distributed as dist
        self.group, self.R, self.me, self.rows = group, R, me, rows
        self.others = [q for q in range(R) if q != me]  # group ranks, in rank order
        self.peers = [dist.get_global_rank(group, q) if group is not None else q for q in self.others]
        self.bounds = sorted({rows * j // chunks for j in range(chunks + 1)})

    def gather(self, t):
        """All_gather of this rank's rows [rows, ...] -> [R rows, ...] (rank order); called where grad mode is off."""
        return _RowsCollective.apply(t, self.group, self.R, True)

    def __call__(self, y, rev, token_offsets, scores=None):
        """y [N, H] rows of the R `rows` gathered tokens (rev / token_offsets: the layer's metadata over them; scores:
        the pair weights, or None for an unweighted sum) -> [rows, H]: this rank's tokens summed over the ranks."""
        import torch.distributed as dist
        gather_sum = torch.ops.sonicmoe.gather_sum
        n, b = self.rows, self.bounds
        got = y.new_empty((len(self.others), n, y.shape[1]))
        parts, works = [], []
        for lo, hi in zip(b[:-1], b[1:]):  # every other rank's tokens [lo, hi): summed, then on their way
            ops = []
            for i, (q, peer) in enumerate(zip(self.others, self.peers)):
                parts.append(gather_sum(y, rev, token_offsets[q * n + lo:q * n + hi + 1], scores))
                ops += [dist.P2POp(dist.isend, parts[-1], peer, self.group),
                        dist.P2POp(dist.irecv, got[i, lo:hi], peer, self.group)]
            works.append(dist.batch_isend_irecv(ops))
        o = self.me * n
        mine = gather_sum(y, rev, token_offsets[o:o + n + 1], scores)  # while the others' travel
        for (lo, hi), work in zip(zip(b[:-1], b[1:]), works):
            for w in work:
                w.wait()  # on CUDA the current stream waits for the transfers (no host wait)
            for i in range(len(self.others)):
                mine[lo:hi].add_(got[i, lo:hi])
        return mine


class _SplitExperts(torch.autograd.Function):
    """The all-gather dispatch's experts with both sums over the ranks split around their exchanges
    (_SplitSum): x_rows [rows, H] (this rank's tokens, padded) -> [rows, H], this rank's tokens' outputs. Forward: x
    gathered (or the early exchange's gather awaited), the layer's forward over the pairs returning the experts' rows
    (expert_rows=True: Y before its per-token sum), the split sum of Y weighted by the pair scores. Backward: dO
    gathered, the first half of the layer's two-part backward returning dXe (dgated, dW2, dXe), the split sum of dXe,
    then dW1 (so that dXe and dW1 are never alive together, as in the layer's own backward). Gradients: x_rows, the
    pair weights (`scores`), w1, b1, w2, b2 (added into their main_grads for `targets`, as the single-GPU layer)."""

    @staticmethod
    def forward(ctx, split, targets, gathering, x_rows, scores, w1, b1, w2, b2, token_idx, expert_idx, activation):
        ops = _pkg()._ops
        recv_x = gathering.wait() if gathering is not None else split.gather(x_rows)
        router = ops.DEFAULT_ROUTER[:ops._EXPERT_ROWS_ARG] + (True,)
        outs = torch.ops.sonicmoe.forward(recv_x, None, w1, b1, w2, b2, activation, 1, "general", 128, token_idx,
                                          expert_idx, scores, *router)
        state = outs[2:]
        names = ops._STATE_NAMES
        index = (state[names.index("rev")], state[names.index("token_offsets")])
        out = split(outs[0], *index, state[names.index("pair_score")])
        # The state as a plain attribute (ops._save's reason); Z also saved, for autograd's check of a second backward
        # through the graph (the backward writes dZ over it).
        ctx.state, ctx.index, ctx.split, ctx.targets, ctx.activation = state, index, split, targets, activation
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        ctx.save_for_backward(recv_x, w1, b1, w2, b2, state[names.index("z")])
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, g):
        ops = _pkg()._ops
        if torch.is_grad_enabled():
            raise RuntimeError("sonicmoe_cpp.ExpertParallelMoE: double backward (create_graph=True) through the "
                               "layer is not supported: its backward is not differentiable")
        recv_x, w1, b1, w2, b2, z = ctx.saved_tensors
        state, split, (rev, toff) = ctx.state, ctx.split, ctx.index
        ctx.state = ctx.index = None
        if g is None:
            g = recv_x.new_zeros((split.rows, recv_x.shape[1]))
        d_all = split.gather(g)
        del g
        params = (None,) * 5 if ctx.targets is None else ctx.targets
        needed = (False,) + tuple(ctx.needs_input_grad[5:9])  # (router, w1, b1, w2, b2)
        fused = ops.fused_main_grads(params, needed, (1, 3))
        # (d_aux_loss, consume_z, validate_state, the router's backward arguments, precision): dZ is written over Z
        tail = (None, True, False, "softmax", True, False, 1.0, "bf16")
        act = ctx.activation
        dxe, _, dscore, dz, _, dw2, db2 = torch.ops.sonicmoe.backward_act(
            d_all, recv_x, None, w1, b1, w2, b2, act, 1, "general", *state, *tail, True, fused[3], True)
        del d_all
        torch.autograd.graph.increment_version(z)
        dx = split(dxe, rev, toff) if ctx.needs_input_grad[3] else None
        del dxe
        # d_out is not read without A*s (dW2 ran above): recv_x stands in for it (shape and dtype only)
        dw1, db1, _, _ = torch.ops.sonicmoe.backward_weights(
            recv_x, recv_x, None, w1, b1, w2, b2, act, 1, "general", *state, dz if dz.numel() else z,
            recv_x.new_empty((0,)), *tail, fused[1], None)
        grads = [None, dw1, db1 if ctx.has_b1 else None, dw2, db2 if ctx.has_b2 else None]
        if ctx.targets is not None:
            grads = ops.to_main_grads(params, needed, fused, grads)
        return None, None, None, dx, dscore, grads[1], grads[2], grads[3], grads[4], None, None, None


class _GatherRouting(torch.autograd.Function):
    """Every rank's routing, (w fp32 [M, K], ids int32 [M, K]) -> ([R M, K], [R M, K]), packed into one [M, 2K] int32
    all_gather_into_tensor. Backward: the weights' gradient, each rank's block summed over the ranks."""

    @staticmethod
    def forward(ctx, w, ids, group, R):
        import torch.distributed as dist
        ctx.group, ctx.R = group, R
        K = ids.shape[1]
        packed = torch.cat([ids.to(torch.int32), w.to(torch.float32).view(torch.int32)], dim=1)
        out = packed.new_empty((R * packed.shape[0], 2 * K))
        dist.all_gather_into_tensor(out, packed, group=group)
        recv_ids = out[:, :K]
        ctx.mark_non_differentiable(recv_ids)
        return out[:, K:].view(torch.float32), recv_ids

    @staticmethod
    def backward(ctx, g_w, g_ids):
        return _RowsCollective.apply(g_w.float(), ctx.group, ctx.R, False), None, None, None


def _pad_rows(t, rows: int, value=0):
    """t [M, ...] with `rows` rows: cut (a view) or padded with `value` (t itself when M == rows)."""
    M = t.shape[0]
    if M == rows:
        return t
    if M > rows:
        return t[:rows]
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - M), value=value)


def _uniform_fill(E: int, K: int, R: int) -> float:
    """The fraction of tokens that reach a given other rank under uniform top-K routing: 1 - C(E - E/R, K) / C(E, K)
    (the all-gather dispatch sends every token there; the all-to-all only these)."""
    import math
    rest = E - E // R
    return 1.0 - (math.comb(rest, K) / math.comb(E, K) if K <= rest else 0.0)


DISPATCH_MODES = ("auto", "all_to_all", "all_gather")
_AUTO_ALL_GATHER_FILL = 0.9


class _HostRead:
    """A small device tensor read on the host without draining the stream first: on CUDA the copy to pinned memory is
    queued now and waited for (an event) at wait(), so that the launches made in between queue behind the GPU's work;
    on the CPU the tensor itself."""

    def __init__(self, t: torch.Tensor):
        self.t, self.event = t, None
        if t.is_cuda:
            self.t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.t.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.t


class _Plan:
    """Where each row goes, for all C chunks (tokens [bounds[c], bounds[c+1]) of this rank). The rows sent are
    ordered by chunk, then destination rank, then token (each chunk's rows for rank r contiguous, as
    all_to_all_single wants), S in all; row i is token send_tok[i]; token t's rows, in rank order, are
    rev[tok_off[t]:tok_off[t+1]] (int32; the combine sums them, the dispatch's backward too). Also holds the [S, H]
    buffers the chunks' exchanges write into (the combine's rows, the dispatch's row gradients), so that one pass
    over all chunks sums them."""

    def __init__(self, T, send_tok, rev, tok_off, send_splits, recv_splits, streams):
        self.T, self.send_tok, self.rev, self.tok_off = T, send_tok, rev, tok_off
        self.send_splits, self.recv_splits = send_splits, recv_splits  # [C][R]
        self.sizes = [sum(s) for s in send_splits]  # S_c
        self.starts = [sum(self.sizes[:c]) for c in range(len(self.sizes))]
        self.S = sum(self.sizes)
        self.streams = streams
        streams.for_side(send_tok, rev, tok_off)  # read by the gather and the dispatch's backward sum
        self.back = None  # [S, H]: the combine's rows, back from the experts' ranks
        self.grad_send = None  # [S, H]: the gradients of the dispatched rows

    def rows(self, name, like, c):
        """Chunk c's rows of the [S, H] buffer `name`, allocated at the first chunk's use."""
        buf = getattr(self, name)
        if buf is None:
            buf = self.streams.for_main(like.new_empty((self.S,) + tuple(like.shape[1:])))
            setattr(self, name, buf)
        return buf[self.starts[c]:self.starts[c] + self.sizes[c]]

    def whole(self, name, parts):
        """The [S, H] tensor whose chunk views are `parts`: the buffer itself when they are its views (the usual
        case), else their concatenation."""
        buf = getattr(self, name)
        setattr(self, name, None)
        if buf is not None and all(p is not None and p.data_ptr() == buf[s:s + 1].data_ptr() and p.shape[0] == n
                                   for p, s, n in zip(parts, self.starts, self.sizes) if n > 0):
            return buf
        ref = next(p for p in parts if p is not None)
        return torch.cat([p if p is not None else ref.new_zeros((n,) + tuple(ref.shape[1:]))
                          for p, n in zip(parts, self.sizes)])

    def sum_rows(self, rows):
        """out[t] = sum of token t's rows of rows [S, H], in rank order (fp32 accumulation, one rounding to rows'
        dtype; deterministic, no atomics): the library's aggregation stage, one pass (torch.ops.sonicmoe.gather_sum)."""
        return torch.ops.sonicmoe.gather_sum(rows.contiguous(), self.rev, self.tok_off)


_WIDE_ELEMENTS = [torch.complex128, torch.int64]  # 16 and 8 bytes; a type index_select refuses is dropped


def _gather_rows(x, idx):
    """x[idx] along dim 0. index_select moves one element per thread: rows of 16-byte multiples are gathered as
    complex128 elements (8 bf16 a load) when their layout allows the view."""
    if x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0:
        for wide in list(_WIDE_ELEMENTS):
            n = wide.itemsize
            if (x.shape[1] * x.element_size()) % n or (x.stride(0) * x.element_size()) % n or x.data_ptr() % n:
                continue
            try:
                return x.view(wide).index_select(0, idx).view(x.dtype)
            except (RuntimeError, NotImplementedError):  # raised before any kernel runs
                _WIDE_ELEMENTS.remove(wide)
    return x.index_select(0, idx)


def _a2a_into(out, x, out_splits, in_splits, group):
    import torch.distributed as dist
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _DispatchGather(torch.autograd.Function):
    """x [T, H] -> the rows every chunk sends, one view per chunk of one [S, H] gather. Backward: each token's row
    gradients summed (Plan.sum_rows over the dispatch's gradient buffer)."""

    @staticmethod
    def forward(ctx, plan, x):
        ctx.plan = plan
        rows = _gather_rows(x, plan.send_tok)
        return tuple(rows.split(plan.sizes))

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        return None, plan.streams.for_main(plan.sum_rows(plan.whole("grad_send", grads)))


class _CombineSum(torch.autograd.Function):
    """The chunks' returned rows (views of Plan.back) -> out [T, H], each token's rows summed. Backward: the
    gather of out's gradient by token, split per chunk."""

    @staticmethod
    def forward(ctx, plan, *backs):
        ctx.plan = plan
        return plan.sum_rows(plan.whole("back", backs))

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        return (None, *_gather_rows(g, plan.send_tok).split(plan.sizes))


class _RowsExchange(torch.autograd.Function):
    """Chunk c's rows through all_to_all_single: dispatch (send_x -> recv_x, backward into Plan.grad_send) or
    combine (y -> chunk c's view of Plan.back, backward into a new buffer)."""

    @staticmethod
    def forward(ctx, x, plan, c, group, combine):
        ctx.plan, ctx.c, ctx.group, ctx.combine = plan, c, group, combine
        send, recv = plan.send_splits[c], plan.recv_splits[c]
        if combine:
            out = plan.rows("back", x, c)
            return _a2a_into(out, x, send, recv, group)
        out = plan.streams.for_main(x.new_empty((sum(recv),) + tuple(x.shape[1:])))
        return _a2a_into(out, x, recv, send, group)

    @staticmethod
    def backward(ctx, g):
        plan, c = ctx.plan, ctx.c
        plan.streams.for_side(g)
        send, recv = plan.send_splits[c], plan.recv_splits[c]
        if ctx.combine:
            out = plan.streams.for_main(g.new_empty((sum(recv),) + tuple(g.shape[1:])))
            return _a2a_into(out, g, recv, send, ctx.group), None, None, None, None
        out = plan.rows("grad_send", g, c)
        return _a2a_into(out, g, send, recv, ctx.group), None, None, None, None


def _meta_a2a(send_w, send_ids, plan, c, group):
    """Chunk c's routing of the dispatched rows, ids and weights packed into one [S_c, 2K] int32 all_to_all_single:
    (recv_w f32 [N_c, K], recv_ids int32 [N_c, K])."""
    K = send_w.shape[1]
    packed = torch.cat([send_ids.to(torch.int32), send_w.to(torch.float32).view(torch.int32)], dim=1)
    recv = plan.streams.for_main(packed.new_empty((sum(plan.recv_splits[c]), 2 * K)))
    _a2a_into(recv, packed, plan.recv_splits[c], plan.send_splits[c], group)
    return recv[:, K:].view(torch.float32), recv[:, :K]


class _MetaExchange(torch.autograd.Function):
    """Chunk c's routing of the dispatched rows, ids (int32, -1 for other ranks' experts) and weights (fp32) packed
    into one [S_c, 2K] int32 all_to_all_single. Returns (recv_w [N_c, K], recv_ids [N_c, K]); backward: the weights'
    gradient by the reverse exchange."""

    @staticmethod
    def forward(ctx, send_w, send_ids, plan, c, group):
        ctx.plan, ctx.c, ctx.group = plan, c, group
        recv_w, recv_ids = _meta_a2a(send_w, send_ids, plan, c, group)
        ctx.mark_non_differentiable(recv_ids)
        return recv_w, recv_ids

    @staticmethod
    def backward(ctx, g_w, g_ids):
        plan, c = ctx.plan, ctx.c
        plan.streams.for_side(g_w)
        out = plan.streams.for_main(g_w.new_empty((sum(plan.send_splits[c]), g_w.shape[1])))
        return _a2a_into(out, g_w, plan.send_splits[c], plan.recv_splits[c], ctx.group), None, None, None, None


class _Chunk:
    """What _LocalExperts needs besides its tensors: chunk c of `plan`, its received rows and routing (the dispatch
    exchange already ran, on the side stream), the layer's settings; `group`: the process group of the backward's
    reverse exchange (the layer's overlap_group, else its ep_group)."""

    def __init__(self, plan, c, group, recv, num_pairs, activation, main_grad_targets, sm_margin, overlap_dw2,
                 events):
        self.plan, self.c, self.group = plan, c, group
        self.overlap_dw2 = overlap_dw2
        self.recv, self.num_pairs = recv, num_pairs
        self.activation, self.main_grad_targets = activation, main_grad_targets
        self.sm_margin, self.events = sm_margin, events


class _LocalExperts(torch.autograd.Function):
    """Chunk c's local experts as one autograd node over what the chunk's dispatch sent (send_x [S_c, H], send_w
    [S_c, K]) and the experts' weights: forward, the library's general-routing op on the rows received by the
    dispatch exchange (run before, outside autograd: chunk.recv); backward, the dispatch exchange's reverse under the
    weight gradients (DESIGN.md section 10):
      1. part 1 on the main stream, torch.ops.sonicmoe.backward_act: dgated, dX (the GEMM and the per-row sum) and
         d(scores), scattered to d(recv_w) [N_c, K];
      2. the all-to-all of the row gradients (into Plan.grad_send) and of d(recv_w) back to the source ranks, on
         the side stream;
      3. part 2 on the main stream meanwhile, torch.ops.sonicmoe.backward_weights: dW2 and dW1 from part 1's dZ and
         A*s (with chunk.sm_margin: the GEMMs leave that many SMs to the exchange's kernels). With overlap_dw2 off,
         dW2 runs in part 1 instead (A*s dropped before dX: the unsplit backward's peak memory) and part 2 is dW1;
      4. the main stream waits for the exchange.
    The results are bitwise those of the unsplit path (`_RowsExchange` + `_MetaExchange` + `moe_deepep`): the same
    stages on the same operands, the same exchanges."""

    @staticmethod
    def forward(ctx, send_x, send_w, w1, b1, w2, b2, chunk):
        recv_x, recv_w, recv_ids = chunk.recv
        chunk.recv = None
        ctx.chunk = chunk
        N, K = recv_ids.shape
        ctx.shape = (N, K, recv_x.shape[1])
        ctx.weights = (w1, b1, w2, b2)  # for zero gradients of a chunk without rows (the op's: zeros, not None)
        if N == 0:
            ctx.state = ()
            return recv_x.new_zeros((0, recv_x.shape[1]))
        nz = _nonzero(recv_ids >= 0, chunk.num_pairs)
        rows, cols = nz[:, 0], nz[:, 1]
        outs = torch.ops.sonicmoe.forward(recv_x, None, w1, b1, w2, b2, chunk.activation, 1, "general", 128,
                                          rows.to(torch.int32), recv_ids[rows, cols].to(torch.int32),
                                          recv_w[rows, cols].to(torch.float32))
        ctx.state = (recv_x, rows, cols, tuple(outs[2:]))
        return outs[0]

    @staticmethod
    def backward(ctx, dy):
        if ctx.state is None:
            raise RuntimeError("sonicmoe_cpp.ExpertParallelMoE: a second backward through the same graph "
                               "(retain_graph=True) is not supported: the first one consumed the saved state")
        chunk = ctx.chunk
        plan, c, group = chunk.plan, chunk.c, chunk.group
        ov = plan.streams
        N, K, H = ctx.shape
        w1, b1, w2, b2 = ctx.weights
        send, recv = plan.send_splits[c], plan.recv_splits[c]
        events = None
        if chunk.events is not None and ov.cuda:  # [start, part 1 done, part 2 done, exchange done] on main
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            chunk.events.append(events)
            events[0].record(ov.main)
        # fp32 main_grads of w1 / w2 that the library's GEMMs add into (the others: add_to_main_grad below)
        from ._ops import fused_main_grads, to_main_grad
        targets = chunk.main_grad_targets
        params = (None,) * 4 if targets is None else targets[1:]  # (w1, b1, w2, b2)
        fused = fused_main_grads(params, ctx.needs_input_grad[2:6], (0, 2))
        mg1, mg2 = fused[0], fused[2]
        # 1. part 1: dx, d(scores) (dZ and A*s kept for part 2)
        dev = w1.device
        consume = not torch.compiler.is_compiling()
        if N > 0:
            recv_x, rows, cols, state = ctx.state
            dy = dy.contiguous() if dy is not None else torch.zeros_like(recv_x)
            args = (dy, recv_x, None, w1, b1, w2, b2, chunk.activation, 1, "general", *state)
            dx, _, dscore, dz, a_s, dw2, db2 = torch.ops.sonicmoe.backward_act(
                *args, None, consume, False, dw2_in_part1=not chunk.overlap_dw2,
                w2_main_grad=None if chunk.overlap_dw2 else mg2)
            dw = torch.zeros((N, K), dtype=torch.float32, device=dev).index_put_((rows, cols), dscore,
                                                                                 accumulate=True)
        else:
            dx = w1.new_empty((0, H))
            dw = torch.zeros((0, K), dtype=torch.float32, device=dev)
        if events is not None:
            events[1].record(ov.main)
        # 2. the dispatch's reverse exchange on the side stream (every rank: collectives)
        gx = gw = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ov.side_waits_main()
            ov.for_side(dx, dw)
            with ov.on_side():
                if ctx.needs_input_grad[0]:
                    gx = plan.rows("grad_send", dx, c)
                    ov.for_side(gx)
                    _a2a_into(gx, dx, send, recv, group)
                if ctx.needs_input_grad[1]:
                    gw = ov.for_main(dw.new_empty((sum(send), K)))
                    _a2a_into(gw, dw, send, recv, group)
        # 3. part 2 on the main stream while the exchange flies: dW2, dW1 (and the biases')
        grads = [None] * 4
        if N > 0 and any(ctx.needs_input_grad[2:6]):
            margin = chunk.sm_margin if ov.cuda else 0
            prev = _pkg().gemm_sm_margin() if margin else None
            if margin:
                _pkg().set_gemm_sm_margin(margin)
            try:
                grads = list(torch.ops.sonicmoe.backward_weights(*args, state[0] if consume else dz, a_s,
                                                                 w1_main_grad=mg1,
                                                                 w2_main_grad=mg2 if chunk.overlap_dw2 else None))
                if not chunk.overlap_dw2:  # part 1 ran dW2
                    grads[2:] = [dw2, db2]
            finally:
                if prev is not None:
                    _pkg().set_gemm_sm_margin(prev)
        ctx.state = None  # z holds dZ now (consume): a second backward raises above
        if events is not None:
            events[2].record(ov.main)
        # 4. the exchange's results are read on the main stream from here on
        ov.main_waits_side()
        if events is not None:
            events[3].record(ov.main)
        for i, (param, w) in enumerate(zip(params, ctx.weights)):
            g = grads[i] if N > 0 else None
            if w is None or not ctx.needs_input_grad[2 + i]:
                grads[i] = None
            elif param is not None:  # added into main_grad (a chunk without rows adds nothing)
                grads[i] = to_main_grad(param, g, fused[i]) if g is not None else None
            else:
                grads[i] = g if g is not None else torch.zeros_like(w)
        return (gx, gw, *grads, None)


def _chunk_bounds(T: int, C: int) -> List[int]:
    """Token boundaries of C chunks: with C >= 3 the first and the last chunk are half the size of the others (the
    first chunk's dispatch and the last one's combine are the exchanges nothing hides), else even."""
    w = [1] * C if C < 3 else [1] + [2] * (C - 2) + [1]
    total, acc, out = sum(w), 0, [0]
    for x in w:
        acc += x
        out.append(T * acc // total)
    return out


def default_chunks(device: torch.device, ep_size: int) -> int:
    """The chunk count when the caller gives none: 1. Measured at readme-default on two H200s (docs/PERFORMANCE.md
    section 7), 2 chunks ran slower than 1: the library's persistent GEMMs own every SM with a static tile schedule,
    so an all-to-all beside them delays their tiles instead of hiding under them. `chunks` > 1 stays available
    (e.g. with set_gemm_sm_margin). The same on every rank, as it must be: the chunks' exchanges are collectives."""
    del device, ep_size
    return 1


class ExpertParallelMoE(Fp8CachedModule, nn.Module):
    """The `MoE` layer (top-K routing) with its E experts split over the R ranks of `ep_group` (default: the world
    group; without torch.distributed initialised, R = 1). Rank r holds experts [r E/R, (r+1) E/R).

    Router keywords: `MoE`'s (scoring_func, softmax_over_topk / is_softmax_over_topk, norm_topk_probs /
    norm_topk_prob, n_group, topk_group, routed_scaling_factor, e_score_correction_bias: the Qwen3 / OLMoE /
    DeepSeek-V3 routers), with the same results. The bias buffer `router.e_score_correction_bias` is replicated like
    the router weight (keep it equal on every rank). capacity_factor (None): per rank, as Megatron-Core applies it:
    each rank's tokens give each expert at most C = min(T, ceil(T*K / E * capacity_factor)) of their pairs (T: this
    rank's tokens), the first C in pair order, the others dropped on the source rank before the dispatch (not sent,
    nothing in the output, no gradient); rank r's output is `MoE(..., capacity_factor=...)`'s on rank r's tokens
    alone, and the aux loss counts the router's choices before the drop, over the group's batch as without a
    capacity. After a forward `num_dropped` holds this rank's dropped pairs (an int32 [1] tensor on the device, no
    host sync); None without a capacity.

    Parameters, with `MoE`'s names: router.weight [E, H] (replicated: every rank holds the full router; keep the
    replicas equal, e.g. broadcast them at start and reduce their gradients over the group as for any data-parallel
    parameter), c_fc.weight [E/R, 2I or I, H], c_fc.bias [E/R, 2I or I], c_proj.weight [E/R, H, I], c_proj.bias
    [E/R, H]. `shard_moe_state_dict` / `unshard_moe_state_dicts` convert from and to a full `MoE` state dict.

    forward(x, kernel_backend_moe=..., is_inference_mode=False) with x [T, H] or [B, S, H] (this rank's tokens; T may
    differ between ranks, 0 included) returns (output of x's shape, aux_loss scalar fp32; None in inference mode); the
    keywords are `MoE.forward`'s. With R = 1 it is `MoE`'s fused top-K op (nothing to exchange; no
    host sync). With R > 1, one of two dispatches (`dispatch`: "all_to_all", "all_gather", or "auto": all_gather at
    chunks = 1 with the unsplit backward where a token reaches a given other rank with probability >= 0.9 under
    uniform routing, `dispatch_mode()`). all_gather: routing as in 1 below, one all_gather of the aux statistics and
    the pair counts (read on the host), x and the routing all_gathered to every rank (padded to the group's largest T),
    the local experts on every row (`moe_deepep`, ids local to the rank), reduce_scatter of the partial rows back to
    their source; the backward swaps the collectives. When training in bf16 (`split_sums`, True by default) the
    per-token sums of the experts' rows and their exchanges are split instead, in the forward (y) and in the backward
    (dx): the other ranks' tokens summed first and sent in two parts as each is summed, this rank's tokens summed while
    they travel, the received rows added after (the layer's op returning the experts' rows, `expert_rows`; at R = 2
    bitwise the reduce_scatter's result). all_to_all, the steps of docs/DESIGN.md section 10:
      1. router logits in fp32 (on the GPU one 16-bit GEMM with fp32 output), top-K on the logits (ties to the lower
         expert id), softmax over the K (another router: its formulas, `torch_backend.route`) — the same routing
         math as `MoE`;
      2. one all_gather of every rank's aux-loss statistics and per-(destination, chunk) row and pair counts; the
         counts are read on the host (the one host sync of a step);
      3. dispatch, chunk by chunk (this rank's tokens split into `chunks` contiguous ranges, the first and last
         half the size of the others from 3 chunks on): each token sent once to every rank that holds at least one
         of its experts, with its K ids local to that rank (-1 for the experts of other ranks) and their weights
         (DeepEP's convention);
      4. the local experts run on each chunk's received rows through `moe_deepep`;
      5. combine: each chunk's partial sums sent back by the reverse all-to-all, then every token's rows summed at
         the source in rank order (fp32 accumulation, one rounding; deterministic).
    On CUDA the exchanges run on a side stream: the dispatch of chunk c+1 and the combine of chunk c-1 overlap the
    experts of chunk c, and the backward mirrors it (`_Streams`). chunks = 1 is the unpipelined layer; results do not
    depend on the chunk count beyond the experts' own summation order (each chunk is its own op call). Every
    exchange is an autograd-aware all_to_all_single: x, the router, the local experts and the routing weights get
    their gradients. Memory: the rows are held once whatever the chunk count (the chunks' received rows, saved by
    their ops, add up to the unchunked layer's).

    aux_loss: `MoE`'s switch loss E * sum_e (P_e / T) * (f_e / sum f) over the group's whole batch (P_e: sum of the
    softmax over all E, f_e: top-K rows of expert e, T: tokens), its statistics summed over the ranks in rank order.
    Its value is the whole batch's loss on every rank; its gradient is this rank's share (the derivative through
    this rank's tokens only), so the router gradients summed over the ranks equal `MoE`'s on the concatenated batch.

    Every rank of the group must run the forward and, when training, the backward through the output (the reverse
    exchanges are collectives), with the same chunk count and the same requires_grad pattern. The rows are exchanged
    in x's dtype, the routing weights in fp32. Under torch.autocast (bf16 or f16) the layer computes in its dtype, as
    `MoE` does: the input and the parameters cast by differentiable copies (the rows then travel in that dtype), the
    output in it; parameters of another dtype with accumulate_main_grad=True are refused, before any collective.

    device, dtype (None), reset_parameters(): as `MoE`'s (this rank's shard).

    precision ("bf16"), fp8_weight_cache (True): as `MoE`'s (the local experts' W1 and W2 quantised once while they are
    unchanged, shared by every chunk of a step and across micro-batches); "fp8" refuses overlap_backward=True.

    accumulate_main_grad=True: as `MoE`'s; the local experts' gradients are added into their `main_grad` by the
    op's backward, the router's (logits and aux loss together) by an identity autograd Function on the weight.

    The overlapped backward (R > 1, when training; DESIGN.md section 10), off by default (overlap_backward=False: on two
    H100s it ran slower than the unsplit backward, docs/PERFORMANCE.md section 7); overlap_backward=True: each
    chunk's experts are one autograd node whose backward computes the activation-side gradients first (dgated, dX,
    the routing weights'), starts the all-to-all that returns them to the source ranks on the side stream, computes
    the weight gradients dW2 and dW1 on the main stream while it flies, then waits for it; the results are bitwise
    those of overlap_backward=False (the op's unsplit backward, the exchange after it). overlap_sm_margin = M: the
    weight-gradient GEMMs under that exchange leave M SMs to NCCL (set_gemm_sm_margin for those GEMMs only).
    overlap_dw2=False: dW2 runs before the exchange (only dW1 under it), which keeps the unsplit backward's peak
    memory (with True, A*s [N, I] of the received pairs lives through dX). overlap_group: a second process group over
    the same ranks (same order) for that exchange only, e.g. an NCCL group whose `pg_options.config.max_ctas` = M
    matches overlap_sm_margin = M, so that it fits beside the GEMMs while the exposed exchanges keep NCCL's own CTA
    count (default None: ep_group). backward_events: a list to collect CUDA events of the overlapped backward
    (ep_bench.py's split), or None.
    """

    # Defaults of the attributes __init__ sets, for modules pickled before they existed (torch.load of a whole module;
    # precision and the FP8 weight cache: Fp8CachedModule's)
    _early_rows = 0
    num_dropped = None
    split_sums = True
    _where = "sonicmoe_cpp.ExpertParallelMoE"

    def __init__(self, num_experts: int, num_experts_per_tok: int, hidden_size: int, intermediate_size: int,
                 activation_function="swiglu", add_bias: bool = False, std: float = 0.02, ep_group=None,
                 accumulate_main_grad: bool = False, chunks: Optional[int] = None, overlap_backward: bool = False,
                 overlap_sm_margin: int = 0, overlap_dw2: bool = True, overlap_group=None,
                 scoring_func: str = "softmax", softmax_over_topk: bool = True, is_softmax_over_topk=None,
                 norm_topk_probs: bool = False, norm_topk_prob=None, n_group: Optional[int] = 1,
                 topk_group: Optional[int] = 1, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: bool = False, dispatch: str = "auto", precision: str = "bf16",
                 fp8_weight_cache: bool = True, capacity_factor: Optional[float] = None, device=None, dtype=None):
        super().__init__()
        sm = _pkg()
        where = self._where
        factory = sm._factory_args(device, dtype, where)
        if not isinstance(dispatch, str) or dispatch not in DISPATCH_MODES:
            raise ValueError(f"{where}: argument 'dispatch' = {dispatch!r}, expected one of {DISPATCH_MODES}")
        self.dispatch = dispatch
        self.overlap_backward = sm._bool_arg("overlap_backward", overlap_backward, where)
        self.overlap_dw2 = sm._bool_arg("overlap_dw2", overlap_dw2, where)
        std = sm._std_arg(std, where)
        self.overlap_sm_margin = sm._int_arg("overlap_sm_margin", overlap_sm_margin)
        if not 0 <= self.overlap_sm_margin <= 4096:
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'overlap_sm_margin' = {overlap_sm_margin}, "
                             "expected 0 <= overlap_sm_margin <= 4096")
        # A list to get, per chunk and backward, CUDA events [start, part 1 done, part 2 done, exchange done] on
        # the main stream (ep_bench.py's backward split); None: no events.
        self.backward_events: Optional[list] = None
        self.accumulate_main_grad = sm._bool_arg("accumulate_main_grad", accumulate_main_grad, where)
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = sm._layer_sizes(
            "ExpertParallelMoE", num_experts, num_experts_per_tok, hidden_size, intermediate_size)
        self.fp8_weight_cache = fp8_weight_cache
        self.precision = precision
        misfit = self._fp8_misfit()
        if self.precision in _FP8 and misfit:
            raise ValueError(f"{where}: argument '{misfit[0]}' = {misfit[1]} is not supported with precision 'fp8': "
                             "it must be a multiple of 128 (the FP8 block size)")
        self.activation_function = sm.ActivationType(sm._act_name(activation_function))
        self.add_bias = sm._bool_arg("add_bias", add_bias, where)
        if chunks is not None:
            chunks = sm._int_arg("chunks", chunks)
            if chunks < 1:
                raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'chunks' = {chunks}, expected >= 1 "
                                 "(or None: default_chunks)")
        self.chunks = chunks
        self.ep_group = ep_group
        self.ep_size, self.ep_rank = _group_info(ep_group)
        self.overlap_group = overlap_group
        if overlap_group is not None and _group_info(overlap_group, "overlap_group") != (self.ep_size, self.ep_rank):
            raise ValueError("sonicmoe_cpp.ExpertParallelMoE: argument 'overlap_group' has (size, rank) "
                             f"{_group_info(overlap_group, 'overlap_group')}, expected the ep_group's "
                             f"({self.ep_size}, {self.ep_rank})")
        if self.num_experts % self.ep_size != 0:
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'num_experts' = {self.num_experts} is not "
                             f"divisible by the expert-parallel world size {self.ep_size}")
        self.num_local_experts = self.num_experts // self.ep_size
        self.local_expert_offset = self.ep_rank * self.num_local_experts
        self.dispatch_mode()  # dispatch='all_gather' with chunks > 1 or the overlapped backward: refused here
        # The all-gather dispatch's early exchange (_forward_gathered): the group's largest T of the last step (0:
        # none yet), kept equal on every rank (each sets it from the same all_gathered counts).
        self._early_rows = 0
        H, I, El = self.hidden_size, self.intermediate_size, self.num_local_experts
        z_width = 2 * I if sm.is_glu(self.activation_function) else I
        self.router = nn.Linear(H, self.num_experts, bias=False, **factory)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.router_config = sm._router_config(
            "sonicmoe_cpp.ExpertParallelMoE", self.router, e_score_correction_bias, scoring_func, softmax_over_topk,
            is_softmax_over_topk, norm_topk_probs, norm_topk_prob, n_group, topk_group, routed_scaling_factor,
            capacity_factor)
        _check_router(self.router_config, e_score_correction_bias, self.num_experts, self.top_k)
        self.c_fc = sm.Experts(El, H, z_width, self.add_bias, std, **factory)
        self.c_proj = sm.Experts(El, I, H, self.add_bias, std, **factory)

    def reset_parameters(self):
        """The construction's initialisation again, in place, as MoE.reset_parameters (this rank's experts)."""
        _pkg()._reset_moe_parameters(self)

    @classmethod
    def from_moe(cls, moe, ep_group=None, chunks: Optional[int] = None, overlap_backward: bool = False,
                 overlap_sm_margin: int = 0, overlap_dw2: bool = True, overlap_group=None,
                 dispatch: str = "auto") -> "ExpertParallelMoE":
        """This rank's shard of a full `MoE` (top-K routing, its router and capacity_factor, its precision), with copies
        of its weights (converted to
        the interleaved W1 layout when the MoE has concat_layout=True or w1_layout="separate": ExpertParallelMoE holds
        interleaved weights)."""
        if not isinstance(moe, nn.Module) or not all(hasattr(moe, a) for a in ("router", "c_fc", "c_proj")):
            raise TypeError(f"sonicmoe_cpp.ExpertParallelMoE.from_moe: argument 'moe' must be a MoE module, got "
                            f"{type(moe).__name__}")
        if getattr(moe, "routing", "topk") != "topk":
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE.from_moe: the MoE's routing is {moe.routing!r}, "
                             "expected 'topk'")
        router = dict(getattr(moe, "router_config", {}))  # capacity_factor included: applied per rank (class doc)
        bias = getattr(moe.router, "e_score_correction_bias", None)
        ep = cls(moe.num_experts, moe.top_k, moe.hidden_size, moe.intermediate_size, moe.activation_function,
                 moe.add_bias, ep_group=ep_group, accumulate_main_grad=getattr(moe, "accumulate_main_grad", False),
                 chunks=chunks, overlap_backward=overlap_backward, overlap_sm_margin=overlap_sm_margin,
                 overlap_dw2=overlap_dw2, overlap_group=overlap_group, e_score_correction_bias=bias is not None,
                 dispatch=dispatch, precision=getattr(moe, "precision", "bf16"),
                 fp8_weight_cache=getattr(moe, "fp8_weight_cache", True), device=moe.router.weight.device,
                 dtype=moe.router.weight.dtype, **router)
        sd = moe.state_dict()
        layout = getattr(moe, "w1_layout", "concat" if getattr(moe, "concat_layout", False) else "interleaved")
        if layout != "interleaved":
            sd = _pkg().convert_moe_state_dict(sd, "interleaved", activation=moe.activation_function,
                                               from_layout=layout)
        ep.load_state_dict(shard_moe_state_dict(sd, ep.ep_rank, ep.ep_size))
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

    def _check_input(self, x, precision=None):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states' must be a torch.Tensor, got "
                            f"{type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states' ('x') has shape "
                             f"{tuple(x.shape)}, expected [T, {self.hidden_size}] or [B, S, {self.hidden_size}]")
        w = self.router.weight
        ac = _pkg()._autocast_dtype(x)
        if ac is not None and w.dtype != ac:  # refused here, before any collective, rather than by the op after one
            if self.accumulate_main_grad:
                raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: accumulate_main_grad=True under "
                                 f"torch.autocast(dtype={ac}) needs the parameters in {ac} (they are {w.dtype}: convert "
                                 f"the module with .to({ac}), or run it outside autocast)")
            if (precision or self.precision) in _FP8 and ac != torch.bfloat16:
                raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: precision 'fp8' computes from bfloat16 operands: "
                                 f"not supported under torch.autocast(dtype={ac}) (use dtype=torch.bfloat16)")
        if ac is None and x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
                or x.device != w.device:
            # checked before any collective: the op would refuse it only after the dispatch exchange
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states' ('x') is {x.dtype} on "
                             f"{x.device}, expected the module's {w.dtype} on {w.device} (bf16, fp16 or fp32)")
        for name, p in (("c_fc.weight", self.c_fc.weight), ("c_fc.bias", self.c_fc.bias),
                        ("c_proj.weight", self.c_proj.weight), ("c_proj.bias", self.c_proj.bias)):
            if p is not None and (p.dtype != w.dtype or p.device != w.device):
                # the op would refuse it after the dispatch exchange, on this rank only
                raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: parameter '{name}' is {p.dtype} on {p.device}, "
                                 f"expected the router weight's {w.dtype} on {w.device}")

    def _chunk_count(self) -> int:
        """`chunks`, or default_chunks (on the router's device; the CPU while __init__ has not made it) when None."""
        if self.chunks is not None:
            return self.chunks
        return default_chunks(self.router.weight.device if hasattr(self, "router") else torch.device("cpu"),
                              self.ep_size)

    def _stats_size(self, mode: str) -> int:
        """The length of a rank's row of the step's statistics all_gather (_local_stats): P (E), f (E), T, the
        counts of the dispatch, the ok flag."""
        R = self.ep_size
        return 2 * self.num_experts + 1 + (R if mode == "all_gather" else R * self._chunk_count() * 2) + 1

    def _refuse(self, error: Exception, mode: str):
        """This rank's input is refused (R > 1): it still joins the step's collectives up to the host read, the
        statistics all_gather with its ok flag at 0 (and, with zero rows, the early exchange's gathers when the other
        ranks start them), so that the other ranks raise too instead of waiting for it; then it raises its own
        error."""
        import torch.distributed as dist
        w = self.router.weight
        mine = torch.zeros(self._stats_size(mode), dtype=torch.float64, device=w.device)
        stats = mine.new_empty((self.ep_size * mine.shape[0],))
        dist.all_gather_into_tensor(stats, mine, group=self.ep_group)
        rows = self._early_rows
        if mode == "all_gather" and rows > 0:  # the early exchange's two gathers (_forward_gathered), of zeros
            K = self.top_k
            _GatherRouting.apply(torch.zeros((rows, K), device=w.device),
                                 torch.zeros((rows, K), dtype=torch.int32, device=w.device), self.ep_group, self.ep_size)
            _EarlyGather(w.new_zeros((rows, self.hidden_size)), self.ep_group, self.ep_size).wait()
        raise error

    def _fp8_misfit(self) -> Optional[Tuple[str, int]]:
        """sonicmoe_cpp._fp8_misfit of this layer's sizes (checked before any collective)."""
        return _pkg()._fp8_misfit(self.hidden_size, self.intermediate_size)

    def _call_options(self, kernel_backend_moe, is_inference_mode) -> Tuple[str, bool]:
        """forward's keywords as `MoE.forward` takes them: (the call's precision, inference), or a ValueError /
        TypeError naming the keyword."""
        sm = _pkg()
        backend = sm._check_backend(kernel_backend_moe)
        if backend == sm.KernelBackendMoE.torch:
            raise ValueError(f"{self._where}: argument 'kernel_backend_moe' = KernelBackendMoE.torch is not supported "
                             "(the plain-PyTorch layer is MoE's; ExpertParallelMoE runs the library's kernels)")
        inference = sm._bool_arg("is_inference_mode", is_inference_mode, self._where)
        precision = "fp8" if backend == sm.KernelBackendMoE.sonicmoe_fp8 else self.precision
        if precision in _FP8 and self.precision not in _FP8:
            misfit = self._fp8_misfit()
            if misfit:
                raise ValueError(f"{self._where}: argument 'kernel_backend_moe' = KernelBackendMoE.sonicmoe_fp8 "
                                 f"needs {misfit[0]} a multiple of 128 (the FP8 block size), got {misfit[1]}")
            if self.overlap_backward:
                raise ValueError(f"{self._where}: argument 'kernel_backend_moe' = KernelBackendMoE.sonicmoe_fp8 is "
                                 "not supported with overlap_backward=True (the two-part backward is bf16 only)")
        return precision, inference

    def forward(self, hidden_states: torch.Tensor, kernel_backend_moe="sonicmoe",
                is_inference_mode: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [T, H] or [B, S, H] (this rank's tokens) -> (output of the same shape, aux_loss scalar fp32).
        The original MoE's keywords, as `MoE.forward` takes them: kernel_backend_moe (KernelBackendMoE.sonicmoe or
        scattermoe: the module's precision; sonicmoe_fp8: this call in FP8 blockwise; torch: refused) and
        is_inference_mode (nothing kept for a backward, aux_loss None; the exchanges still run on every rank). A
        rank refusing its input or keywords still joins the step's first collectives, so that every rank raises."""
        x = hidden_states
        mode = self.dispatch_mode() if self.ep_size > 1 else None
        try:
            precision, inference = self._call_options(kernel_backend_moe, is_inference_mode)
            self._check_input(x, precision)
        except (TypeError, ValueError) as e:
            if self.ep_size == 1:
                raise
            self._refuse(e, mode)
        ac = _pkg()._autocast_dtype(x)
        if ac is not None:  # torch.autocast: x and the parameters cast to its dtype (differentiable), autocast off
            with torch.autocast(x.device.type, enabled=False):
                return self._forward_mode(x.to(ac), precision, mode, inference, self._weights(ac))
        return self._forward_mode(x, precision, mode, inference, self._weights())

    def _weights(self, dtype=None):
        """(router weight, W1, b1, W2, b2) the forward computes with: the parameters, or their copies in `dtype`."""
        ps = (self.router.weight, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        return tuple(p.to(dtype) if p is not None and dtype is not None and p.dtype != dtype else p for p in ps)

    def _forward_mode(self, x, precision, mode, inference, weights):
        if inference:
            with torch.no_grad():
                return self._forward(x, precision, mode, weights)[0], None
        return self._forward(x, precision, mode, weights)

    def _forward(self, x: torch.Tensor, precision: str, mode: Optional[str], weights) -> Tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """forward's steps once the input is checked, at `precision` (the module's, or the call's
        kernel_backend_moe), with the dispatch `mode` (R > 1), on `weights` (_weights())."""
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        bias = getattr(self.router, "e_score_correction_bias", None)
        default_router = self.router_config == _pkg()._DEFAULT_ROUTER_CONFIG and bias is None
        if self.ep_size == 1:  # every expert is here: the single-GPU layer's fused op, no exchange, no host sync
            router = {} if default_router else dict(self.router_config, e_score_correction_bias=bias)
            x2 = x2.contiguous()
            dropped = []
            out, aux = _pkg().moe_topk(x2, *weights, self.top_k, self.activation_function,
                                       accumulate_main_grad=self.accumulate_main_grad, precision=precision,
                                       fp8_weights=self._local_fp8_weights(x2, weights), dropped_out=dropped, **router)
            self.num_dropped = dropped[0] if dropped else None
            return out.reshape(shape), aux
        T, E, K, R, El = x2.shape[0], self.num_experts, self.top_k, self.ep_size, self.num_local_experts
        dev, group, me = x2.device, self.ep_group, self.ep_rank
        C = self._chunk_count()
        import torch.distributed as dist

        # 1. Routing, as the layer does it: fp32 logits, top-K on the logits with ties to the lower expert id (the
        # library's top-K kernel, _topk), softmax over the K selected logits; another router (router_config) through
        # the same formulas as the library's (torch_backend.route).
        router_w = weights[0]
        if self.accumulate_main_grad and torch.is_grad_enabled() and router_w.requires_grad \
                and _pkg()._ops.main_grad_params(router_w, None, None, None, None) is not None:
            router_w = _MainGradSink.apply(router_w)  # its gradient (logits and aux loss) goes to main_grad
        logits, x2 = _router_logits(x2, router_w)  # [T, E] fp32; x2 for the exchange (its gradient joins the router's)
        # f_local [E]: top-K rows per expert (the aux loss's f)
        if default_router:
            topk_ids, topk_w, f_local = _topk(logits, K)  # [T, K] int64, [T, K] fp32 (differentiable), [E]
        else:
            from .torch_backend import route
            topk_ids, topk_w = route(logits, K, self.router_config, bias)
            f_local = _expert_counts(topk_ids, E)
        # The capacity (per rank): the pairs past their expert's C are dropped here, before anything is sent.
        factor = self.router_config["capacity_factor"]
        keep = _capacity_keep(topk_ids, E, _expert_capacity(T, K, E, factor)) if factor else None
        self.num_dropped = None if keep is None else (~keep).sum(dtype=torch.int32).reshape(1)
        if mode == "all_gather":
            return self._forward_gathered(x2, shape, logits, topk_ids, topk_w, f_local, keep, precision, weights)

        # 2. Rows (tokens) and pairs each rank is sent, per chunk: pairs[t, r] = token t's experts on rank r.
        # Nothing below is read on the host before the counts (after step 3): the plan is built on the device at its
        # upper bound of S_max = T R rows, so that its launches queue behind the GPU's work instead of waiting for it.
        dest = topk_ids // El  # [T, K]
        sent = torch.ones_like(dest) if keep is None else keep.long()  # dropped pairs go nowhere
        pairs = torch.zeros(T, R, dtype=torch.int64, device=dev).scatter_add_(1, dest, sent)
        need = pairs > 0  # token t goes to rank r
        # The prefix sums along T with T innermost: torch's scan along an outer dimension runs each of the 2R columns
        # serially (6 ms a step at T = 32768 on an H200, the largest non-library kernel of the step).
        csum = torch.stack([need.long(), pairs], dim=2).reshape(T, 2 * R).t().contiguous().cumsum(1)
        prefix = F.pad(csum.t().reshape(T, R, 2), (0, 0, 0, 0, 1, 0))  # [T+1, R, 2]
        bounds = _chunk_bounds(T, C)
        per_chunk = torch.stack([prefix[b] for b in bounds[1:]]) - torch.stack([prefix[b] for b in bounds[:-1]])
        # One all_gather of [P (E), f (E), T, counts (R x C x 2)] per rank: the aux loss's statistics (summed here
        # in rank order) and the counts (read on the host below: the step's one sync).
        mine, p_local = _local_stats(logits, f_local, per_chunk.transpose(0, 1).reshape(-1))
        stats = mine.new_empty((R * mine.shape[0],))
        dist.all_gather_into_tensor(stats, mine, group=group)
        stats = stats.view(R, -1)  # [source rank, ...]
        reader = _HostRead(stats[:, 2 * E + 1:].long())  # [source, (destination, chunk, rows/pairs)]: copy starts now
        aux = _aux_loss(stats, p_local, E)

        # 3. The plan: send order (chunk, destination, token); pos[t, r] = the place of token t's row for rank r. Built
        # at S_max = T R rows (every token to every rank), the entries past the real S cut off once the counts are read.
        S_max = T * R
        rows_cr = per_chunk[:, :, 0].reshape(-1)
        first = (rows_cr.cumsum(0) - rows_cr).view(C, R)  # [C, R]: first place of chunk c's rows for rank r
        shift = torch.cat([(first[c] - prefix[bounds[c], :, 0]).expand(bounds[c + 1] - bounds[c], R)
                           for c in range(C)]) if T > 0 else prefix.new_zeros((0, R))
        pos = prefix[:-1, :, 0] + shift  # [T, R]
        # token-major (token, rank) entries with need set, then padding (-1): each token's rows in rank order
        tok_rank = torch.nonzero_static(need, size=S_max, fill_value=-1)  # [S_max, 2]
        pad = tok_rank[:, 0] < 0
        tok_rank = tok_rank.clamp_min(0)
        # rev: the place of each (token, rank) row in the send order; padding entries point at the spare slot S_max
        rev = torch.where(pad, S_max, pos[tok_rank[:, 0], tok_rank[:, 1]])  # [S_max]
        tok_off = F.pad(need.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))  # [T+1]
        send_tok = tok_rank.new_zeros((S_max + 1,)).scatter_(0, rev, tok_rank[:, 0])[:S_max]
        send_rank = tok_rank.new_zeros((S_max + 1,)).scatter_(0, rev, tok_rank[:, 1])[:S_max]
        ids_rows = topk_ids[send_tok]  # [S_max, K]
        local = (ids_rows // El) == send_rank[:, None]
        if keep is not None:
            local &= keep[send_tok]
        send_ids = torch.where(local, ids_rows - send_rank[:, None] * El, torch.full_like(ids_rows, -1))
        send_w = torch.where(local, topk_w[send_tok], torch.zeros((), dtype=topk_w.dtype, device=dev))
        rev = rev.to(torch.int32)

        # The counts on the host (the step's one sync), and the plan cut to the S rows really sent.
        host = reader.wait()
        _check_flags(host.tolist())
        cnt = host[:, :-1].reshape(R, R, C, 2).tolist()  # [source][destination][chunk][rows/pairs]
        send_splits = [[cnt[me][r][c][0] for r in range(R)] for c in range(C)]
        recv_splits = [[cnt[s][me][c][0] for s in range(R)] for c in range(C)]
        recv_pairs = [sum(cnt[s][me][c][1] for s in range(R)) for c in range(C)]
        S = sum(map(sum, send_splits))
        send_tok, rev, send_ids, send_w = send_tok[:S], rev[:S], send_ids[:S], send_w[:S]
        ov = _Streams(dev)
        plan = _Plan(T, send_tok, rev, tok_off, send_splits, recv_splits, ov)
        sizes = plan.sizes
        w1, b1, w2, b2 = weights[1:]
        # The overlapped backward (_LocalExperts) when training; the op's own autograd otherwise, and for fp32 on
        # CUDA (the op runs it in bf16 through moe_deepep's conversion).
        overlap = self.overlap_backward and torch.is_grad_enabled() and not (x2.is_cuda and x2.dtype == torch.float32)
        if overlap:
            return self._forward_overlapped(x2, shape, plan, ov, send_w, send_ids, recv_pairs, aux, (w1, b1, w2, b2))

        # Dispatch every chunk on the side stream (gather, rows, routing), in chunk order.
        ov.side_waits_main()
        ov.for_side(x2, send_w, send_ids)
        recv, ready = [], []
        with ov.on_side():
            send_x = _DispatchGather.apply(plan, x2)
            for c, (w_c, i_c) in enumerate(zip(send_w.split(sizes), send_ids.split(sizes))):
                recv_x = _RowsExchange.apply(send_x[c], plan, c, group, False)
                recv_w, recv_ids = _MetaExchange.apply(w_c, i_c, plan, c, group)
                recv.append((recv_x, recv_w, recv_ids))
                ready.append(ov.side_event())
        del send_x  # [S, H], read by the exchanges only: not kept through the experts

        # 4-5. Chunk by chunk: the experts on the main stream once the chunk's rows are in, then its combine on the
        # side stream (under the next chunk's experts); the sum once every chunk is back.
        backs = []
        for c, (recv_x, recv_w, recv_ids) in enumerate(recv):
            ov.main_waits(ready[c])
            y = moe_deepep(recv_x, recv_ids, recv_w, w1, b1, w2, b2, self.activation_function,
                           accumulate_main_grad=self.accumulate_main_grad,
                           num_pairs=recv_pairs[c], precision=precision,
                           fp8_weights=self._local_fp8_weights(recv_x, weights))
            ov.side_waits_main()
            ov.for_side(y)
            with ov.on_side():
                backs.append(_RowsExchange.apply(y, plan, c, group, True))
        ov.main_waits_side()
        out = _CombineSum.apply(plan, *backs)
        return out.reshape(shape), aux

    def _local_fp8_weights(self, x, weights):
        """The local experts' quantised W1 and W2 from the FP8 weight cache (MoE's: fp8_weight_cache), or None, for a
        call computing with `weights` (_weights(): the parameters or their autocast copies)."""
        return self._fp8_weights(x, self.c_fc.weight, self.c_proj.weight, self.activation_function.value,
                                 weights[1].dtype)

    def dispatch_mode(self) -> str:
        """The exchange the forward uses (R > 1): `dispatch`, or for "auto" "all_gather" when chunks = 1, the
        backward is unsplit and a token reaches another rank with probability >= 0.9 under uniform routing (E = 128,
        K = 8: 0.996 at R = 2, 0.906 at R = 4, 0.67 at R = 8), else "all_to_all"."""
        C = self._chunk_count()
        if self.overlap_backward and self.precision in _FP8:
            raise ValueError("sonicmoe_cpp.ExpertParallelMoE: overlap_backward=True is not supported with precision "
                             "'fp8' (the two-part backward is bf16 only)")
        if self.dispatch == "all_gather" and (C != 1 or self.overlap_backward):
            raise ValueError(f"sonicmoe_cpp.ExpertParallelMoE: dispatch='all_gather' takes chunks=1 and "
                             f"overlap_backward=False, got chunks={C}, overlap_backward={self.overlap_backward} "
                             "(use dispatch='all_to_all' or 'auto')")
        if self.dispatch != "auto":
            return self.dispatch
        if C == 1 and not self.overlap_backward and \
                _uniform_fill(self.num_experts, self.top_k, self.ep_size) >= _AUTO_ALL_GATHER_FILL:
            return "all_gather"
        return "all_to_all"

    def _forward_gathered(self, x2, shape, logits, topk_ids, topk_w, f_local, keep, precision, weights):
        """Steps 2-5 with the all-gather dispatch (DESIGN.md section 10): every rank's tokens go to every rank
        (all_gather_into_tensor of x, padded to the group's largest T, and of the routing), each rank runs its
        experts on all of them (a row without local experts costs no GEMM work and comes out zero), and
        reduce_scatter_tensor sums each token's R partial rows back at its source. No gather of send rows, no plan,
        no sum kernel; the backward is the same two collectives swapped. The one host read: the group's token counts
        (the padding) and this rank's pair count (the op's size).

        The exchanges do not wait for that read when every rank's T is at most _early_rows (the group's largest T of
        the previous step, the same on every rank): the routing and x, padded or cut to that many rows, are gathered
        right after the statistics, so that x travels while the host reads the counts and launches the rest. When
        some rank's T is larger this time, the read shows it on every rank and both are gathered again at the new
        size. keep [T, K] (the capacity's, or None): the dropped pairs go out with id -1 and weight 0."""
        import torch.distributed as dist
        T, E, K, R, El, me = x2.shape[0], self.num_experts, self.top_k, self.ep_size, self.num_local_experts, \
            self.ep_rank
        group = self.ep_group
        f_sent = f_local  # f_local, the aux loss's: the router's choices, before a capacity's drop
        if keep is not None:
            f_sent = torch.zeros_like(f_local).scatter_add_(0, topk_ids.reshape(-1), keep.reshape(-1).long())
            topk_ids = torch.where(keep, topk_ids, -1)
            topk_w = torch.where(keep, topk_w, 0.0)
        # the pairs sent to each rank: the top-K rows of its experts
        mine, p_local = _local_stats(logits, f_local, f_sent.view(R, El).sum(1))
        stats = mine.new_empty((R * mine.shape[0],))
        dist.all_gather_into_tensor(stats, mine, group=group)
        stats = stats.view(R, -1)
        reader = _HostRead(stats[:, 2 * E:].long())  # [source, (T, pairs to each rank, ok)]
        ids32 = topk_ids.to(torch.int32)

        def exchange(rows):  # rows past T (up to the gathered size): expert id -1 (no local expert anywhere), weight 0
            x_rows = _pad_rows(x2, rows)
            recv_w, recv_ids = _GatherRouting.apply(_pad_rows(topk_w, rows), _pad_rows(ids32, rows, -1), group, R)
            gathering = _EarlyGather(x_rows, group, R)  # queued right behind the routing's, ahead of the pairs' launches
            pairs = _LocalPairs(recv_ids, recv_w, El, me)  # found before the host read, on the early exchange
            return rows, pairs, x_rows, gathering

        early = exchange(self._early_rows) if self._early_rows > 0 else None
        aux = _aux_loss(stats, p_local, E)
        counts = reader.wait().tolist()
        _check_flags(counts)
        T_max = max(c[0] for c in counts)
        num_pairs = sum(c[1 + me] for c in counts)
        self._early_rows = T_max  # every rank sets the same: the next step's early exchange
        if early is not None and (T_max > early[0] or T_max == 0):  # some rank's T did not fit, or no tokens
            early[3].wait()
            early = None
        w1, b1, w2, b2 = weights[1:]
        if T_max == 0:  # no tokens anywhere: nothing to exchange (every rank takes this branch)
            out = _no_rows(x2, w1, b1, w2, b2, topk_w, self.activation_function, self.accumulate_main_grad)
            return out.reshape(shape), aux
        rows, pairs, x_rows, gathering = early if early is not None else exchange(T_max)
        pairs = pairs.cut(num_pairs)  # before the stream waits for x's rows
        if self._split_sums(x_rows, precision):
            targets = None
            if self.accumulate_main_grad:
                targets = _pkg()._ops.main_grad_params(None, w1, b1, w2, b2)
            out = _SplitExperts.apply(_SplitSum(group, R, me, rows), targets, gathering, x_rows, pairs[2], w1, b1, w2,
                                      b2, pairs[0], pairs[1], _pkg()._act_name(self.activation_function))
        else:
            recv_x = _RowsCollective.apply(x_rows, group, R, True, gathering)  # [R rows, H]
            y = _pkg().moe_general_routing(recv_x, *pairs, w1, b1, w2, b2, self.activation_function,
                                           accumulate_main_grad=self.accumulate_main_grad, precision=precision,
                                           fp8_weights=self._local_fp8_weights(recv_x, weights))
            out = _RowsCollective.apply(y, group, R, False)
        if T < rows:  # sliced only when padded: a slice's backward copies the whole gradient
            out = out[:T]
        return out.reshape(shape), aux

    def _split_sums(self, x_rows, precision) -> bool:
        """Whether the all-gather dispatch sums y and dx around their exchanges (_SplitExperts): when training
        (grad mode, not under torch.compile), precision bf16, x in a dtype the layer's op takes on its device, unless
        `split_sums` is False (gather_sum over every token, then reduce_scatter_tensor: ep_bench.py's comparison)."""
        return (self.split_sums and self.ep_size > 1 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and precision == "bf16" and not (x_rows.is_cuda and x_rows.dtype == torch.float32))

    def _forward_overlapped(self, x2, shape, plan, ov, send_w, send_ids, recv_pairs, aux, weights):
        """Steps 3-5 with one _LocalExperts node per chunk (its backward overlaps the dispatch's reverse exchange with
        the weight gradients): the dispatch exchanges run here, outside autograd, and the node takes what they sent."""
        group, sizes = self.ep_group, plan.sizes
        targets = None
        if self.accumulate_main_grad:
            targets = _pkg()._ops.main_grad_params(None, *weights)
        act = _pkg()._act_name(self.activation_function)
        ov.side_waits_main()
        ov.for_side(x2, send_w, send_ids)
        recv, ready = [], []
        with ov.on_side():
            send_x = _DispatchGather.apply(plan, x2)
            with torch.no_grad():
                for c, (w_c, i_c) in enumerate(zip(send_w.split(sizes), send_ids.split(sizes))):
                    recv_x = ov.for_main(send_x[c].new_empty((sum(plan.recv_splits[c]), x2.shape[1])))
                    _a2a_into(recv_x, send_x[c], plan.recv_splits[c], plan.send_splits[c], group)
                    recv.append((recv_x,) + _meta_a2a(w_c, i_c, plan, c, group))
                    ready.append(ov.side_event())
        backs = []
        for c, (send_x_c, w_c) in enumerate(zip(send_x, send_w.split(sizes))):
            ov.main_waits(ready[c])
            chunk = _Chunk(plan, c, group if self.overlap_group is None else self.overlap_group, recv[c],
                           recv_pairs[c], act, targets, self.overlap_sm_margin, self.overlap_dw2,
                           self.backward_events)
            recv[c] = None
            y = _LocalExperts.apply(send_x_c, w_c, *weights, chunk)
            ov.side_waits_main()
            ov.for_side(y)
            with ov.on_side():
                backs.append(_RowsExchange.apply(y, plan, c, group, True))
        del send_x
        ov.main_waits_side()
        out = _CombineSum.apply(plan, *backs)
        return out.reshape(shape), aux

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation_function.value}"
                f"{_pkg()._router_extra_repr(self.router_config)}, ep_size={self.ep_size}, ep_rank={self.ep_rank}, local_experts=[{self.local_expert_offset}, "
                f"{self.local_expert_offset + self.num_local_experts}), chunks={self.chunks or 'default'}, "
                f"overlap_backward={self.overlap_backward}, overlap_sm_margin={self.overlap_sm_margin}, "
                f"overlap_dw2={self.overlap_dw2}, dispatch={self.dispatch}"
                + (f", precision={self.precision}" if self.precision != "bf16" else ""))


def shard_moe_state_dict(state_dict: Dict[str, torch.Tensor], rank: int, world_size: int) -> Dict[str, torch.Tensor]:
    """Rank `rank`'s `ExpertParallelMoE` state dict from a full `MoE` state dict (keys may carry a prefix): the
    expert tensors (c_fc.weight/bias, c_proj.weight/bias) sliced to experts [rank E/R, (rank+1) E/R) (copies), every
    other entry (the router) copied whole."""
    rank = _pkg()._int_arg("rank", rank, "sonicmoe_cpp.shard_moe_state_dict")
    world_size = _pkg()._int_arg("world_size", world_size, "sonicmoe_cpp.shard_moe_state_dict")
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

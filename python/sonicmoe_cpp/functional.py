"""The original SonicMoE's functional API (sonicmoe.functional) by name, over this library's ops.

    from sonicmoe_cpp.functional import moe_TC_softmax_topk_layer, moe_general_routing_inputs
    o, router_logits, expert_frequency = moe_TC_softmax_topk_layer(
        x, moe.router.weight, moe.c_fc.weight.permute(1, 2, 0), moe.c_fc.bias,
        moe.c_proj.weight.permute(1, 2, 0), moe.c_proj.bias, K, stream_id)
    o, expert_frequency = moe_general_routing_inputs(
        x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id, "swiglu")

Weight layouts are the original's: w1 [2I (GLU) or I, H, E] and w2 [H, I, E], the `.permute(1, 2, 0)` views of
the module's `c_fc.weight [E, 2I, H]` / `c_proj.weight [E, H, I]`; b1 [E, 2I], b2 [E, H] (both given or both None).
They are mapped back with `.permute(2, 0, 1)`: free when the argument is such a view of a contiguous tensor,
otherwise a contiguous copy per call (its gradient still reaches the argument).

Deliberate differences from the original are listed in python/README.md ("The original's functional API").
"""
import os
from contextlib import contextmanager
from typing import Optional, Tuple, Union

import torch

from . import _ops  # noqa: F401  (registers the ops' autograd and fake kernels)

__all__ = ["moe_TC_softmax_topk_layer", "moe_general_routing_inputs", "count_cumsum", "enable_quack_gemm",
           "is_using_quack_gemm"]

_QUACK_GEMM = [os.getenv("USE_QUACK_GEMM", "0") == "1"]


@contextmanager
def enable_quack_gemm(enable: bool = True):
    """The original's switch between its own GEMMs and QuACK's (a context manager, USE_QUACK_GEMM=1 its default).
    Accepted so that code written for the original runs: this library runs its own Hopper GEMMs either way, and
    the flag only changes what is_using_quack_gemm() reports."""
    from . import _bool_arg
    enable = _bool_arg("enable", enable, "sonicmoe_cpp.enable_quack_gemm")
    previous = _QUACK_GEMM[0]
    _QUACK_GEMM[0] = enable
    try:
        yield
    finally:
        _QUACK_GEMM[0] = previous


def is_using_quack_gemm() -> bool:
    return _QUACK_GEMM[0]


@torch.no_grad()
def count_cumsum(x: torch.Tensor, E: int,
                 do_cumsum: bool = True) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The original's count_cumsum: how often each expert id 0..E-1 occurs in the 1-D int32 / int64 tensor x
    (int32 [E]) and, with do_cumsum, the inclusive prefix sums of those counts (int32 [E]). No host sync; an id
    outside [0, E) is a ValueError in eager mode (checked with one host read) and is not counted under
    torch.compile (where no host read is allowed)."""
    fn = "sonicmoe_cpp.count_cumsum"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: argument 'x' must be a tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{fn}: argument 'x' has shape {tuple(x.shape)}, expected a 1-D tensor")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: argument 'x' has dtype {x.dtype}, expected torch.int32 or torch.int64")
    if not torch.compiler.is_compiling():  # (under torch.compile E may be symbolic: not checked there)
        if isinstance(E, bool) or not hasattr(E, "__index__") or E.__index__() < 1:
            raise ValueError(f"{fn}: argument 'E' = {E!r}, expected an integer >= 1")
        E = E.__index__()
    from . import _bool_arg
    do_cumsum = _bool_arg("do_cumsum", do_cumsum, fn)
    idx = x.to(torch.int64)
    valid = (idx >= 0) & (idx < E)
    if not torch.compiler.is_compiling() and x.numel() > 0 and x.device.type != "meta" and not bool(valid.all()):
        bad = idx[~valid][0].item()
        raise ValueError(f"{fn}: argument 'x' holds expert id {bad}, outside [0, E = {E})")
    counts = _counts(torch.where(valid, idx, E), E + 1)[:E]  # ids out of range land in a last bin, dropped
    if do_cumsum:
        return counts, counts.cumsum(0, dtype=torch.int32)
    return counts

_GLU = ("swiglu", "geglu", "reglu", "geglu_tanh")
_FWD_LOGITS = 3   # torch.ops.sonicmoe.forward's outputs: (output, aux_loss, z, logits, ..., counts, ...)
_FWD_COUNTS = 10


def _activation(a, fn) -> str:
    """The activation's name (sonicmoe_cpp.ActivationType, the original's enum, or a string); the error names
    'activation_type'."""
    from . import _act_name
    return _act_name(a, f"sonicmoe_cpp.{fn}: argument 'activation_type'")


def _tensor(fn, name, t, dim, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sonicmoe_cpp.{fn}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument '{name}' has {t.dim()} dimensions (shape {tuple(t.shape)}), "
                         f"expected {dim}")


def _expert_major(w: torch.Tensor) -> torch.Tensor:
    """[A, B, E] (the original's layout) -> [E, A, B] contiguous. Free (a view, same data_ptr) when `w` is
    `t.permute(1, 2, 0)` of a contiguous [E, A, B] tensor; otherwise a contiguous copy."""
    m = w.permute(2, 0, 1)
    return m if m.is_contiguous() else m.contiguous()


def _map_experts(fn, x, w1, b1, w2, b2, act, E_router=None):
    """Checks the original's layouts and returns (w1 [E, ZW, H], b1 [E, ZW], w2 [E, H, I], b2 [E, H], E). W1's row
    order (concat_layout) is left as it is: the op reads it in place (its w1_layout argument)."""
    _tensor(fn, "x", x, 2)
    _tensor(fn, "w1", w1, 3)
    _tensor(fn, "w2", w2, 3)
    _tensor(fn, "b1", b1, 2, optional=True)
    _tensor(fn, "b2", b2, 2, optional=True)
    if (b1 is None) != (b2 is None):
        given, missing = ("b1", "b2") if b2 is None else ("b2", "b1")
        raise ValueError(f"sonicmoe_cpp.{fn}: argument '{given}' is given but '{missing}' is None: pass both "
                         "biases or neither")
    T, H = x.shape
    Hw2, I, E = w2.shape
    glu = act in _GLU
    ZW = 2 * I if glu else I
    if Hw2 != H:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'w2' has shape {tuple(w2.shape)}, expected [H, I, E] with "
                         f"H = {H} (x's last dimension)")
    if w1.shape[2] != E:
        raise ValueError(f"sonicmoe_cpp.{fn}: arguments 'w1' {tuple(w1.shape)} and 'w2' {tuple(w2.shape)} disagree "
                         f"on E (last dimension): {w1.shape[2]} vs {E}; expected w1 [2I or I, H, E] and w2 [H, I, E] "
                         "(c_fc.weight.permute(1, 2, 0), c_proj.weight.permute(1, 2, 0))")
    if tuple(w1.shape) != (ZW, H, E):
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'w1' has shape {tuple(w1.shape)}, expected "
                         f"[{'2I' if glu else 'I'}, H, E] = [{ZW}, {H}, {E}] (activation {act}; I and E from w2 "
                         f"{tuple(w2.shape)}, H from x)")
    if E_router is not None and E_router != E:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'router_w' has {E_router} experts but 'w1'/'w2' have {E}")
    if b1 is not None and tuple(b1.shape) != (E, ZW):
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'b1' has shape {tuple(b1.shape)}, expected [E, "
                         f"{'2I' if glu else 'I'}] = [{E}, {ZW}]")
    if b2 is not None and tuple(b2.shape) != (E, H):
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'b2' has shape {tuple(b2.shape)}, expected [E, H] = [{E}, {H}]")
    w1m, w2m = _expert_major(w1), _expert_major(w2)
    return w1m, b1, w2m, b2, E


def _counts(expert_idx: torch.Tensor, E: int) -> torch.Tensor:
    """bincount(expert_idx, minlength=E) as int32, without a host sync (the output size is E, not max + 1)."""
    idx = expert_idx.reshape(-1).to(torch.int64)
    return torch.zeros(E, dtype=torch.int32, device=idx.device).scatter_add_(
        0, idx, torch.ones(idx.shape, dtype=torch.int32, device=idx.device))


def _to_int32(fn, name, t: torch.Tensor) -> torch.Tensor:
    """An int32 / int64 index tensor as int32 (contiguous). An int64 value outside the int32 range must not wrap
    around into a valid index: on the CPU it is a ValueError naming it; elsewhere (no host read) it becomes -1, which
    the op rejects as out of range."""
    if t.dtype == torch.int32:
        return t.contiguous()
    lo, hi = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
    fits = (t >= lo) & (t <= hi)
    if t.device.type == "cpu" and not torch.compiler.is_compiling():
        if t.numel() > 0 and not bool(fits.all()):
            i = int((~fits).nonzero()[0, 0])
            raise ValueError(f"sonicmoe_cpp.{fn}: argument '{name}'[{i}] = {int(t[i])} does not fit in int32 "
                             "(the op's index type); expected an index in range")
        return t.to(torch.int32).contiguous()
    return torch.where(fits, t, torch.full_like(t, -1)).to(torch.int32).contiguous()


class _DifferentiableLogits(torch.autograd.Function):
    """The op's fp32 router logits (x @ router_w^T, computed inside the fused forward and returned without a
    gradient), given a gradient to x and router_w: dx = g @ W, dW = g^T @ x (fp32, cast to each input's dtype).
    Nothing is recomputed in the forward; the backward runs only when the logits are used in the loss."""

    @staticmethod
    def forward(ctx, logits, x, router_w):
        ctx.save_for_backward(x, router_w)
        ctx.set_materialize_grads(False)
        return logits

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        x, w = ctx.saved_tensors
        g = g.float()
        dx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[1] else None
        dw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[2] else None
        return None, dx, dw


def _fused_topk(x, router_w, w1, b1, w2, b2, act, K, inference, router, w1_layout="interleaved"):
    """torch.ops.sonicmoe.forward with top-K routing under `router` (sonicmoe_cpp.router_args) -> (output,
    logits fp32 [T, E], counts int32 [E]). As sonicmoe_cpp's _run: fp32 CUDA inputs are computed in bf16 (the
    kernels are bf16), output back in fp32."""
    if x.is_cuda and x.dtype == torch.float32:
        bf = lambda t: t.to(torch.bfloat16) if t is not None and t.dtype == torch.float32 else t  # noqa: E731
        o, logits, counts = _fused_topk(bf(x), bf(router_w), bf(w1), bf(b1), bf(w2), bf(b2), act, K, inference,
                                        router, w1_layout)
        return o.float(), logits, counts
    args = (x, router_w, w1, b1, w2, b2, act, K, "topk", 128, None, None, None, *router)
    if w1_layout != "interleaved":  # the ops' last arguments: precision, then the W1 layout
        args = args + ("bf16", w1_layout)
    if inference:
        # The fused forward (not torch.ops.sonicmoe.inference, which returns neither the logits nor the counts):
        # no autograd graph, and the state outputs are dropped on return.
        with torch.no_grad():
            outs = torch.ops.sonicmoe.forward(*args)
    else:
        outs = torch.ops.sonicmoe.forward(*args)
    return outs[0], outs[_FWD_LOGITS], outs[_FWD_COUNTS]


def _general(x, tok, exp, scores, w1, b1, w2, b2, act, inference, w1_layout="interleaved"):
    """sonicmoe_cpp.moe_general_routing; with `inference`, torch.ops.sonicmoe.inference (no state kept)."""
    from . import _run
    out, _ = _run(x, None, w1, b1, w2, b2, act, 1, "general", 128, tok, exp, scores, inference=inference,
                  w1_layout=w1_layout)
    return out


def moe_TC_softmax_topk_layer(x: torch.Tensor, router_w: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                              w2: torch.Tensor, b2: Optional[torch.Tensor], K: int, stream_id: int = 0,
                              activation_type="swiglu", is_inference_mode_enabled: bool = False,
                              is_softmax_over_topk: bool = True, norm_topk_probs: bool = False,
                              concat_layout: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-choice top-K MoE layer with the original's signature.

    x [T, H]; router_w [E, H]; w1 [2I (GLU) or I, H, E] and w2 [H, I, E] (`c_fc.weight.permute(1, 2, 0)`,
    `c_proj.weight.permute(1, 2, 0)`: free; any other layout costs a contiguous copy per call); b1 [E, 2I or I],
    b2 [E, H] or both None. `stream_id` is ignored (the current stream is used). `activation_type`: ActivationType
    or its name.

    Returns (o [T, H] x.dtype, router_logits [T, E] float32, expert_frequency [E] int32). Gradients flow to x,
    router_w, w1, b1, w2, b2, through o and through router_logits (the logits are fp32, not x.dtype as in the
    original; their gradient is cast to x's / router_w's dtype).

    Routing (both fused in the op's top-K kernel; sonicmoe_cpp.MoE's router keywords):
      - is_softmax_over_topk=True (default): top-K of the fp32 logits (ties to the lower expert id), softmax over
        the K. norm_topk_probs then changes nothing (K softmax weights already sum to 1; the renormalisation's
        Jacobian vanishes on the simplex).
      - is_softmax_over_topk=False (Qwen3 / OLMoE): softmax over all E fp32 logits, top-K of the probabilities
        (ties to the lower expert id), renormalised over the K when norm_topk_probs; gradients reach router_w
        through the scores.
    concat_layout=True: w1's rows (and b1's) are [gate_0..gate_{I-1}, up_0..up_{I-1}] instead of interleaved; the
    op reads them in that order in place (no copy; their gradients come back in it). Ignored for non-GLU
    activations.
    is_inference_mode_enabled=True: no autograd graph and no state kept; o, router_logits and expert_frequency
    carry no gradient.
    """
    fn = "moe_TC_softmax_topk_layer"
    from . import _bool_arg
    where = f"sonicmoe_cpp.{fn}"
    is_inference_mode_enabled = _bool_arg("is_inference_mode_enabled", is_inference_mode_enabled, where)
    is_softmax_over_topk = _bool_arg("is_softmax_over_topk", is_softmax_over_topk, where)
    norm_topk_probs = _bool_arg("norm_topk_probs", norm_topk_probs, where)
    concat_layout = _bool_arg("concat_layout", concat_layout, where)
    act = _activation(activation_type, fn)
    _tensor(fn, "x", x, 2)
    _tensor(fn, "router_w", router_w, 2)
    if router_w.shape[1] != x.shape[1]:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'router_w' has shape {tuple(router_w.shape)}, expected "
                         f"[E, H] with H = {x.shape[1]} (x's last dimension)")
    w1m, b1m, w2m, b2m, E = _map_experts(fn, x, w1, b1, w2, b2, act, E_router=router_w.shape[0])
    w1_layout = "concat" if concat_layout and act in _GLU else "interleaved"
    if isinstance(K, bool) or not hasattr(K, "__index__"):
        raise TypeError(f"sonicmoe_cpp.{fn}: argument 'K' must be an integer, got {K!r}")
    K = K.__index__()
    if not 1 <= K <= E:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument 'K' = {K}, expected 1 <= K <= E = {E}")
    inference = is_inference_mode_enabled
    x = x.contiguous()

    from . import router_args
    router = router_args(softmax_over_topk=is_softmax_over_topk, norm_topk_probs=norm_topk_probs,
                         where=f"sonicmoe_cpp.{fn}")
    if x.shape[0] == 0:  # no tokens (the op needs T >= 1): its checks on one zero token, then empty results
        with torch.no_grad():
            _fused_topk(x.new_zeros((1, x.shape[1])), router_w, w1m, b1m, w2m, b2m, act, K, True, router, w1_layout)
        from .torch_backend import zero_anchor
        anchor = zero_anchor(x, router_w, w1, b1, w2, b2)
        if inference or not torch.is_grad_enabled():
            anchor = anchor.detach()
        return (x.new_zeros(x.shape) + anchor.to(x.dtype), x.new_zeros((0, E), dtype=torch.float32) + anchor,
                torch.zeros(E, dtype=torch.int32, device=x.device))
    o, logits, counts = _fused_topk(x, router_w, w1m, b1m, w2m, b2m, act, K, inference, router, w1_layout)
    if not inference and torch.is_grad_enabled() and (x.requires_grad or router_w.requires_grad):
        logits = _DifferentiableLogits.apply(logits, x, router_w)
    return o, logits, counts


def moe_general_routing_inputs(x: torch.Tensor, router_scores: torch.Tensor, token_indices: torch.Tensor,
                               expert_indices: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                               w2: torch.Tensor, b2: Optional[torch.Tensor], E: int, stream_id: int = 0,
                               activation_type="swiglu", is_inference_mode_enabled: bool = False,
                               concat_layout: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """MoE over caller-given (token, expert, score) triples, with the original's signature.

    router_scores, token_indices, expert_indices: flat [TK], token_indices sorted ascending. router_scores are
    cast to fp32 (differentiable: they receive a gradient in their own dtype); int64 indices are converted to
    int32 (a copy of each index array per call). `E` is ignored: the expert count is w2's (as in the original).
    `stream_id` is ignored (current stream). Weights as in moe_TC_softmax_topk_layer (w1 [2I or I, H, E],
    w2 [H, I, E], concat_layout likewise).

    Returns (o [T, H] x.dtype, expert_frequency [E] int32: the pairs per expert, computed without a host sync).
    """
    fn = "moe_general_routing_inputs"
    from . import _bool_arg
    where = f"sonicmoe_cpp.{fn}"
    is_inference_mode_enabled = _bool_arg("is_inference_mode_enabled", is_inference_mode_enabled, where)
    concat_layout = _bool_arg("concat_layout", concat_layout, where)
    act = _activation(activation_type, fn)
    w1m, b1m, w2m, b2m, E = _map_experts(fn, x, w1, b1, w2, b2, act)
    w1_layout = "concat" if concat_layout and act in _GLU else "interleaved"
    _tensor(fn, "router_scores", router_scores, 1)
    _tensor(fn, "token_indices", token_indices, 1)
    _tensor(fn, "expert_indices", expert_indices, 1)
    n = router_scores.shape[0]
    for name, t in (("token_indices", token_indices), ("expert_indices", expert_indices)):
        if t.shape[0] != n:
            raise ValueError(f"sonicmoe_cpp.{fn}: argument '{name}' has {t.shape[0]} entries but 'router_scores' "
                             f"has {n}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"sonicmoe_cpp.{fn}: argument '{name}' has dtype {t.dtype}, expected torch.int32 or "
                            "torch.int64")
    if not router_scores.is_floating_point():
        raise TypeError(f"sonicmoe_cpp.{fn}: argument 'router_scores' has dtype {router_scores.dtype}, expected a "
                        "floating-point dtype")
    tok = _to_int32(fn, "token_indices", token_indices)
    exp = _to_int32(fn, "expert_indices", expert_indices)
    scores = router_scores.to(torch.float32).contiguous()
    o = _general(x.contiguous(), tok, exp, scores, w1m, b1m, w2m, b2m, act, is_inference_mode_enabled,
                 w1_layout)
    return o, _counts(exp, E)

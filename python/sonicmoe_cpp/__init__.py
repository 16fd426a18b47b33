"""sonicmoe_cpp: PyTorch binding of the sonicmoe C++/CUDA library (SonicMoE MoE layers).

    from sonicmoe_cpp import MoE, ActivationType
    moe = MoE(num_experts=64, num_experts_per_tok=8, hidden_size=1024, intermediate_size=512,
              activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02)
    out, aux_loss = moe(x)                      # x [T, H] or [B, S, H]

Functional entries: moe_topk, moe_general_routing, moe_token_rounding. Ops: torch.ops.sonicmoe.forward /
torch.ops.sonicmoe.backward (autograd and fake implementations registered: torch.compile works).
"""
import contextlib
from enum import Enum
from typing import Optional, Tuple

import torch
import torch.nn as nn

from . import _ops
from . import fp8_cache as _fp8_cache
from . import w1_separate as _w1_separate
from ._ops import built_with_cuda, normalize_precision, normalize_routing

# Index of the forward op's `dropped` output (the capacity's count of dropped pairs).
_DROPPED = 2 + _ops._STATE_NAMES.index("dropped")

__all__ = ["ActivationType", "KernelBackendMoE", "MoE", "Experts", "moe_topk", "moe_general_routing", "moe_token_rounding",
           "built_with_cuda", "is_glu", "router_args", "normalize_precision", "w1_to_interleaved", "w1_to_concat",
           "w1_from_gate_up", "w1_to_gate_up", "convert_moe_state_dict", "GateUpExperts", "W1_LAYOUTS",
           "SEPARATE_KEYS"]
__all__ += ["set_gemm_sm_margin", "gemm_sm_margin"]
__version__ = "0.1.0"


class KernelBackendMoE(str, Enum):
    """The original's kernel backend switch. sonicmoe and scattermoe run this library's Hopper kernels (CPU reference
    on CPU tensors) at the module's precision; sonicmoe_fp8 runs the call in FP8 blockwise (precision "fp8") whatever
    the module's precision; torch runs the same layer in plain PyTorch ops (sonicmoe_cpp.torch_backend), a reference
    to check the kernels against, as the original's torch backend is."""
    scattermoe = "scattermoe"
    torch = "torch"
    sonicmoe = "sonicmoe"
    sonicmoe_fp8 = "sonicmoe_fp8"


def _check_backend(b) -> KernelBackendMoE:
    try:
        return KernelBackendMoE(b.value if isinstance(b, Enum) else str(b))
    except ValueError:
        raise ValueError(f"sonicmoe_cpp: argument 'kernel_backend_moe' is {b!r}, expected one of "
                         f"{[m.value for m in KernelBackendMoE]}") from None


class ActivationType(str, Enum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"
    REGLU = "reglu"
    GELU = "gelu"
    RELU = "relu"
    SILU = "silu"
    RELU_SQ = "relu_sq"
    # The tanh approximation of GELU (torch's approximate="tanh"; the original's kernels compute GELU this way).
    GEGLU_TANH = "geglu_tanh"
    GELU_TANH = "gelu_tanh"


# Other names of the tanh GELU (Hugging Face's ACT2FN keys).
_ACT_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "geglu_pytorch_tanh": "geglu_tanh"}


def _act_name(a, where="sonicmoe_cpp: argument 'activation_function'") -> str:
    """The activation's name from ActivationType, any Enum whose value is a name (the original's ActivationType,
    a plain Enum), or a string in any case; ValueError starting with `where` otherwise."""
    name = a.value if isinstance(a, Enum) else a
    if isinstance(name, str):
        try:
            n = name.lower().replace("-", "_")
            return ActivationType(_ACT_ALIASES.get(n, n)).value
        except ValueError:
            pass
    raise ValueError(f"{where} is {a!r}, expected one of {[m.value for m in ActivationType]} "
                     "(or the ActivationType enum)")


def is_glu(activation) -> bool:
    return _act_name(activation) in ("swiglu", "geglu", "reglu", "geglu_tanh")


def set_gemm_sm_margin(sms: int) -> None:
    """SMs the library's persistent GEMM kernels leave idle (default 0): their grids take the device's SM count less
    `sms`, so that kernels of other streams run beside them instead of holding back the tiles of the CTAs they
    displace (the tile schedule is static). For NCCL's all-to-alls under ExpertParallelMoE's pipelined exchange
    (pair it with NCCL's own CTA limit, e.g. NCCL_MAX_CTAS). Process-wide; change it between layer calls."""
    sms = _int_arg("sms", sms)
    if sms < 0:
        raise ValueError(f"sonicmoe_cpp.set_gemm_sm_margin: argument 'sms' = {sms}, expected >= 0")
    _ops._C.set_gemm_sm_margin(sms)


def gemm_sm_margin() -> int:
    """The SMs the GEMM kernels leave idle (set_gemm_sm_margin)."""
    return int(_ops._C.gemm_sm_margin())


def _int_arg(name, v, where="sonicmoe_cpp"):
    """An integer argument: bools, fractions and non-numbers are errors, never truncated."""
    if isinstance(v, torch.SymInt):
        return v
    if isinstance(v, (bool, torch.Tensor)) or not hasattr(v, "__index__"):
        raise TypeError(f"{where}: argument '{name}' must be an integer, got {v!r}")
    return v.__index__()


def _bool_arg(name, v, where="sonicmoe_cpp"):
    """A flag: True / False (also numpy.bool_ and the integers 0 / 1). Anything else (a string such as "no" or
    "false", None, a tensor) is a TypeError, never read by its truth value."""
    if isinstance(v, bool):
        return v
    if type(v).__name__ in ("bool_", "bool") and type(v).__module__ == "numpy":
        return bool(v)
    if not isinstance(v, (torch.Tensor, float)) and hasattr(v, "__index__") and v.__index__() in (0, 1):
        return bool(v.__index__())
    raise TypeError(f"{where}: argument '{name}' must be a bool (True or False), got {v!r}")


def _float_arg(name, v, where="sonicmoe_cpp"):
    """A real number (int, float, numpy scalars); bools, strings, tensors and other objects are a TypeError."""
    import numbers
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: argument '{name}' must be a real number, got {v!r}")
    return float(v)


def _fp8_misfit(hidden_size, intermediate_size):
    """(name, value) of the first of hidden_size / intermediate_size that is not a multiple of the FP8 block (128),
    or None: the FP8 layer's shape rule, checked by the modules before the library (MoE, ExpertParallelMoE)."""
    for name, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if v % 128:
            return name, v
    return None


def _layer_sizes(cls, num_experts, num_experts_per_tok, hidden_size, intermediate_size):
    """(E, K, H, I) as integers, each >= 1 and K <= E; errors name the constructor argument."""
    sizes = {n: _int_arg(n, v) for n, v in (("num_experts", num_experts), ("num_experts_per_tok", num_experts_per_tok),
                                            ("hidden_size", hidden_size), ("intermediate_size", intermediate_size))}
    for name, v in sizes.items():
        if v < 1:
            raise ValueError(f"sonicmoe_cpp.{cls}: argument '{name}' = {v}, expected >= 1")
    E, K, H, I = sizes.values()
    if K > E:
        raise ValueError(f"sonicmoe_cpp.{cls}: argument 'num_experts_per_tok' = {K} exceeds num_experts = {E}")
    return E, K, H, I


def _std_arg(std, where):
    """The constructors' init std: a finite real number >= 0."""
    std = _float_arg("std", std, where)
    if not (std >= 0.0 and std != float("inf")):
        raise ValueError(f"{where}: argument 'std' = {std}, expected a finite value >= 0")
    return std


def router_args(scoring_func="softmax", softmax_over_topk=True, norm_topk_probs=False, n_group=1, topk_group=1,
                routed_scaling_factor=1.0, e_score_correction_bias=None, capacity_factor=None, where="sonicmoe_cpp"):
    """The ops' router arguments (sonicmoe_cpp._ops.ROUTER_ARGS order), checked and normalised: Hugging Face's
    names; n_group / topk_group None mean 1; the bias (no gradient) as a contiguous float32 tensor; capacity_factor
    None or 0: no capacity."""
    if not isinstance(scoring_func, str) or scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"{where}: argument 'scoring_func' is {scoring_func!r}, expected 'softmax' or 'sigmoid'")
    softmax_over_topk = _bool_arg("softmax_over_topk", softmax_over_topk, where)
    norm_topk_probs = _bool_arg("norm_topk_probs", norm_topk_probs, where)
    n_group = 1 if n_group is None else _int_arg("n_group", n_group, where)
    topk_group = 1 if topk_group is None else _int_arg("topk_group", topk_group, where)
    scale = 1.0 if routed_scaling_factor is None else _float_arg("routed_scaling_factor", routed_scaling_factor, where)
    bias = e_score_correction_bias
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{where}: argument 'e_score_correction_bias' must be a tensor, got {type(bias).__name__}")
        if not (bias.is_floating_point() and bias.dim() == 1):
            raise ValueError(f"{where}: argument 'e_score_correction_bias' has dtype {bias.dtype} and shape "
                             f"{tuple(bias.shape)}, expected a floating-point [E] tensor (converted to float32)")
        bias = bias.detach().to(torch.float32).contiguous()
        if bias.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(torch.isfinite(bias).all()):
            raise ValueError(f"{where}: argument 'e_score_correction_bias' holds non-finite values (the expert "
                             "selection adds it to the scores)")
    capacity = 0.0 if capacity_factor is None else _float_arg("capacity_factor", capacity_factor, where)
    if not (capacity >= 0.0 and capacity != float("inf")):
        raise ValueError(f"{where}: argument 'capacity_factor' = {capacity_factor}, expected a finite value >= 0 "
                         "(None or 0: no capacity)")
    return (scoring_func, softmax_over_topk, norm_topk_probs, n_group, topk_group, scale, bias, capacity)


def _check_fp8_weights_arg(q, precision):
    """fp8_weights: the 8 tensors of fp8_quantize_weights, under an FP8 precision (the op checks their dtypes and the
    library their shapes)."""
    if precision not in _ops.FP8_PRECISIONS:
        raise ValueError(f"sonicmoe_cpp: argument 'fp8_weights' needs precision 'fp8' (got precision {precision!r})")
    n = len(_ops.FP8_WEIGHT_NAMES)
    if not isinstance(q, (list, tuple)) or len(q) != n or not all(isinstance(t, torch.Tensor) for t in q):
        what = f"{type(q).__name__} of {len(q)}" if isinstance(q, (list, tuple)) else type(q).__name__
        raise TypeError(f"sonicmoe_cpp: argument 'fp8_weights' must be a list of the {n} tensors of "
                        f"torch.ops.sonicmoe.fp8_quantize_weights ({', '.join(_ops.FP8_WEIGHT_NAMES)}), got {what}")


def _autocast_dtype(x) -> Optional[torch.dtype]:
    """The dtype torch.autocast computes in on x's device (bf16 or f16) while it is enabled there and x is a tensor it
    would cast (floating, not float64, as autocast's own rule), else None."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    dev = x.device.type
    if dev not in ("cpu", "cuda") or not torch.is_autocast_enabled(dev):  # (the library's devices; meta has none)
        return None
    dtype = torch.get_autocast_dtype(dev)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _run(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx, scores,
         inference=False, accumulate_main_grad=False, _main_grad_targets=None, router=None, precision="bf16",
         dropped_out=None, w1_layout="interleaved", fp8_weights=None, w1_up=None, b1_up=None):
    """(output, aux_loss); aux_loss is None for inference (no state kept, nothing for autograd).

    accumulate_main_grad: the backward adds the gradient of each weight that has an fp32 `main_grad` attribute into
    it and returns no gradient for that weight (param.grad stays None); the other weights as usual.
    router: router_args(...) for top-K routing (None: the default top-K softmax).
    precision: "bf16", "fp8" (FP8 blockwise expert GEMMs: H and I multiples of 128; bf16 weight gradients) or
    "fp8_wgrad" (the same with the weight gradients on FP8 operands too).
    dropped_out: a list that gets the pairs dropped by the router's capacity_factor (an int32 [1] tensor on x's
    device, no host sync) when the forward (training or inference) ran under a capacity.
    w1_layout: "interleaved", "concat" (w1's and b1's rows, and their gradients, as [gate; up] halves) or "separate"
    (w1 / b1 the gate [E, I, H] / [E, I], w1_up / b1_up the up tensors), read and written by the library in place (no
    copy; a separate pair whose addresses the layer cannot read in place is copied: sonicmoe_cpp.w1_separate);
    ignored for non-GLU activations (w1_up / b1_up then not given).
    fp8_weights: precision "fp8" only: w1 and w2 already quantised (torch.ops.sonicmoe.fp8_quantize_weights of the
    weights the layer computes with: the bf16 copies for fp32 weights on CUDA), or None (quantised in the call)."""
    precision = normalize_precision(precision)
    w1_layout = _w1_layout_arg(w1_layout)
    accumulate_main_grad = _bool_arg("accumulate_main_grad", accumulate_main_grad)
    if fp8_weights is not None:
        _check_fp8_weights_arg(fp8_weights, precision)
    separate = w1_layout == "separate" and is_glu(activation)
    if separate:
        if w1_up is None or (b1 is None) != (b1_up is None):
            raise ValueError("sonicmoe_cpp: w1_layout 'separate' needs 'w1_up' (and 'b1_up' with 'b1'): w1 / b1 are "
                             "the gate tensors")
        if precision in _ops.FP8_PRECISIONS:
            raise ValueError("sonicmoe_cpp: w1_layout 'separate' is not supported with precision 'fp8' (W1's 128x128 "
                             "quantisation blocks depend on the row order)")
        if accumulate_main_grad:
            raise ValueError("sonicmoe_cpp: accumulate_main_grad=True is not supported with w1_layout 'separate'")
    elif w1_up is not None or b1_up is not None:
        raise ValueError("sonicmoe_cpp: arguments 'w1_up' / 'b1_up' are for w1_layout 'separate' with a GLU "
                         "activation only")
    ac = _autocast_dtype(x)
    # (autocast's rule: floating tensors other than float64 are cast; the op refuses any other dtype)
    castable = lambda t: isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (ac, torch.float64)
    if ac is not None and any(castable(t) for t in (x, router_weight, w1, b1, w2, b2, w1_up, b1_up)):
        # torch.autocast on x's device: the layer computes in its dtype (x and the weights cast by differentiable
        # copies, as autocast's linear casts its operands) and returns the output in it; the router's logits and
        # scores stay fp32 as always. main_grad targets are the parameters themselves, found before the casts.
        if precision in _ops.FP8_PRECISIONS and ac != torch.bfloat16:
            raise ValueError(f"sonicmoe_cpp: precision {precision!r} computes from bfloat16 operands: not supported "
                             f"under torch.autocast(dtype={ac}) (use dtype=torch.bfloat16)")
        if accumulate_main_grad and not inference and _main_grad_targets is None and torch.is_grad_enabled():
            _main_grad_targets = _ops.main_grad_params(router_weight, w1, b1, w2, b2)
        c = lambda t: t.to(ac) if castable(t) else t
        w1, b1, w1_up, b1_up = c(w1), c(b1), c(w1_up), c(b1_up)
        if separate:  # the cast gate / up pair in one buffer (read in place, no cached copy of a temporary)
            w1, w1_up = _w1_separate.joined(w1, w1_up)
            if b1 is not None:
                b1, b1_up = _w1_separate.joined(b1, b1_up)
        with torch.autocast(x.device.type, enabled=False):
            return _run(c(x), c(router_weight), w1, b1, c(w2), c(b2), activation, top_k, routing, tile, token_idx,
                        expert_idx, scores, inference, accumulate_main_grad, _main_grad_targets, router, precision,
                        dropped_out, w1_layout, fp8_weights, w1_up, b1_up)
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 0:
        return _no_tokens(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx,
                          scores, inference, router, precision, w1_layout, fp8_weights, w1_up, b1_up)
    if accumulate_main_grad and not inference and _main_grad_targets is None and torch.is_grad_enabled():
        _main_grad_targets = _ops.main_grad_params(router_weight, w1, b1, w2, b2)
    if x.is_cuda and x.dtype == torch.float32:
        # The CUDA kernels are bf16 (tensor cores, fp32 accumulation): fp32 inputs are computed in bf16 and
        # the output (and, through autograd, every gradient) comes back in fp32, as under autocast.
        bf = lambda t: t.to(torch.bfloat16) if t is not None and t.dtype == torch.float32 else t
        if separate:  # the bf16 copies of a gate / up pair go into one buffer (read in place below)
            w1, w1_up = _w1_separate.joined(bf(w1), bf(w1_up))
            if b1 is not None:
                b1, b1_up = _w1_separate.joined(bf(b1), bf(b1_up))
        out, aux = _run(bf(x), bf(router_weight), bf(w1), bf(b1), bf(w2), bf(b2), activation, top_k, routing, tile,
                        token_idx, expert_idx, scores, inference, _main_grad_targets=_main_grad_targets,
                        router=router, precision=precision, dropped_out=dropped_out, w1_layout=w1_layout,
                        fp8_weights=fp8_weights, w1_up=w1_up, b1_up=b1_up)
        return out.float(), aux
    if separate:  # read in place when the addresses allow it, else from a cached copy (w1_separate.packed)
        w1, w1_up = _w1_separate.packed(w1, w1_up)
        if b1 is not None:
            b1, b1_up = _w1_separate.packed(b1, b1_up)
    args = (x, router_weight, w1, b1, w2, b2, _act_name(activation), _int_arg("top_k", top_k), routing,
            _int_arg("tile", tile), token_idx, expert_idx, scores)
    # precision, w1_layout, fp8_weights, w1_up, b1_up: the ops' last arguments, after the router's (their defaults
    # when not given)
    concat = w1_layout != "interleaved" and is_glu(activation)
    if concat or precision != "bf16":
        router = tuple(router if router is not None else router_args()) + (precision, w1_layout)
        if fp8_weights is not None or separate:
            router = router + (None if fp8_weights is None else list(fp8_weights),)
        if separate:
            router = router + (w1_up, b1_up)
    if router is not None:
        args = args + tuple(router)
    if inference:
        # dropped_out under a capacity: the op writes the count into a buffer of ours (no host read)
        capacity = router is not None and len(router) > _ops._CAPACITY_ARG and router[_ops._CAPACITY_ARG]
        buf = torch.zeros(1, dtype=torch.int32, device=x.device) if dropped_out is not None and capacity else None
        with torch.no_grad():  # nothing is kept for a backward: the output is a plain tensor
            out = torch.ops.sonicmoe.inference(*args, dropped_out=buf)
        if buf is not None:
            dropped_out.append(buf)
        return out, None
    if _main_grad_targets is not None:
        # the main_grads belong to the caller's tensors (before the bf16 copies above, on CUDA)
        outs = _ops.forward_main_grad(args, _main_grad_targets)
    else:
        outs = torch.ops.sonicmoe.forward(*args)
    if dropped_out is not None and outs[_DROPPED].numel() > 0:
        dropped_out.append(outs[_DROPPED])
    return outs[0], outs[1]


def _no_tokens(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx, scores,
               inference, router, precision, w1_layout, fp8_weights, w1_up, b1_up):
    """_run for x with T = 0 tokens (the op needs T >= 1): every argument is checked by running the op without
    gradients on one zero token (no pairs under general routing), then the [0, H] output and a zero aux loss are
    returned, connected to the inputs so that autograd gives zero gradients (not None), as for experts without rows."""
    if routing == "general":
        n = token_idx.shape[0] if isinstance(token_idx, torch.Tensor) and token_idx.dim() > 0 else 0
        if n:
            raise ValueError(f"sonicmoe_cpp: argument 'token_idx' has {n} entries but 'x' has T = 0 tokens: every "
                             "token id is out of range")
    with torch.no_grad():
        _run(x.new_zeros((1,) + tuple(x.shape[1:])), router_weight, w1, b1, w2, b2, activation, top_k, routing, tile,
             token_idx, expert_idx, scores, inference=True, router=router, precision=precision, w1_layout=w1_layout,
             fp8_weights=fp8_weights, w1_up=w1_up, b1_up=b1_up)
    from .torch_backend import zero_anchor  # 0 whatever the values (a NaN weight must not make the aux loss NaN)
    anchor = zero_anchor(x, router_weight, w1, b1, w2, b2, scores, w1_up, b1_up)
    if inference:
        with torch.no_grad():
            return x.new_zeros((0,) + tuple(x.shape[1:])), None
    out = x.new_zeros((0,) + tuple(x.shape[1:])) + anchor.to(x.dtype)
    return out, (anchor.float() + torch.zeros(1, dtype=torch.float32, device=x.device))


def moe_topk(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
             w2: torch.Tensor, b2: Optional[torch.Tensor], top_k: int, activation="swiglu",
             accumulate_main_grad: bool = False, precision: str = "bf16", w1_layout: str = "interleaved",
             w1_up: Optional[torch.Tensor] = None, b1_up: Optional[torch.Tensor] = None, fp8_weights=None,
             dropped_out: Optional[list] = None, **router) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-choice top-K MoE. x [T, H]; router_weight [E, H]; w1 [E, 2I (GLU) or I, H]; w2 [E, H, I].
    Returns (output [T, H], aux_loss [] fp32). accumulate_main_grad, precision: as `MoE`'s. w1_layout: "interleaved",
    "concat" (w1 / b1 rows [gate; up]) or "separate" (w1 / b1 the gate [E, I, H] / [E, I], w1_up / b1_up the up
    tensors; gradients to each), read in place (MoE's w1_layout). Router keywords (as `MoE`'s): scoring_func,
    softmax_over_topk, norm_topk_probs, n_group, topk_group, routed_scaling_factor, e_score_correction_bias (a
    float32 [E] tensor). fp8_weights: precision "fp8" only: w1 and w2 already quantised, the 8 tensors of
    torch.ops.sonicmoe.fp8_quantize_weights(w1, w2, activation, True) (what MoE's weight cache holds), or None
    (quantised in the call). dropped_out: a list that gets, under a capacity_factor, the pairs dropped (an int32 [1]
    tensor on x's device, no host sync: MoE's num_dropped)."""
    if dropped_out is not None and not isinstance(dropped_out, list):
        raise TypeError(f"sonicmoe_cpp.moe_topk: argument 'dropped_out' must be a list (it gets the dropped count), "
                        f"got {type(dropped_out).__name__}")
    out, aux = _run(x, router_weight, w1, b1, w2, b2, activation, top_k, "topk", 128, None, None, None,
                    accumulate_main_grad=accumulate_main_grad,
                    router=router_args(**router, where="sonicmoe_cpp.moe_topk") if router else None,
                    precision=precision, w1_layout=w1_layout, w1_up=w1_up, b1_up=b1_up, fp8_weights=fp8_weights,
                    dropped_out=dropped_out)
    return out, aux.reshape(())


def moe_general_routing(x: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor, scores: torch.Tensor,
                        w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor],
                        activation="swiglu", accumulate_main_grad: bool = False,
                        precision: str = "bf16", w1_layout: str = "interleaved",
                        w1_up: Optional[torch.Tensor] = None, b1_up: Optional[torch.Tensor] = None,
                        fp8_weights=None) -> torch.Tensor:
    """MoE over caller-given (token, expert, score) triples sorted by token (int32, int32, float32 [N]).
    Gradients flow to x, the weights and `scores`. accumulate_main_grad, precision: as `MoE`'s; w1_layout, w1_up,
    b1_up, fp8_weights: as moe_topk's."""
    out, _ = _run(x, None, w1, b1, w2, b2, activation, 1, "general", 128, token_idx, expert_idx, scores,
                  accumulate_main_grad=accumulate_main_grad, precision=precision, w1_layout=w1_layout, w1_up=w1_up,
                  b1_up=b1_up, fp8_weights=fp8_weights)
    return out


def moe_token_rounding(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                       w2: torch.Tensor, b2: Optional[torch.Tensor], top_k: int, activation="swiglu",
                       mode: str = "nearest", tile: int = 128,
                       accumulate_main_grad: bool = False,
                       precision: str = "bf16") -> Tuple[torch.Tensor, torch.Tensor]:
    """Tile-aware token rounding: each expert's token count rounded ("down", "up", "nearest") to a multiple
    of `tile`. Returns (output [T, H], aux_loss []). accumulate_main_grad, precision: as `MoE`'s."""
    routing = normalize_routing(mode if str(mode).startswith("round") else "round_" + str(mode))
    out, aux = _run(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, None, None, None,
                    accumulate_main_grad=accumulate_main_grad, precision=precision)
    return out, aux.reshape(())


# ---- W1 layouts: this library's interleaved gate/up rows and the layouts of other checkpoints ------------------------
# interleaved (this library's): c_fc.weight [E, 2I, H] rows [gate_0, up_0, gate_1, up_1, ...];
# concat (the original's concat_layout=True, Hugging Face, Megatron): rows [gate_0 .. gate_{I-1}, up_0 .. up_{I-1}];
# separate (torchtitan's w1 / w3): gate [E, I, H] and up [E, I, H]. Biases [E, 2I] follow their weight's rows
# (separate: gate and up biases [E, I]).
W1_LAYOUTS = ("interleaved", "concat", "separate")


def _w1_layout_arg(layout, where="sonicmoe_cpp: argument 'w1_layout'") -> str:
    """'interleaved', 'concat' (also 'concatenated') or 'separate'; ValueError starting with `where` otherwise."""
    v = "concat" if layout == "concatenated" else layout
    if v not in W1_LAYOUTS:
        raise ValueError(f"{where} is {layout!r}, expected one of {W1_LAYOUTS}")
    return v


def _check_w1(fn, name, w):
    """A W1 (or b1) tensor [E, 2I, ...] with gate/up rows: at least 2-D, an even row count."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"sonicmoe_cpp.{fn}: argument '{name}' must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() < 2 or w.shape[1] % 2:
        raise ValueError(f"sonicmoe_cpp.{fn}: argument '{name}' has shape {tuple(w.shape)}, expected [E, 2I, ...] "
                         "(gate and up rows: an even dimension 1)")


def w1_to_interleaved(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] concatenated rows -> interleaved rows (a copy)."""
    _check_w1("w1_to_interleaved", "w", w)
    E, ZW = w.shape[0], w.shape[1]
    return w.reshape(E, 2, ZW // 2, *w.shape[2:]).transpose(1, 2).reshape(E, ZW, *w.shape[2:]).contiguous()


def w1_to_concat(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] interleaved rows -> concatenated rows [gate; up] (a copy)."""
    _check_w1("w1_to_concat", "w", w)
    E, ZW = w.shape[0], w.shape[1]
    return w.reshape(E, ZW // 2, 2, *w.shape[2:]).transpose(1, 2).reshape(E, ZW, *w.shape[2:]).contiguous()


def w1_from_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Separate gate and up [E, I, ...] (torchtitan's w1, w3) -> interleaved [E, 2I, ...] (a copy)."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"sonicmoe_cpp.w1_from_gate_up: argument '{name}' must be a tensor [E, I, ...], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if gate.shape != up.shape:
        raise ValueError(f"sonicmoe_cpp.w1_from_gate_up: 'gate' {tuple(gate.shape)} and 'up' {tuple(up.shape)} differ")
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def w1_to_gate_up(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Interleaved [E, 2I, ...] -> (gate, up), each [E, I, ...] (copies)."""
    _check_w1("w1_to_gate_up", "w", w)
    return w[:, 0::2].contiguous(), w[:, 1::2].contiguous()


# MoE(w1_layout="separate")'s W1 entries: (gate, up) names of the weight [E, I, H] and of the bias [E, I].
SEPARATE_KEYS = (("c_fc.gate_weight", "c_fc.up_weight"), ("c_fc.gate_bias", "c_fc.up_bias"))


def convert_moe_state_dict(state_dict, to: str, activation="swiglu", prefix: str = "", from_layout=None):
    """A MoE state dict with W1 and b1 converted between the W1 layouts (W1_LAYOUTS): "interleaved" (this library's)
    and "concat" hold them as `prefix + "c_fc.weight"` [E, 2I, H] and `prefix + "c_fc.bias"` [E, 2I]; "separate"
    (MoE(w1_layout="separate")) as `c_fc.gate_weight`, `c_fc.up_weight` [E, I, H] and `c_fc.gate_bias`,
    `c_fc.up_bias` [E, I] (SEPARATE_KEYS). from_layout: the source layout; None: "separate" when the separate keys
    are there, else "concat" for `to` = "interleaved" and "interleaved" otherwise. Other entries are passed through;
    non-GLU activations have no gate/up rows and are returned unchanged. The converted entries are copies."""
    for name, v in (("to", to), ("from_layout", from_layout)):
        if v is not None and v not in W1_LAYOUTS:
            raise ValueError(f"sonicmoe_cpp.convert_moe_state_dict: argument '{name}' is {v!r}, expected one of "
                             f"{W1_LAYOUTS}")
    if not is_glu(activation):
        return dict(state_dict)
    if from_layout is None:
        if prefix + SEPARATE_KEYS[0][0] in state_dict:
            from_layout = "separate"
        else:
            from_layout = "concat" if to == "interleaved" else "interleaved"
    out = dict(state_dict)
    if from_layout == to:
        return out
    for joint, (gate_key, up_key) in zip(("c_fc.weight", "c_fc.bias"), SEPARATE_KEYS):
        joint, gate_key, up_key = prefix + joint, prefix + gate_key, prefix + up_key
        if from_layout == "separate":
            if out.get(gate_key) is None and out.get(up_key) is None:
                continue
            if out.get(gate_key) is None or out.get(up_key) is None:
                raise ValueError(f"sonicmoe_cpp.convert_moe_state_dict: '{gate_key}' and '{up_key}' must be given "
                                 "together (from_layout 'separate')")
            w = w1_from_gate_up(out.pop(gate_key), out.pop(up_key))
        else:
            if out.get(joint) is None:
                continue
            w = out.pop(joint)
            w = w1_to_interleaved(w) if from_layout == "concat" else w
        if to == "separate":
            out[gate_key], out[up_key] = w1_to_gate_up(w)
        else:
            out[joint] = w1_to_concat(w) if to == "concat" else w.contiguous()
    return out


class Experts(nn.Module):
    """Per-expert linear weights [E, out, in] (+ bias [E, out]), as in the original module; device / dtype as
    nn.Linear's factory keywords."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, add_bias: bool = False,
                 std: Optional[float] = None, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.std = std
        f = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **f))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **f)) if add_bias else None
        self.reset_parameters()

    def reset_parameters(self):
        std = self.std if self.std is not None else 0.02
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class GateUpExperts(nn.Module):
    """The experts' W1 as separate gate and up weights [E, I, H] (+ biases [E, I]): MoE(w1_layout="separate")'s c_fc,
    parameters gate_weight, up_weight, gate_bias, up_bias (torchtitan's w1 / w3). Each pair lives as the two halves
    of one allocation (w1_separate.pair_storage), kept so across .to / .cuda / dtype casts, so that the layer reads
    them in place (no copy per call)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, add_bias: bool = False,
                 std: Optional[float] = None, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.std = std
        w = _w1_separate.pair_storage((num_experts, out_features, in_features), dtype, device)
        self.gate_weight, self.up_weight = nn.Parameter(w[0]), nn.Parameter(w[1])
        if add_bias:
            b = _w1_separate.pair_storage((num_experts, out_features), dtype, device)
            self.gate_bias, self.up_bias = nn.Parameter(b[0]), nn.Parameter(b[1])
        else:
            self.gate_bias = self.up_bias = None
        self.reset_parameters()

    def reset_parameters(self):
        std = self.std if self.std is not None else 0.02
        for p in (self.gate_weight, self.up_weight):
            nn.init.normal_(p, mean=0.0, std=std)
        for p in (self.gate_bias, self.up_bias):
            if p is not None:
                nn.init.zeros_(p)

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self._repack()
        return self

    def _repack(self):
        """Puts each gate / up pair back into one allocation when a conversion gave them two (values unchanged)."""
        for g, u in ((self.gate_weight, self.up_weight), (self.gate_bias, self.up_bias)):
            if g is None or _w1_separate.addresses_ok(g, u):
                continue
            with torch.no_grad():
                g.data, u.data = _w1_separate.joined(g.detach(), u.detach())

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features} (gate and up each), bias={self.gate_bias is not None}")


class MoE(_fp8_cache.Fp8CachedModule, nn.Module):
    """Drop-in for the original SonicMoE `MoE` module (same constructor arguments and parameter names:
    router.weight [E, H], c_fc.weight [E, 2I or I, H], c_fc.bias, c_proj.weight [E, H, I], c_proj.bias).

    forward(x) with x [T, H] or [B, S, H] returns (output of x's shape, aux_loss scalar).
    Extra keyword arguments: routing ("topk", "round_nearest", "round_up", "round_down"), tile, and
    accumulate_main_grad (Megatron's gradient-accumulation fusion): the backward adds the gradient of each parameter
    that has an fp32 `main_grad` attribute of its shape into `param.main_grad` (in fp32) and leaves `param.grad`
    None (Megatron's `grad_added_to_main_grad` protocol is followed when the parameter has that attribute);
    parameters without `main_grad` get `.grad` as usual. Not under torch.compile.
    precision ("bf16"): "fp8" runs the expert GEMMs in FP8 blockwise (docs/ALGORITHM.md, "FP8 blockwise recipe": X,
    A, Z, dZ quantised 1x128, the weights 128x128; Z saved in FP8; the dgated GEMM on the bf16 dO and W2 and the
    weight gradients in bf16, so every gradient meets the precision gate; hidden_size and intermediate_size multiples
    of 128). forward(..., kernel_backend_moe=KernelBackendMoE.sonicmoe_fp8) does the
    same for one call. "fp8_wgrad": "fp8" with the weight gradients on FP8 operands too (MoEConfig::
    weight_grad_precision; slower than bf16 ones on an H100 and less precise: docs/notes/fp8_weight_grads.md).
    fp8_weight_cache (True): under precision "fp8", the quantised W1 (with its transposed copy, which the backward
    reads) and W2 are kept across calls and re-made only when a weight changes (an in-place update, a new tensor, an
    optimizer step: sonicmoe_cpp.fp8_cache says how it is keyed), so the micro-batches of one optimizer step quantise
    the weights once; bitwise the results of per-call quantisation. It holds E * (2 * z_width * H + H * I) bytes of
    codes, plus scales, while filled. Bypassed (per-call quantisation) under torch.compile, during CUDA-graph capture
    and under torch.inference_mode. False: per call (the training forward then quantises each weight once with its transposed
    copy and hands that to its backward). invalidate_fp8_weight_cache() empties it (needed only after writes
    through `param.data` outside a torch.optim step); it is emptied too when the module moves (.to, .cuda, ...), when
    precision or fp8_weight_cache is set, and freed with the module.
    concat_layout (False): the original's concat_layout=True: c_fc.weight's rows (and c_fc.bias's) are [gate_0 ..
    gate_{I-1}, up_0 .. up_{I-1}] (Hugging Face, Megatron) instead of this library's interleaved gate/up pairs. The
    kernels read and write that layout in place (no copy of the weight per call; the gradients come back in it);
    GLU activations only (ignored otherwise); not with precision "fp8". convert_moe_state_dict converts a state dict
    between the layouts.
    w1_layout (None): "interleaved", "concat" (= concat_layout=True) or "separate": W1 as separate gate and up
    weights (torchtitan's w1 / w3): c_fc is a GateUpExperts with parameters c_fc.gate_weight, c_fc.up_weight
    [E, I, H] (and c_fc.gate_bias, c_fc.up_bias [E, I] with add_bias), each pair the two halves of one allocation
    that the kernels read in place (a pair whose addresses do not allow that, e.g. after a sharding wrapper replaced
    the parameters, is copied per weight update with a warning: sonicmoe_cpp.w1_separate); the gradients come back in
    each parameter's .grad. GLU activations only (plain activations keep c_fc.weight); not with precision "fp8" or
    accumulate_main_grad.
    device, dtype (None): where and in what the parameters are made, as nn.Linear's factory keywords (dtype bf16,
    f16 or f32). Under a torch.device("meta") context the module is built without memory; to_empty(device=...)
    then reset_parameters() give it the constructor's initialisation.
    Under torch.autocast (bf16 or f16, on the input's device) a module of another dtype computes in autocast's dtype:
    the input and the weights are cast by differentiable copies (fp32 parameters get their gradients, or main_grad,
    in fp32) and the output comes back in that dtype, as autocast's linear does.

    Router keywords (Hugging Face names; top-K routing only; the defaults are the original's top-K, softmax over the
    K selected logits):
      scoring_func: "softmax" or "sigmoid" (DeepSeek-V3);
      is_softmax_over_topk / softmax_over_topk (True): softmax over the K selected logits (Mixtral); False: softmax
        over all E, top-K of the probabilities (Qwen3, OLMoE). Softmax only;
      norm_topk_probs / norm_topk_prob (False): weights renormalised over the K picks (+1e-20 under sigmoid);
      n_group, topk_group (1, 1): group-limited selection: groups ranked by the sum of their two best scores (+ bias),
        the K picks taken inside the best topk_group groups;
      routed_scaling_factor (1.0): multiplies the weights;
      e_score_correction_bias (False): True registers a float32 [E] buffer `router.e_score_correction_bias` (zeros,
        not a parameter, no gradient) added to the scores for the selection only (aux-loss-free balancing); the
        caller updates it. The aux loss is the switch loss over softmax(logits) whatever the router;
      capacity_factor (None): every expert takes at most C = min(T, ceil(T*K / E * capacity_factor)) pairs, the
        first C in pair order (token t's k-th pick is pair t*K + k: earlier tokens first); the others are dropped
        (no expert compute, nothing in the output, no gradient; the kept weights are the router's, unchanged; the
        aux loss counts the router's choices before the drop). After a forward (training or is_inference_mode)
        `num_dropped` holds the number of dropped pairs (an int32 [1] tensor on the device, no host sync); None
        without a capacity."""

    def __init__(self, num_experts: int, num_experts_per_tok: int, hidden_size: int, intermediate_size: int,
                 activation_function=ActivationType.SWIGLU, add_bias: bool = False, std: float = 0.02,
                 routing: str = "topk", tile: int = 128, accumulate_main_grad: bool = False,
                 scoring_func: str = "softmax", softmax_over_topk: bool = True, is_softmax_over_topk=None,
                 norm_topk_probs: bool = False, norm_topk_prob=None, n_group: Optional[int] = 1,
                 topk_group: Optional[int] = 1, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: bool = False, capacity_factor: Optional[float] = None,
                 precision: str = "bf16", fp8_weight_cache: bool = True, concat_layout: bool = False,
                 w1_layout: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        where = "sonicmoe_cpp.MoE"
        factory = _factory_args(device, dtype, where)
        add_bias = _bool_arg("add_bias", add_bias, where)
        concat_layout = _bool_arg("concat_layout", concat_layout, where)
        e_score_correction_bias = _bool_arg("e_score_correction_bias", e_score_correction_bias, where)
        std = _std_arg(std, where)
        self.fp8_weight_cache = fp8_weight_cache
        self.precision = precision
        layout = ("concat" if concat_layout else "interleaved") if w1_layout is None else \
            _w1_layout_arg(w1_layout, "sonicmoe_cpp.MoE: argument 'w1_layout'")
        if concat_layout and layout != "concat":
            raise ValueError(f"sonicmoe_cpp.MoE: concat_layout=True contradicts w1_layout={w1_layout!r}")
        self.w1_layout = layout
        self.concat_layout = layout == "concat"
        self.accumulate_main_grad = _bool_arg("accumulate_main_grad", accumulate_main_grad, where)
        self.num_experts, self.top_k, self.hidden_size, self.intermediate_size = _layer_sizes(
            "MoE", num_experts, num_experts_per_tok, hidden_size, intermediate_size)
        self.activation_function = ActivationType(_act_name(activation_function))
        self.add_bias = add_bias
        self.routing = normalize_routing(routing)
        if self.routing == "general":
            raise ValueError("sonicmoe_cpp.MoE: argument 'routing' cannot be 'general' (use moe_general_routing)")
        self.tile = _int_arg("tile", tile)
        z_width = 2 * intermediate_size if is_glu(self.activation_function) else intermediate_size
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        # Checked here (types, names, the router's rules: _check_router below).
        self.router_config = _router_config("sonicmoe_cpp.MoE", self.router, e_score_correction_bias, scoring_func,
                                            softmax_over_topk, is_softmax_over_topk, norm_topk_probs, norm_topk_prob,
                                            n_group, topk_group, routed_scaling_factor, capacity_factor)
        self.num_dropped = None
        if self.routing != "topk" and (self.router_config != _DEFAULT_ROUTER_CONFIG or e_score_correction_bias):
            raise ValueError(f"sonicmoe_cpp.MoE: the router keywords need routing='topk', got {self.routing!r}")
        # The library's router rules, here rather than on the first call: KernelBackendMoE.torch routes in PyTorch
        # and would otherwise run a router the kernels refuse (a negative scale, groups that do not divide E).
        from .ep import _check_router
        _check_router(self.router_config, e_score_correction_bias, self.num_experts, self.top_k, where)
        misfit = _fp8_misfit(hidden_size, intermediate_size)
        if self.precision in _ops.FP8_PRECISIONS and misfit:
            raise ValueError(f"sonicmoe_cpp.MoE: argument '{misfit[0]}' = {misfit[1]} cannot be quantised under "
                             "precision 'fp8': it must be a multiple of 128 (the FP8 block size)")
        if self.concat_layout and self.precision in _ops.FP8_PRECISIONS and is_glu(self.activation_function):
            raise ValueError("sonicmoe_cpp.MoE: concat_layout=True is not supported with precision 'fp8' (W1's "
                             "128x128 quantisation blocks depend on the row order)")
        self._separate = self.w1_layout == "separate" and is_glu(self.activation_function)
        if self._separate and (self.precision in _ops.FP8_PRECISIONS or self.accumulate_main_grad):
            raise ValueError("sonicmoe_cpp.MoE: w1_layout='separate' is not supported with precision 'fp8' (W1's "
                             "128x128 quantisation blocks depend on the row order) or accumulate_main_grad=True")
        if self._separate:
            self.c_fc = GateUpExperts(num_experts, hidden_size, intermediate_size, add_bias, std, **factory)
        else:
            self.c_fc = Experts(num_experts, hidden_size, z_width, add_bias, std, **factory)
        self.c_proj = Experts(num_experts, intermediate_size, hidden_size, add_bias, std, **factory)

    def reset_parameters(self):
        """The construction's initialisation again, in place: router and expert weights normal(0, std), biases and
        router.e_score_correction_bias zero (e.g. after a model built under torch.device("meta") is given memory
        by to_empty)."""
        _reset_moe_parameters(self)

    def forward(self, hidden_states: torch.Tensor, kernel_backend_moe=KernelBackendMoE.sonicmoe,
                is_inference_mode: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden_states [T, H] or [B, S, H] -> (output of the same shape, aux_loss scalar).

        The original module's keywords: `kernel_backend_moe` (KernelBackendMoE.sonicmoe, the one backend here;
        the original's others are reimplemented by this library's kernels too; KernelBackendMoE.sonicmoe_fp8 runs
        this call in FP8 blockwise) and `is_inference_mode` (no state kept for a backward, Z dropped after the
        up-projection, aux_loss None)."""
        backend = _check_backend(kernel_backend_moe)
        precision = "fp8" if backend == KernelBackendMoE.sonicmoe_fp8 else self.precision
        is_inference_mode = _bool_arg("is_inference_mode", is_inference_mode, "sonicmoe_cpp.MoE")
        x = hidden_states
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"sonicmoe_cpp.MoE: argument 'hidden_states' must be a torch.Tensor, got "
                            f"{type(x).__name__}")
        shape = x.shape
        if x.dim() not in (2, 3) or shape[-1] != self.hidden_size:
            raise ValueError(f"sonicmoe_cpp.MoE: argument 'hidden_states' ('x') has shape {tuple(shape)}, expected [T, "
                             f"{self.hidden_size}] or [B, S, {self.hidden_size}]")
        # (a [T, H] contiguous input as it is: a reshape to the same shape would add an autograd node)
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.hidden_size).contiguous()
        if backend == KernelBackendMoE.torch:
            return self._torch_forward(x2, is_inference_mode, shape)
        self._check_input(x2, "convert the input, or the module with .to(...)")  # the op would name a weight
        if self._separate:
            w1, b1 = self.c_fc.gate_weight, self.c_fc.gate_bias
            w1_up, b1_up = self.c_fc.up_weight, self.c_fc.up_bias
        else:
            w1, b1, w1_up, b1_up = self.c_fc.weight, self.c_fc.bias, None, None
        w2 = self.c_proj.weight
        fp8_weights = self._fp8_weights(x2, w1, w2, self.activation_function.value, _autocast_dtype(x2))
        dropped = []
        out, aux = _run(x2, self.router.weight, w1, b1, self.c_proj.weight,
                        self.c_proj.bias, self.activation_function, self.top_k, self.routing, self.tile,
                        None, None, None, inference=is_inference_mode,
                        accumulate_main_grad=self.accumulate_main_grad, router=self._router_args(),
                        precision=precision, dropped_out=dropped,
                        w1_layout=self.w1_layout if is_glu(self.activation_function) else "interleaved",
                        fp8_weights=fp8_weights, w1_up=w1_up, b1_up=b1_up)
        self.num_dropped = dropped[0] if dropped else None
        # (no reshape of a [T, H] output: a view is one more autograd node for every backward)
        return out if x.dim() == 2 else out.reshape(shape), (None if aux is None else aux.reshape(()))

    def _check_input(self, x2, note, refused=False):
        """x2 of the module's dtype (any floating dtype under torch.autocast, which casts it) and device (and not
        `refused`), else a ValueError naming both and `note`."""
        w = self.router.weight
        dtype_ok = x2.dtype == w.dtype or _autocast_dtype(x2) is not None
        if refused or not dtype_ok or x2.device != w.device:
            raise ValueError(f"sonicmoe_cpp.MoE: argument 'hidden_states' ('x') is {x2.dtype} on {x2.device}, "
                             f"expected the module's {w.dtype} on {w.device} ({note})")

    def _torch_forward(self, x2, inference, shape):
        """KernelBackendMoE.torch: the layer in plain PyTorch ops (sonicmoe_cpp.torch_backend)."""
        for what, value, supported in (("routing", self.routing, "topk"),
                                       ("capacity_factor", self.router_config["capacity_factor"], 0.0),
                                       ("accumulate_main_grad", self.accumulate_main_grad, False)):
            if value != supported:
                raise ValueError(f"sonicmoe_cpp.MoE: kernel_backend_moe=KernelBackendMoE.torch runs {what} = "
                                 f"{supported!r} only (the kernels alone take {what} = {value!r})")
        from .torch_backend import moe_torch
        self._check_input(x2, "bf16, fp16 or fp32; kernel_backend_moe=KernelBackendMoE.torch",
                          x2.dtype not in (torch.bfloat16, torch.float16, torch.float32))
        bias = getattr(self.router, "e_score_correction_bias", None)
        self._check_shapes(bias)
        ac = _autocast_dtype(x2)  # torch.autocast: as the kernels, the layer in its dtype (casts, autocast off inside)
        cast = (lambda t: t) if ac is None else (lambda t: t if t is None or t.dtype == ac else t.to(ac))
        with torch.set_grad_enabled(torch.is_grad_enabled() and not inference), \
                (contextlib.nullcontext() if ac is None else torch.autocast(x2.device.type, enabled=False)):
            if self._separate:  # differentiable: the gradients reach gate and up
                c = self.c_fc
                w1 = w1_from_gate_up(c.gate_weight, c.up_weight)
                b1 = None if c.gate_bias is None else w1_from_gate_up(c.gate_bias, c.up_bias)
            else:
                w1, b1 = self.c_fc.weight, self.c_fc.bias
            if self.concat_layout and is_glu(self.activation_function):  # differentiable: gradients come back concat
                w1, b1 = w1_to_interleaved(w1), (None if b1 is None else w1_to_interleaved(b1))
            out, aux = moe_torch(cast(x2), cast(self.router.weight), cast(w1), cast(b1), cast(self.c_proj.weight),
                                 cast(self.c_proj.bias), self.activation_function.value, self.top_k,
                                 self.router_config, bias)
        return out.reshape(shape), (None if inference else aux)

    def _check_shapes(self, bias):
        """The parameters' shapes, as the op checks them (for KernelBackendMoE.torch, which would otherwise index out
        of range or silently leave experts out when a parameter was replaced by one of another shape)."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        glu = is_glu(self.activation_function)
        if self._separate:
            c = self.c_fc
            w1s = [("c_fc.gate_weight", c.gate_weight, (E, I, H)), ("c_fc.up_weight", c.up_weight, (E, I, H)),
                   ("c_fc.gate_bias", c.gate_bias, (E, I)), ("c_fc.up_bias", c.up_bias, (E, I))]
        else:
            zw = 2 * I if glu else I
            w1s = [("c_fc.weight", self.c_fc.weight, (E, zw, H)), ("c_fc.bias", self.c_fc.bias, (E, zw))]
        for name, t, shape in [("router.weight", self.router.weight, (E, H))] + w1s + [
                ("c_proj.weight", self.c_proj.weight, (E, H, I)), ("c_proj.bias", self.c_proj.bias, (E, H)),
                ("router.e_score_correction_bias", bias, (E,))]:
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"sonicmoe_cpp.MoE: parameter '{name}' has shape {tuple(t.shape)}, expected "
                                 f"{list(shape)}")
            if t is not None and name != "router.e_score_correction_bias" and t.dtype != self.router.weight.dtype:
                raise ValueError(f"sonicmoe_cpp.MoE: parameter '{name}' has dtype {t.dtype}, expected "
                                 f"{self.router.weight.dtype} (router.weight's)")

    def _router_args(self):
        """The ops' router arguments, or None for the default router (the op's defaults)."""
        bias = getattr(self.router, "e_score_correction_bias", None)
        if self.router_config == _DEFAULT_ROUTER_CONFIG and bias is None:
            return None
        return router_args(**self.router_config, e_score_correction_bias=bias)

    def extra_repr(self):
        extra = _router_extra_repr(self.router_config)
        if self.precision != "bf16":
            extra += f", precision={self.precision}"
        if self.concat_layout:
            extra += ", concat_layout=True"
        elif self.w1_layout == "separate":
            extra += ", w1_layout=separate"
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, activation={self.activation_function.value}, "
                f"routing={self.routing}{extra}")


_DEFAULT_ROUTER_CONFIG = dict(scoring_func="softmax", softmax_over_topk=True, norm_topk_probs=False, n_group=1,
                              topk_group=1, routed_scaling_factor=1.0, capacity_factor=0.0)


def _factory_args(device, dtype, where):
    """nn.Module factory keywords (device, dtype) as nn.Linear takes them; dtype bf16, f16 or f32 (the library's)."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{where}: argument 'dtype' = {dtype!r}, expected torch.bfloat16, torch.float16 or "
                         "torch.float32 (or None: the default dtype)")
    return dict(device=device, dtype=dtype)


def _reset_moe_parameters(m):
    """MoE.reset_parameters / ExpertParallelMoE.reset_parameters: the constructors' initialisation, in place."""
    with torch.no_grad():  # (the experts keep the constructor's std)
        nn.init.normal_(m.router.weight, mean=0.0, std=m.c_proj.std if m.c_proj.std is not None else 0.02)
        bias = getattr(m.router, "e_score_correction_bias", None)
        if bias is not None:
            bias.zero_()
    m.c_fc.reset_parameters()
    m.c_proj.reset_parameters()
    m.invalidate_fp8_weight_cache()


def _router_config(where, router, e_score_correction_bias, scoring_func, softmax_over_topk, is_softmax_over_topk,
                   norm_topk_probs, norm_topk_prob, n_group, topk_group, routed_scaling_factor, capacity_factor):
    """MoE.router_config (ExpertParallelMoE's too) from the router keywords (the original's aliases
    is_softmax_over_topk / norm_topk_prob win when given); e_score_correction_bias=True registers the float32 [E]
    buffer `e_score_correction_bias` (zeros) on `router` (an nn.Linear)."""
    if is_softmax_over_topk is not None:
        softmax_over_topk = _bool_arg("is_softmax_over_topk", is_softmax_over_topk, where)
    if norm_topk_prob is not None:
        norm_topk_probs = _bool_arg("norm_topk_prob", norm_topk_prob, where)
    args = router_args(scoring_func, softmax_over_topk, norm_topk_probs, n_group, topk_group, routed_scaling_factor,
                       capacity_factor=capacity_factor, where=where)
    if _bool_arg("e_score_correction_bias", e_score_correction_bias, where):
        router.register_buffer("e_score_correction_bias", torch.zeros(router.out_features, dtype=torch.float32,
                                                                      device=router.weight.device))
    return dict(zip(("scoring_func", "softmax_over_topk", "norm_topk_probs", "n_group", "topk_group",
                     "routed_scaling_factor"), args[:6]), capacity_factor=args[7])


def _router_extra_repr(router_config) -> str:
    """The non-default router keywords, for extra_repr."""
    return "".join(f", {k}={v}" for k, v in router_config.items() if _DEFAULT_ROUTER_CONFIG[k] != v)


# Expert parallelism and entries for already-dispatched tokens (ep.py reads this module's names lazily).
from .ep import ExpertParallelMoE, moe_deepep, moe_permuted, shard_moe_state_dict, unshard_moe_state_dicts  # noqa: E402

__all__ += ["ExpertParallelMoE", "moe_permuted", "moe_deepep", "shard_moe_state_dict", "unshard_moe_state_dicts"]

# The original's functional API (sonicmoe.functional) by name.
from .functional import (count_cumsum, enable_quack_gemm, is_using_quack_gemm,  # noqa: E402
                         moe_general_routing_inputs, moe_TC_softmax_topk_layer)

__all__ += ["moe_TC_softmax_topk_layer", "moe_general_routing_inputs", "count_cumsum", "enable_quack_gemm",
            "is_using_quack_gemm"]

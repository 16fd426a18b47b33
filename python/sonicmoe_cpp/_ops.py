"""torch.library glue for the C++ ops: fake (meta) implementations and autograd.

torch.ops.sonicmoe.forward returns output, aux_loss and the saved state; torch.ops.sonicmoe.backward takes the saved
state back. The state is listed once, in python/csrc/sonicmoe_ops.cpp (SONICMOE_PY_STATE): its names are read here
from the registered schema, its dtypes and shapes (for the fake kernels) from _C.state_fields(). State that a routing
mode or precision does not have is an empty 1-D tensor (under precision "fp8" the saved Z is z_fp8 + z_scale, and z is
empty; without pre-quantised weights the state also holds the forward's quantised W1^T, w1_t_fp8 and w1_t_scale, which
the backward reads instead of quantising W1 again; w2_t_fp8 / w2_t_scale stay empty: the binding's dgated GEMM runs on
bf16 operands and reads no W2^T).

torch.ops.sonicmoe.fp8_quantize_weights(w1, w2, activation, transposed) returns the weights quantised as the FP8 layer
quantises them (8 tensors: FP8_WEIGHT_NAMES; with `transposed`, W1^T and its scales are made, and w2_t / w2_scale_t
are empty, as nothing of the binding's backward reads them); the ops' last argument `fp8_weights` takes them (then
nothing is quantised in the call). The MoE module keeps them across calls (Fp8WeightCache).
"""
import torch

from . import _C  # noqa: F401  (loads the library: registers torch.ops.sonicmoe.*)

ROUTING_MODES = ("topk", "general", "round_down", "round_up", "round_nearest")
PRECISIONS = ("bf16", "fp8", "fp8_wgrad")
# The FP8 blockwise layer: "fp8" (bf16 weight gradients) and "fp8_wgrad" (weight gradients on FP8 operands too).
FP8_PRECISIONS = ("fp8", "fp8_wgrad")
_FWD = torch.ops.sonicmoe.forward.default
_BWD = torch.ops.sonicmoe.backward.default
# The forward's returns after (output, aux_loss).
_STATE_NAMES = tuple(r.name for r in _FWD._schema.returns[2:])
# (name, dtype, shape, present) per state tensor, in the same order.
_STATE_FIELDS = tuple(_C.state_fields())
assert tuple(f[0] for f in _STATE_FIELDS) == _STATE_NAMES, "sonicmoe_cpp: _C.state_fields() differs from the schema"


# fp8_quantize_weights' results, in order (sonicmoe::Fp8ExpertWeights).
FP8_WEIGHT_NAMES = ("w1", "w1_t", "w1_scale", "w1_scale_t", "w2", "w2_t", "w2_scale", "w2_scale_t")


@torch.library.register_fake("sonicmoe::fp8_quantize_weights")
def _fp8_quantize_weights_fake(w1, w2, activation, transposed=True):
    _check_one_device("fp8_quantize_weights", w1, w2=w2)
    E, ZW, H = w1.shape
    I = w2.shape[2]
    f8, f32 = torch.float8_e4m3fn, torch.float32
    b = lambda n: (n + 127) // 128  # noqa: E731

    def t(shape, dtype, made=True):
        return w1.new_empty(shape if made else (0,), dtype=dtype)

    # W2^T is never made: the binding's config runs the dgated GEMM on bf16 operands (sonicmoe::fp8_backward_reads_w2_t)
    return [t((E, ZW, H), f8), t((E, H, ZW), f8, transposed), t((E, b(ZW), b(H)), f32),
            t((E, b(H), b(ZW)), f32, transposed), t((E, H, I), f8), t((E, I, H), f8, False),
            t((E, b(H), b(I)), f32), t((E, b(I), b(H)), f32, False)]


@torch.library.register_fake("sonicmoe::fp8_dequantize_rows")
def _fp8_dequantize_rows_fake(q, scale, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.register_fake("sonicmoe::topk")
def _topk_fake(logits, k):
    if logits.dim() != 2 or logits.dtype != torch.float32 or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"sonicmoe_cpp.topk: expected fp32 logits [T, E] and 1 <= k <= E, got {logits.dtype} "
                         f"{tuple(logits.shape)} and k = {k}")
    T, E = logits.shape
    return (logits.new_empty((T, k), dtype=torch.int32), logits.new_empty((T, k)),
            logits.new_empty((E,), dtype=torch.int32))


@torch.library.register_fake("sonicmoe::gather_sum")
def _gather_sum_fake(rows, rev, token_offsets, scores=None):
    _check_one_device("gather_sum", rows, rev=rev, token_offsets=token_offsets, scores=scores)
    if scores is not None and (scores.dtype != torch.float32 or tuple(scores.shape) != (rev.shape[0],)):
        raise ValueError(f"sonicmoe_cpp.gather_sum: argument 'scores' is {scores.dtype} {tuple(scores.shape)}, "
                         f"expected torch.float32 [{rev.shape[0]}] (one per entry of 'rev')")
    if rows.dim() != 2 or rev.dim() != 1 or token_offsets.dim() != 1 or token_offsets.shape[0] < 1 \
            or rev.shape[0] != rows.shape[0] or rev.dtype != torch.int32 or token_offsets.dtype != torch.int32 \
            or rows.dtype not in _FLOATS:
        raise ValueError(f"sonicmoe_cpp.gather_sum: expected rows [N, H] (bf16, fp16 or fp32), rev int32 [N] and "
                         f"token_offsets int32 [T+1], got {rows.dtype} {tuple(rows.shape)}, {rev.dtype} "
                         f"{tuple(rev.shape)} and {token_offsets.dtype} {tuple(token_offsets.shape)}")
    return rows.new_empty((token_offsets.shape[0] - 1, rows.shape[1]))


def _state_shape(shape, sizes):
    """'E+1' -> sizes['E'] + 1; 'N,ZW' -> (sizes['N'], sizes['ZW'])."""
    dims = []
    for d in shape.split(","):
        name, _, plus = d.partition("+")
        dims.append(sizes[name] + int(plus) if plus else sizes[name])
    return dims


def normalize_precision(precision, where="sonicmoe_cpp: argument 'precision'") -> str:
    """'bf16', 'fp8' (also 'fp8_blockwise') or 'fp8_wgrad', any case; ValueError starting with `where` otherwise."""
    p = str(precision).lower()
    if p == "fp8_blockwise":
        p = "fp8"
    if p not in PRECISIONS:
        raise ValueError(f"{where} is {precision!r}, expected one of {PRECISIONS}")
    return p


def normalize_routing(routing: str) -> str:
    r = str(routing).replace("-", "_").lower()
    if r in ("down", "up", "nearest"):
        r = "round_" + r
    if r not in ROUTING_MODES:
        raise ValueError(f"sonicmoe_cpp: argument 'routing' is {routing!r}, expected one of {ROUTING_MODES}")
    return r


def _check_one_device(fn, x, **tensors):
    """The fake (meta) kernels see the devices too: a tensor on another device than x is an error, never an output
    on x's device made of uninitialised memory."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise RuntimeError(f"sonicmoe_cpp.{fn}: argument '{name}' is on {t.device} but 'x' is on {x.device}; "
                               "all tensors must be on one device")


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _fake_activation(fn, activation):
    """The activation's name as the library parses it (its aliases included), or the op's ValueError."""
    from . import _act_name
    n = str(activation).lower().replace("-", "_")
    if n in ("relu2", "squared_relu"):
        return "relu_sq"
    return _act_name(n, f"sonicmoe_cpp.{fn}: argument 'activation'")


def _check_fake_forward(fn, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, token_idx, expert_idx,
                        scores, separate):
    """The fake (meta) kernels check what the C++ op checks before it allocates (dtypes, ranks, the experts' shapes,
    the routing inputs), so that a meta / fake call with bad arguments raises as the real one does instead of
    returning outputs shaped from them."""
    def bad(msg):
        raise ValueError(f"sonicmoe_cpp.{fn}: {msg}")

    if x.dtype not in _FLOATS:
        bad(f"argument 'x' has dtype {x.dtype}, expected bfloat16, float16 or float32")
    for name, t, dims in (("x", x, 2), ("w1", w1, 3), ("w2", w2, 3), ("b1", b1, 2), ("b2", b2, 2)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            bad(f"argument '{name}' has dtype {t.dtype}, expected {x.dtype} (x's)")
        if t.dim() != dims:
            bad(f"argument '{name}' has shape {tuple(t.shape)}, expected {dims} dimensions")
    if (b1 is None) != (b2 is None):
        bad("arguments 'b1' and 'b2' must be given together (add_bias)")
    act = _fake_activation(fn, activation)
    from . import is_glu
    glu = is_glu(act)
    T, H = x.shape
    E, I = w2.shape[0], w2.shape[2]
    zw = 2 * w1.shape[1] if separate and glu else w1.shape[1]
    if zw != (2 * I if glu else I) or w1.shape[0] != E or w1.shape[2] != H or w2.shape[1] != H:
        bad(f"arguments 'w1' {tuple(w1.shape)} and 'w2' {tuple(w2.shape)} disagree with x {tuple(x.shape)}: "
            f"expected w1 [E, {'2*I' if glu else 'I'}, H] and w2 [E, H, I] for activation '{act}'")
    for name, t, shape in (("b1", b1, (E, w1.shape[1])), ("b2", b2, (E, H))):
        if t is not None and tuple(t.shape) != shape:
            bad(f"argument '{name}' has shape {tuple(t.shape)}, expected {list(shape)}")
    if routing == "general":
        for name, t, dt in (("token_idx", token_idx, torch.int32), ("expert_idx", expert_idx, torch.int32),
                            ("scores", scores, torch.float32)):
            if t is None:
                bad("general routing needs 'token_idx', 'expert_idx' and 'scores'")
            if t.dtype != dt or t.dim() != 1 or t.shape[0] != token_idx.shape[0]:
                bad(f"argument '{name}' is {t.dtype} {tuple(t.shape)}, expected {dt} [N] (N = token_idx's length)")
    else:
        normalize_routing(routing)
        if router_weight is None:
            bad(f"argument 'router_weight' is required for routing '{routing}'")
        if router_weight.dtype != x.dtype or tuple(router_weight.shape) != (E, H):
            bad(f"argument 'router_weight' is {router_weight.dtype} {tuple(router_weight.shape)}, expected {x.dtype} "
                f"[{E}, {H}]")
        if not 1 <= top_k <= E:
            bad(f"argument 'top_k' = {top_k}, expected 1 <= top_k <= E = {E}")


# The ops' arguments after `scores` (forward, inference) and their defaults: the router's (the default router is the
# original's top-K, softmax over the K selected logits; its capacity factor last), then the layer's precision, its W1
# layout ("interleaved", "concat" or "separate": MoEConfig::w1_layout), the pre-quantised FP8 weights
# (fp8_quantize_weights' list, or None) and, under "separate", the up tensors w1_up / b1_up (w1 / b1 are then the
# gate's), and expert_rows (general routing, bf16: the forward returns the experts' rows Y [N, H] before the per-token
# sum; its state's backward is backward_act(..., dw2_in_part1=True, expert_rows=True), whose dx is dXe [N, H], then
# backward_weights; sonicmoe/expert_rows.h). The backward takes ROUTER_BWD of them after validate_state.
ROUTER_ARGS = (("scoring_func", "softmax"), ("softmax_over_topk", True), ("norm_topk_probs", False), ("n_group", 1),
               ("topk_group", 1), ("routed_scaling_factor", 1.0), ("e_score_correction_bias", None),
               ("capacity_factor", 0.0), ("precision", "bf16"), ("w1_layout", "interleaved"), ("fp8_weights", None),
               ("w1_up", None), ("b1_up", None), ("expert_rows", False))
ROUTER_BWD = ("scoring_func", "softmax_over_topk", "norm_topk_probs", "routed_scaling_factor", "precision",
              "w1_layout", "fp8_weights", "w1_up", "b1_up")
_ROUTER_ARG_NAMES = tuple(n for n, _ in ROUTER_ARGS)
_CAPACITY_ARG = _ROUTER_ARG_NAMES.index("capacity_factor")
_PRECISION_ARG = _ROUTER_ARG_NAMES.index("precision")
_FP8_WEIGHTS_ARG = _ROUTER_ARG_NAMES.index("fp8_weights")
_W1_LAYOUT_ARG = _ROUTER_ARG_NAMES.index("w1_layout")
_W1_UP_ARG = _ROUTER_ARG_NAMES.index("w1_up")
_B1_UP_ARG = _ROUTER_ARG_NAMES.index("b1_up")
_EXPERT_ROWS_ARG = _ROUTER_ARG_NAMES.index("expert_rows")
_ROUTER_BWD_ARGS = tuple(_ROUTER_ARG_NAMES.index(n) for n in ROUTER_BWD)  # their indices in ROUTER_ARGS
DEFAULT_ROUTER = tuple(v for _, v in ROUTER_ARGS)
_N_PLAIN = 13  # the forward's arguments before the router's


@torch.library.register_fake("sonicmoe::forward")
def _forward_fake(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx,
                  scores, *router):
    _check_one_device("forward", x, router_weight=router_weight, w1=w1, b1=b1, w2=w2, b2=b2, token_idx=token_idx,
                      expert_idx=expert_idx, scores=scores,
                      e_score_correction_bias=router[6] if len(router) > 6 else None,
                      w1_up=router[_W1_UP_ARG] if len(router) > _W1_UP_ARG else None,
                      b1_up=router[_B1_UP_ARG] if len(router) > _B1_UP_ARG else None)
    _check_fake_forward("forward", x, router_weight, w1, b1, w2, b2, activation, top_k, routing, token_idx,
                        expert_idx, scores, len(router) > _W1_UP_ARG and router[_W1_UP_ARG] is not None)
    T, H = x.shape
    E, ZW = w1.shape[0], w1.shape[1]
    if len(router) > _W1_UP_ARG and router[_W1_UP_ARG] is not None:  # w1_layout "separate": w1 is the gate
        ZW = 2 * ZW
    if routing == "topk":
        N = T * top_k
    elif routing == "general":
        N = token_idx.shape[0]
    else:  # token rounding: the number of kept pairs depends on the data
        N = torch.library.get_ctx().new_dynamic_size()
    f32, i32 = torch.float32, torch.int32

    def e(*shape, dtype):
        return x.new_empty(shape, dtype=dtype)

    fp8 = len(router) > _PRECISION_ARG and normalize_precision(router[_PRECISION_ARG]) in FP8_PRECISIONS
    capacity = routing == "topk" and len(router) > _CAPACITY_ARG and router[_CAPACITY_ARG] > 0
    pre_quantised = len(router) > _FP8_WEIGHTS_ARG and bool(router[_FP8_WEIGHTS_ARG])
    present = {"always": True, "routed": routing != "general", "paired": routing != "topk",
               "rounding": routing.startswith("round"), "bf16": not fp8, "fp8": fp8, "capacity": capacity,
               "fp8_own": fp8 and not pre_quantised,
               # W2^T: only for a dgated GEMM on FP8 operands, which the binding's FP8 layer does not run
               "fp8_own_w2": False}
    dtypes = {"input": x.dtype, "f32": f32, "i32": i32, "f8": torch.float8_e4m3fn}
    I = w2.shape[2]
    sizes = {"T": T, "E": E, "K": top_k, "N": N, "H": H, "I": I, "ZW": ZW, "HB": H // 128, "IB": I // 128,
             "ZB": ZW // 128, "1": 1}
    state = tuple(e(*_state_shape(shape, sizes), dtype=dtypes[dt]) if present[when] else e(0, dtype=dtypes[dt])
                  for _, dt, shape, when in _STATE_FIELDS)
    rows = N if len(router) > _EXPERT_ROWS_ARG and router[_EXPERT_ROWS_ARG] else T
    return (e(rows, H, dtype=x.dtype), e(1, dtype=f32), *state)


@torch.library.register_fake("sonicmoe::forward_fp8_rows")
def _forward_fp8_rows_fake(x_q, x_scale, w1, b1, w2, b2, activation, token_idx, expert_idx, scores, fp8_weights=None):
    """forward's outputs under routing "general" and precision "fp8", the input's dtype being the weights'."""
    _check_one_device("forward_fp8_rows", x_q, x_scale=x_scale, w1=w1, b1=b1, w2=w2, b2=b2, token_idx=token_idx,
                      expert_idx=expert_idx, scores=scores)
    router = list(DEFAULT_ROUTER)
    router[_PRECISION_ARG] = "fp8"
    router[_FP8_WEIGHTS_ARG] = fp8_weights
    x = x_q.new_empty(x_q.shape, dtype=w1.dtype)
    return _forward_fake(x, None, w1, b1, w2, b2, activation, 1, "general", 128, token_idx, expert_idx, scores,
                         *router)


@torch.library.register_fake("sonicmoe::inference")
def _inference_fake(x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx,
                    scores, *router, dropped_out=None):
    _check_one_device("inference", x, router_weight=router_weight, w1=w1, b1=b1, w2=w2, b2=b2, token_idx=token_idx,
                      expert_idx=expert_idx, scores=scores)
    _check_fake_forward("inference", x, router_weight, w1, b1, w2, b2, activation, top_k, routing, token_idx,
                        expert_idx, scores, len(router) > _W1_UP_ARG and router[_W1_UP_ARG] is not None)
    return x.new_empty(x.shape)


def _op_arg(rest, i, kwargs, name, default=None):
    """An op argument that came positionally (rest[i]) or by keyword."""
    return rest[i] if len(rest) > i else kwargs.get(name, default)


@torch.library.register_fake("sonicmoe::backward")
def _backward_fake(d_out, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, *state_and_rest, **kwargs):
    # state_and_rest: the saved state (z first), then d_aux_loss, consume_z, validate_state, the router's and the
    # precision, then w1_main_grad, w2_main_grad, router_main_grad. dscore has one entry per pair (the metadata's
    # `pair`; z is empty under fp8). Under w1_layout "separate" (w1_up given) dw1 / db1 are [2, *w1.shape] /
    # [2, *b1.shape]. dw1 / dw2 / drouter are empty where a main_grad received them.
    z = state_and_rest[0]
    pair = state_and_rest[_STATE_NAMES.index("pair")]
    rest = state_and_rest[len(_STATE_NAMES):]
    # after d_aux_loss, consume_z, validate_state
    w1_up = _op_arg(rest, 3 + ROUTER_BWD.index("w1_up"), kwargs, "w1_up")
    mg1 = _op_arg(rest, 3 + len(ROUTER_BWD), kwargs, "w1_main_grad")
    mg2 = _op_arg(rest, 4 + len(ROUTER_BWD), kwargs, "w2_main_grad")
    mgr = _op_arg(rest, 5 + len(ROUTER_BWD), kwargs, "router_main_grad")
    _check_one_device("backward", x, d_out=d_out, router_weight=router_weight, w1=w1, b1=b1, w2=w2, b2=b2, z=z,
                      w1_up=w1_up)
    def empty():
        return x.new_empty((0,))

    def like_w1(t):
        return t.new_empty((2, *t.shape)) if w1_up is not None else torch.empty_like(t)

    return (
        torch.empty_like(x),
        like_w1(w1) if mg1 is None else empty(),
        like_w1(b1) if b1 is not None else empty(),
        torch.empty_like(w2) if mg2 is None else empty(),
        torch.empty_like(b2) if b2 is not None else empty(),
        torch.empty_like(router_weight) if (routing != "general" and router_weight is not None and mgr is None)
        else empty(),
        x.new_empty((pair.shape[0],), dtype=torch.float32),
    )


@torch.library.register_fake("sonicmoe::backward_act")
def _backward_act_fake(d_out, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, *state_and_rest, **kw):
    # (dx, drouter, dscore, dz, a_s, dw2, db2): dz empty when consume_z (dZ written over z); a_s empty and dw2 / db2
    # given with dw2_in_part1 (else the reverse); the state as for backward.
    dx, _, _, _, _, drouter, dscore = _backward_fake(d_out, x, router_weight, w1, b1, w2, b2, activation, top_k,
                                                     routing, *state_and_rest, **kw)
    n = dscore.shape[0]
    rest = state_and_rest[len(_STATE_NAMES):]
    if _op_arg(rest, 10, kw, "expert_rows", False):  # dXe [N, H]
        dx = x.new_empty((n, x.shape[1]))
    consume = (rest[1] if len(rest) > 1 else kw.get("consume_z", False))
    dz = x.new_empty((0,)) if consume else x.new_empty((n, w1.shape[1]))
    dw2_first = _op_arg(rest, 8, kw, "dw2_in_part1", False)
    empty = x.new_empty((0,))
    if dw2_first:
        return (dx, drouter, dscore, dz, empty, torch.empty_like(w2) if _op_arg(rest, 9, kw, "w2_main_grad") is None
                else empty,
                torch.empty_like(b2) if b2 is not None else empty)
    return dx, drouter, dscore, dz, x.new_empty((n, w2.shape[2])), empty, empty


@torch.library.register_fake("sonicmoe::backward_weights")
def _backward_weights_fake(d_out, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, *state_and_rest,
                           **kw):
    _check_one_device("backward_weights", x, d_out=d_out, w1=w1, b1=b1, w2=w2, b2=b2)
    empty = x.new_empty((0,))
    rest = state_and_rest[len(_STATE_NAMES):]  # dz, a_s, then the tail (d_aux_loss ... precision, the main_grads)
    a_s = rest[1]
    with_dw2 = a_s.numel() > 0
    mg1, mg2 = _op_arg(rest, 10, kw, "w1_main_grad"), _op_arg(rest, 11, kw, "w2_main_grad")
    return (torch.empty_like(w1) if mg1 is None else empty, torch.empty_like(b1) if b1 is not None else empty,
            torch.empty_like(w2) if (with_dw2 and mg2 is None) else empty,
            torch.empty_like(b2) if (b2 is not None and with_dw2) else empty)


def _save(ctx, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, state, router=DEFAULT_ROUTER):
    ctx.activation, ctx.top_k, ctx.routing = activation, top_k, routing
    ctx.router_bwd = tuple(router[i] for i in _ROUTER_BWD_ARGS)
    ctx.fp8 = normalize_precision(router[_PRECISION_ARG]) in FP8_PRECISIONS
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    ctx.has_router = router_weight is not None
    # The state (z, logits, routing metadata: 22 tensors) is kept as a plain attribute, not as saved tensors: each
    # saved tensor costs host time on every backward (the step of a small layer waits for it). Z alone is also
    # saved, so that autograd's version check refuses a second backward after this one wrote dZ over it.
    ctx.state = state
    ctx.save_for_backward(x, router_weight, w1, b1, w2, b2, state[_STATE_NAMES.index("z_fp8" if ctx.fp8 else "z")])
    # The backward reads only the gradient of the output (and of aux_loss): without this, autograd would
    # zero-fill a missing one.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_aux, w1_main_grad=None, w2_main_grad=None, router_main_grad=None):
    if torch.is_grad_enabled():
        raise RuntimeError("sonicmoe_cpp: double backward (create_graph=True, or torch.autograd.grad of a gradient) "
                           "through the MoE layer is not supported: its backward is not differentiable")
    x, router_weight, w1, b1, w2, b2, z = ctx.saved_tensors
    state = ctx.state
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    general = ctx.routing == "general"
    # dL/d(aux_loss) goes to the library as a device tensor: its router backward adds the aux term inside the
    # router gradient kernels (no host read: CUDA-graph capturable; no [T, H] float32 torch matmuls).
    d_aux = None
    if not general and grad_aux is not None:
        d_aux = grad_aux.reshape(1).to(torch.float32)
    # dZ is written over the saved Z (one [N, z_width] buffer fewer at the peak; under fp8 dZ's codes over the saved
    # FP8 Z, on the GPU). Z's version is bumped after, so a second backward through this graph (retain_graph=True)
    # raises autograd's in-place error instead of reading dZ as Z. Not under torch.compile, whose graphs assume the op
    # leaves its inputs alone. The state came from this forward: no validation pass.
    consume = not torch.compiler.is_compiling()
    # w1_main_grad / w2_main_grad / router_main_grad (fusable_main_grad): the weight-gradient GEMMs add dW1 / dW2 /
    # dWr into them in fp32 (dw1 / dw2 / drouter come back empty).
    mg = {k: v for k, v in (("w1_main_grad", w1_main_grad), ("w2_main_grad", w2_main_grad),
                            ("router_main_grad", router_main_grad)) if v is not None}
    dx, dw1, db1, dw2, db2, drouter, dscore = _BWD(
        grad_out.contiguous(), x, None if general else router_weight, w1, b1, w2, b2, ctx.activation, ctx.top_k,
        ctx.routing, *state, d_aux, consume, False, *ctx.router_bwd, **mg)
    if consume:
        torch.autograd.graph.increment_version(z)
        ctx.state = None  # a second backward raises at saved_tensors: nothing reads the state again (Z is freed)
    # The router's arguments: no gradient (the bias steers the choice only), but for w1_up / b1_up under w1_layout
    # "separate", whose gradients are the up halves of dw1 / db1 ([2, E, I, H] / [2, E, I]).
    router_grads = [None] * ctx.n_router_args
    if ctx.n_router_args > _W1_UP_ARG and ctx.router_bwd[ROUTER_BWD.index("w1_up")] is not None:
        dw1, router_grads[_W1_UP_ARG] = dw1[0], dw1[1]
        if ctx.has_b1:
            db1, router_grads[_B1_UP_ARG] = db1[0], db1[1]
    return (
        dx,
        drouter if (not general and ctx.has_router) else None,
        dw1,
        db1 if ctx.has_b1 else None,
        dw2,
        db2 if ctx.has_b2 else None,
        None, None, None, None, None, None,
        dscore if general else None,
        *router_grads,
    )


# The Autograd kernel of sonicmoe::forward. It does what torch.library.register_autograd generates, with less
# Python on every call (no schema walk to fill defaults: the op has none; no per-call metadata object), and
# autograd tracks only (output, aux_loss): the state outputs are returned beside the autograd Function's.
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _below_autograd(keyset, args):
    """The op's kernels under the Autograd key (CPU / CUDA / Meta), as the dispatcher would reach them."""
    with torch._C._AutoDispatchBelowAutograd():
        return _FWD.redispatch(keyset & _AFTER_AUTOGRAD, *args)


# ------------------------------------------------------------------------------------------------------------------
# fp32 main_grad accumulation (Megatron's gradient-accumulation fusion): the backward adds a weight's gradient into
# the weight's `main_grad` (the framework's fp32 buffer) and hands autograd no gradient for it.

_WEIGHT_NAMES = ("router_weight", "w1", "b1", "w2", "b2")


def main_grad_params(router_weight, w1, b1, w2, b2):
    """(router_weight, w1, b1, w2, b2) with None for each tensor that has no `main_grad` attribute, or None when none
    has one. A `main_grad` must be an fp32 tensor of its parameter's shape on its device."""
    params = []
    for name, t in zip(_WEIGHT_NAMES, (router_weight, w1, b1, w2, b2)):
        mg = getattr(t, "main_grad", None) if t is not None else None
        if mg is not None:
            if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32 or mg.shape != t.shape \
                    or mg.device != t.device:
                desc = (f"{mg.dtype} {tuple(mg.shape)} on {mg.device}" if isinstance(mg, torch.Tensor)
                        else type(mg).__name__)
                raise ValueError(f"sonicmoe_cpp: the main_grad of argument '{name}' is {desc}, expected torch.float32 "
                                 f"{tuple(t.shape)} on {t.device} (accumulate_main_grad=True)")
        params.append(t if mg is not None else None)
    if not any(p is not None for p in params):
        return None
    _check_main_grads_disjoint(dict(zip(_WEIGHT_NAMES, (router_weight, w1, b1, w2, b2))))
    return tuple(params)


def _byte_span(t):
    """The bytes [lo, hi) tensor t can touch (its strides' extent); None when empty."""
    if t.numel() == 0:
        return None
    lo = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if st > 0)
    es = t.element_size()
    return t.data_ptr() + lo * es, t.data_ptr() + (hi + 1) * es


def _check_main_grads_disjoint(weights):
    """A main_grad that shares memory with a weight or another main_grad would change what the backward reads, or
    take two gradients (the C++ entries refuse the same for the main_grads they are handed)."""
    named = [(f"the main_grad of argument '{n}'", t.main_grad) for n, t in weights.items()
             if t is not None and getattr(t, "main_grad", None) is not None]
    others = [(f"argument '{n}'", t) for n, t in weights.items() if t is not None]
    for i, (a_name, a) in enumerate(named):
        sa = _byte_span(a)
        if sa is None:
            continue
        for b_name, b in named[i + 1:] + others:
            sb = _byte_span(b) if b.device == a.device else None
            if sb is not None and sb[0] < sa[1] and sa[0] < sb[1]:
                raise ValueError(f"sonicmoe_cpp: {a_name} overlaps {b_name} in memory: a main_grad must be a buffer "
                                 "of its own (accumulate_main_grad=True)")


def add_to_main_grad(param, grad):
    """param.main_grad += grad in fp32 (on the current stream: the one autograd runs this gradient's backward on);
    returns main_grad_added(param)."""
    param.main_grad.add_(grad.float())
    return main_grad_added(param)


def main_grad_added(param):
    """What autograd gets for `param` once its gradient is in `param.main_grad`: None, or, for a parameter with
    Megatron's `grad_added_to_main_grad` attribute (its DDP with overlapped gradient reduction hooks the parameter's
    AccumulateGrad), a dummy gradient (zeros when `param.zero_out_wgrad` is set, else uninitialised), with
    `grad_added_to_main_grad` set to True."""
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        return torch.zeros_like(param) if getattr(param, "zero_out_wgrad", False) else torch.empty_like(param)
    return None


# False: W1's and W2's main_grads too get the 16-bit gradient added by add_to_main_grad (python/bench/main_grad_bench.py
# measures both ways); True (the default): the library's GEMMs add into them.
FUSE_MAIN_GRAD = True


def fusable_main_grad(param):
    """param.main_grad when the library's GEMMs can add into it in place (contiguous, 16-byte aligned; its dtype,
    shape and device were checked by main_grad_params), else None (autograd's add_to_main_grad then does it)."""
    mg = getattr(param, "main_grad", None) if param is not None else None
    if not FUSE_MAIN_GRAD or mg is None or not mg.is_contiguous() or mg.data_ptr() % 16 != 0:
        return None
    return mg


def fused_main_grads(params, needed, slots):
    """For a backward whose weights `params` (None: no main_grad target) need gradients where `needed`: the main_grad
    the op's GEMMs add into for each of `slots` (the weights the op can take main_grads of) where fusable_main_grad
    allows, None elsewhere."""
    return [fusable_main_grad(p) if (p is not None and n and i in slots) else None
            for i, (p, n) in enumerate(zip(params, needed))]


def to_main_grad(param, grad, fused):
    """What autograd gets for `param`, whose gradient goes to its main_grad: main_grad_added when the op's GEMMs added
    it already (`fused`, from fused_main_grads), else `grad` added here."""
    return main_grad_added(param) if fused is not None else add_to_main_grad(param, grad)


class _ForwardFunction(torch.autograd.Function):
    """(output, aux_loss) of sonicmoe::forward with its backward; the state outputs go to `state_out` (a list),
    outside autograd: they carry no gradient, and an output of the Function costs host time on every forward and
    backward."""

    @staticmethod
    def forward(ctx, keyset, main_grad_targets, state_out, x, router_weight, w1, b1, w2, b2, activation, top_k,
                routing, tile, token_idx, expert_idx, scores, *router):
        n_router = len(router)  # as many as the caller passed (autograd wants one gradient per input)
        router = tuple(router) + DEFAULT_ROUTER[len(router):]  # every router argument, defaults filled in
        if router[_EXPERT_ROWS_ARG]:
            raise RuntimeError("sonicmoe_cpp: forward(..., expert_rows=True) is not differentiable through autograd "
                               "(its output, the experts' rows, is not the layer's): call it without gradients and "
                               "run its backward with backward_act(..., dw2_in_part1=True, expert_rows=True) and "
                               "backward_weights, as sonicmoe_cpp.ep does")
        args = (x, router_weight, w1, b1, w2, b2, activation, top_k, routing, tile, token_idx, expert_idx, scores,
                *router)
        # keyset None: called from forward_main_grad (Python), not by the dispatcher. Grad mode is off here, so the
        # op's Autograd kernel goes straight to the backend kernel.
        outs = _below_autograd(keyset, args) if keyset is not None else _FWD(*args)
        _save(ctx, x, router_weight, w1, b1, w2, b2, activation, top_k, routing, outs[2:], router)
        ctx.n_router_args = n_router
        ctx.main_grad_targets = main_grad_targets
        state_out.extend(outs[2:])
        return outs[0], outs[1]

    @staticmethod
    def backward(ctx, *grads):
        targets = ctx.main_grad_targets
        # (router_weight, w1, b1, w2, b2) are g[1:6]; needs_input_grad counts (keyset, main_grad_targets, state_out)
        # first. The router's (not under general routing), w1's and w2's main_grads go to the library, whose
        # weight-gradient GEMMs add into them in fp32 (no 16-bit gradient); the biases' (small) are added here.
        params = (None,) * 5 if targets is None else targets
        needed = ctx.needs_input_grad[4:9]
        fused = fused_main_grads(params, needed, (1, 3) if ctx.routing == "general" else (0, 1, 3))
        g = _backward(ctx, grads[0], grads[1], fused[1], fused[3], fused[0])
        if targets is not None:
            g = list(g)
            g[1:6] = to_main_grads(params, needed, fused, g[1:6])
        return (None, None, None, *g)


def to_main_grads(params, needed, fused, grads):
    """The gradients `grads` of (router_weight, w1, b1, w2, b2) as autograd gets them, each parameter of `params`
    (main_grad_params' tuple) that needs one (`needed`) having its gradient in its main_grad (to_main_grad; `fused`:
    fused_main_grads' list)."""
    grads = list(grads)
    for i, (param, n) in enumerate(zip(params, needed)):
        if param is not None and n and (fused[i] is not None or grads[i] is not None):
            grads[i] = to_main_grad(param, grads[i], fused[i])
    return grads


def _apply_forward(keyset, targets, args):
    """sonicmoe::forward's outputs with autograd recording (output, aux_loss)."""
    state = []
    out, aux = _ForwardFunction.apply(keyset, targets, state, *args)
    return (out, aux, *state)


def _forward_autograd(keyset, *args):
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return _apply_forward(keyset, None, args)
    return _below_autograd(keyset, args)


def forward_main_grad(args, targets):
    """torch.ops.sonicmoe.forward(*args) whose backward adds the gradient of each weight in `targets` (from
    main_grad_params: the parameters, in (router_weight, w1, b1, w2, b2) order, None where not accumulated) into that
    parameter's `main_grad` instead of returning it (the op schemas are unchanged: the autograd Function is applied
    here directly rather than through the dispatcher)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("sonicmoe_cpp: accumulate_main_grad=True is not supported under torch.compile (the "
                           "backward writes into main_grad, outside the graph)")
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return _apply_forward(None, targets, args)
    return _FWD(*args)


_LIB = torch.library.Library("sonicmoe", "IMPL")
_LIB.impl("forward", _forward_autograd, "Autograd", with_keyset=True)


def built_with_cuda() -> bool:
    return bool(_C.built_with_cuda())

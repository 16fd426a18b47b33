"""Deterministic fuzz cases of the binding's public surface (CPU), run by test_fuzz.py in subprocesses so that a crash
(a signal, an abort, a hang) is a test failure rather than the end of the test run.

    python fuzz_cases.py <family> <first seed> <count>

prints "CASE <seed>" before each case (the last one printed names the case of a crash) and "DONE <n>" at the end;
a case that breaks a rule raises (exit code != 0). The rules, for every case:
  - an input the library refuses raises ValueError / TypeError (RuntimeError for the device rule) whose message starts
    with "sonicmoe" and, for a mutated argument, names it;
  - an input it accepts gives the reference's numbers (KernelBackendMoE.torch / a float64 loop / plain indexing), so
    that a silently wrong result is caught, not only a crash;
  - an adversarial value of a typed argument (a string for a flag, a float for an integer, ...) is never accepted.
"""
import copy
import math
import random
import sys

import numpy as np
import torch

import sonicmoe_cpp as sm
from sonicmoe_cpp import _ops

ACTS = ("swiglu", "geglu", "reglu", "geglu_tanh", "gelu", "relu", "silu", "relu_sq", "gelu_tanh")
GLU = ("swiglu", "geglu", "reglu", "geglu_tanh")
ERRORS = (ValueError, TypeError)

# Values that are never a flag / an integer / a real number (each must be refused, naming the argument).
BAD_BOOL = ["no", "false", "True", None, 2, -1, 0.5, 1.0, [True], torch.ones(3)]
BAD_INT = [2.7, 2.0, "3", None, True, [2], torch.tensor(2.5)]
BAD_REAL = ["2", "1.5", [1.0], True, None, torch.ones(2)]


def refused(exc, name=None):
    """The exception is the library's: its type and a message that names the module and the argument."""
    msg = str(exc)
    assert isinstance(exc, ERRORS + (RuntimeError,)), f"{type(exc).__name__}: {msg}"
    assert "sonicmoe" in msg, f"an error that is not the library's: {type(exc).__name__}: {msg}"
    if name is not None:
        assert name in msg, f"the error does not name {name!r}: {msg}"


def close(a, b, tol, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.numel():
        err = (a.double() - b.double()).abs().max().item()
        scale = max(1.0, b.double().abs().max().item())
        assert err <= tol * scale, f"{what}: max error {err} (tolerance {tol * scale})"


def close_16bit(m, x, out, ref, tol=3e-2):
    """A 16-bit module's output against KernelBackendMoE.torch in the same dtype (`ref`): within `tol` of the output's
    scale, or, where the two differ by more, no further from the module's float32 twin than twice torch's own 16-bit
    result is. Both round each expert's output to the storage dtype before the weighted sum, so where a token's
    experts cancel (outputs of +-11.7 summing to 0.36 in one case) each is off by the terms' rounding, not the
    output's: a silently wrong result is still far outside twice torch's error."""
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref.double().abs().max().item()) if out.numel() else 1.0
    if err <= tol * scale:
        return
    import copy
    m32 = copy.deepcopy(m).float()
    with torch.no_grad():  # the same routing: fp32 logits of the same values
        exact, _ = m32(x.detach().float(), kernel_backend_moe="torch")
    ours = (out.double() - exact.double()).abs().max().item()
    theirs = (ref.double() - exact.double()).abs().max().item()
    assert ours <= 2 * theirs + tol * scale, (
        f"output vs KernelBackendMoE.torch ({x.dtype}): max difference {err} (tolerance {tol * scale}); against "
        f"float32, ours {ours}, torch's {theirs}")


# ---------------------------------------------------------------------------------------------------------------
# MoE: constructor keywords and forward, against KernelBackendMoE.torch


def _moe_kwargs(rng):
    E = rng.randint(1, 6)
    kw = dict(num_experts=E, num_experts_per_tok=rng.randint(1, E), hidden_size=rng.choice([8, 16, 16, 1, 3, 33]),
              intermediate_size=rng.choice([4, 8, 8, 1, 7]), activation_function=rng.choice(ACTS),
              add_bias=rng.random() < 0.5, std=rng.choice([0.02, 0.3, 1.0]))
    r = rng.random()
    if r < 0.2:
        kw.update(softmax_over_topk=False, norm_topk_probs=rng.random() < 0.5)
    elif r < 0.35 and E % 2 == 0 and E >= 4:
        kw.update(scoring_func="sigmoid", norm_topk_probs=True, n_group=2, topk_group=rng.randint(1, 2),
                  routed_scaling_factor=rng.choice([1.0, 2.5]), e_score_correction_bias=rng.random() < 0.5)
        if kw["num_experts_per_tok"] > kw["topk_group"] * (E // 2):
            kw["num_experts_per_tok"] = kw["topk_group"] * (E // 2)
    elif r < 0.45:
        kw.update(routed_scaling_factor=rng.choice([0.5, np.float32(2.0), 3]))
    if kw["activation_function"] in GLU and rng.random() < 0.3:
        kw["w1_layout"] = rng.choice(["interleaved", "concat", "separate"])
    if rng.random() < 0.15:
        kw["capacity_factor"] = rng.choice([0.5, 1.0, 2.0])
    return kw


_TYPED = {"add_bias": BAD_BOOL, "concat_layout": BAD_BOOL, "fp8_weight_cache": BAD_BOOL,
          "accumulate_main_grad": BAD_BOOL, "softmax_over_topk": BAD_BOOL, "norm_topk_probs": BAD_BOOL,
          "is_softmax_over_topk": BAD_BOOL[:3] + BAD_BOOL[4:], "norm_topk_prob": BAD_BOOL[:3] + BAD_BOOL[4:],
          "e_score_correction_bias": BAD_BOOL,
          "num_experts": BAD_INT, "num_experts_per_tok": BAD_INT, "hidden_size": BAD_INT, "intermediate_size": BAD_INT,
          "n_group": [2.7, "3", True], "topk_group": [2.7, "3", True], "tile": BAD_INT,
          "routed_scaling_factor": BAD_REAL[:4], "capacity_factor": BAD_REAL[:4] + BAD_REAL[5:], "std": BAD_REAL,
          "activation_function": [None, 3, "tanh", "swi glu"], "precision": [None, "fp16", 8],
          "w1_layout": ["Separate", 1, "concat "], "scoring_func": [None, "Softmax", 1], "routing": [None, 5, "topk2"]}
_VALUES = {"num_experts": [0, -1], "num_experts_per_tok": [0, -3, 99], "hidden_size": [0, -8],
           "intermediate_size": [0, -4], "routed_scaling_factor": [0.0, -1.0, math.nan, math.inf, 1e300],
           "capacity_factor": [-1.0, math.nan, math.inf], "std": [-1.0, math.nan, math.inf]}


def _x(rng, H, T, dtype):
    kind = rng.choice(["contiguous", "transposed", "sliced", "expanded", "3d"])
    if kind == "transposed":
        x = torch.randn(H, T).t()
    elif kind == "sliced":
        x = torch.randn(2 * T, 2 * H)[::2, 1::2]
    elif kind == "expanded" and T > 0:
        x = torch.randn(1, H).expand(T, H)
    elif kind == "3d":
        x = torch.randn(1, T, H)
    else:
        x = torch.randn(T, H)
    return x.to(dtype)


def near_tie(logits, K, rel=1e-5):
    """Whether a row of exact (float64) logits has its K-th and (K+1)-th largest within rel of its largest magnitude:
    fp32 logits summed in different orders (the library's GEMM, torch's matmul) may then pick different experts
    (seed 8114103 of topk_fn: logits 0.0940219754 and 0.0940219318)."""
    if K >= logits.shape[1] or logits.shape[0] == 0:
        return False
    top = logits.topk(K + 1, dim=1).values
    scale = logits.abs().amax(dim=1).clamp_min(1.0)
    return bool(((top[:, K - 1] - top[:, K]) <= rel * scale).any())


def check_autocast(m, x, out, aux, ac, backend, inference):
    """A module call under torch.autocast(dtype=ac): the output in ac, bitwise the module converted to ac on x
    converted to ac (either backend: KernelBackendMoE.torch casts as the kernels do)."""
    assert out.shape == x.shape and (aux is None) == inference
    assert out.dtype == ac, f"autocast {ac}: output {out.dtype}"
    ref_m = copy.deepcopy(m).to(ac)
    with torch.no_grad():
        ref, ref_aux = ref_m(x.detach().to(ac), kernel_backend_moe=backend, is_inference_mode=inference)
    assert torch.equal(out.detach(), ref), f"autocast {ac}: output differs from the module converted to {ac}"
    assert aux is None or torch.equal(aux.detach(), ref_aux), f"autocast {ac}: aux loss differs"


def family_moe(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kw = _moe_kwargs(rng)
    mutated = None
    if rng.random() < 0.25:  # one constructor keyword replaced by a value it must refuse
        mutated = rng.choice(sorted(_TYPED))
        kw[mutated] = rng.choice(_TYPED[mutated] + _VALUES.get(mutated, []))
    try:
        m = sm.MoE(**kw)
    except Exception as e:  # noqa: BLE001
        refused(e, mutated if mutated is not None else None)
        return
    assert mutated is None, f"{mutated}={kw[mutated]!r} accepted"
    dtype = rng.choice([torch.float32] * 6 + [torch.bfloat16, torch.float16] * 2 + [torch.float64, torch.int32])
    if dtype in (torch.bfloat16, torch.float16) and rng.random() < 0.85:
        m = m.to(dtype)
    H = m.hidden_size
    T = rng.choice([0, 1, 3, 7, 7, 130])
    x = _x(rng, H, T, dtype)
    if rng.random() < 0.05:
        x = x.to("meta")
    grad = rng.random() < 0.5 and x.is_floating_point() and x.device.type == "cpu"
    if grad:
        x = x.detach().requires_grad_(True)
    inference = rng.choice([False] * 5 + [True] * 3 + ["yes", None])
    backend = rng.choice(["sonicmoe"] * 5 + [sm.KernelBackendMoE.scattermoe, "torch", "tpu"])
    # One case in ten under torch.autocast, drawn from a stream of its own (the other draws, and the seeds that are
    # regression cases, stay as they were).
    ac = random.Random(seed * 7919 + 1).choice([torch.bfloat16, torch.float16] + [None] * 18)
    try:
        with torch.autocast("cpu", dtype=ac or torch.bfloat16, enabled=ac is not None):
            out, aux = m(x, kernel_backend_moe=backend, is_inference_mode=inference)
    except Exception as e:  # noqa: BLE001
        refused(e)
        return
    assert isinstance(inference, bool), f"is_inference_mode={inference!r} accepted"
    assert backend != "tpu"
    if ac is not None and x.device.type == "cpu" and x.is_floating_point() and x.dtype != torch.float64:
        check_autocast(m, x, out, aux, ac, backend, inference)
        return
    w = m.router.weight
    assert x.dtype == w.dtype and x.device == w.device, f"x {x.dtype} accepted by a {w.dtype} module"
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (aux is None) == inference
    if x.device.type == "meta":
        return
    # the reference: the same module in plain PyTorch ops (fp32 for 16-bit modules: tolerance of the storage)
    # KernelBackendMoE.torch has no capacity: a module with one is compared with ExpertParallelMoE below only
    no_capacity = not m.router_config["capacity_factor"]
    if backend != "torch" and m.routing == "topk" and no_capacity:
        with torch.no_grad():  # the same routing (fp32 logits of the same values), the experts in x's dtype
            ref, ref_aux = m(x.detach(), kernel_backend_moe="torch")
        if x.dtype == torch.float32:
            close(out.detach(), ref, 2e-5, "output vs KernelBackendMoE.torch (torch.float32)")
        else:
            close_16bit(m, x, out.detach(), ref)
        if aux is not None:
            close(aux.detach(), ref_aux, 1e-5, "aux loss")
    if grad and not inference and out.requires_grad:
        frozen = [p for p in m.parameters() if rng.random() < 0.2]
        for p in frozen:
            p.requires_grad_(False)
        g_out = torch.randn(out.shape).to(out.dtype)
        loss = (out * g_out).float().sum() + (aux if aux is not None else 0)
        params = [p for p in m.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, [x] + params, allow_unused=True)
        assert grads[0] is not None and grads[0].shape == x.shape
        assert x.dtype != torch.float32 or bool(torch.isfinite(grads[0]).all())  # (16-bit: may overflow, as torch)
        if backend != "torch" and x.dtype == torch.float32 and m.routing == "topk" and no_capacity:
            out_r, aux_r = m(x, kernel_backend_moe="torch")
            loss_r = (out_r * g_out).sum() + aux_r
            refs = torch.autograd.grad(loss_r, [x] + params, allow_unused=True)
            names = ["x"] + [n for n, p in m.named_parameters() if p.requires_grad]
            # K = 1 with the top-K weight normalised (softmax over the top K, or norm_topk_probs) is identically 1
            # (times routed_scaling_factor): the output carries no router gradient, and the router's is the aux
            # loss's plus each path's rounding of a derivative that is exactly zero, of the size of the score
            # gradient <dO, y> times fp32's epsilon (1.1e-4 against 0.015 at large outputs, seed 924264).
            cfg = m.router_config
            unit_weight = m.top_k == 1 and (cfg["norm_topk_probs"]
                                            or (cfg["scoring_func"] == "softmax" and cfg["softmax_over_topk"]))
            for name, a, b in zip(names, grads, refs):
                if b is None:
                    assert a is None or not a.any(), f"gradient of {name}: nonzero, the reference has none"
                    continue
                assert a is not None, f"gradient of {name} missing"
                tol_g = 1e-3 if unit_weight and name == "router.weight" else 1e-4
                close(a, b, tol_g, f"gradient of {name} vs KernelBackendMoE.torch")
    if backend != "torch" and not inference and x.dtype == torch.float32 and m.routing == "topk" \
            and m.w1_layout == "interleaved" and rng.random() < 0.3:
        ep = sm.ExpertParallelMoE.from_moe(m)  # one rank: MoE's own fused op, bit for bit
        with torch.no_grad():
            y, a = ep(x.detach())
            y0, a0 = m(x.detach())
        assert torch.equal(y, y0) and torch.equal(a, a0), "ExpertParallelMoE (one rank) differs from MoE"


def family_fp8(seed):
    """precision 'fp8' (H, I multiples of 128): kernels vs KernelBackendMoE.torch within FP8's error, gradients too."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    E = rng.randint(1, 4)
    act = rng.choice(ACTS)
    m = sm.MoE(E, rng.randint(1, E), 128, rng.choice([128, 256]), act, rng.random() < 0.5, 0.05,
               precision=rng.choice(["fp8", "fp8_blockwise", "FP8"]), fp8_weight_cache=rng.random() < 0.5)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    if dtype != torch.float32:
        m = m.to(dtype)
    x = torch.randn(rng.choice([0, 1, 5]), 128).to(dtype).requires_grad_(True)
    try:
        out, aux = m(x)
    except Exception as e:  # noqa: BLE001
        assert dtype == torch.float16, f"fp8 refused {dtype}: {e}"
        refused(e)
        return
    assert dtype != torch.float16, "fp16 accepted under precision fp8 (refused by design)"
    ref, ref_aux = m(x, kernel_backend_moe="torch")
    if x.shape[0]:
        err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()
        assert err < 0.15, f"fp8 output relative error {err}"
    (out.float().sum() + aux).backward()
    assert x.grad.shape == x.shape and bool(torch.isfinite(x.grad.float()).all())


# ---------------------------------------------------------------------------------------------------------------
# general routing (sonicmoe_cpp.moe_general_routing_inputs, the original's), against a float64 loop


def _general_ref(x, tok, exp, sc, w1, b1, w2, b2, act):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from reference import experts
    return experts(x.double(), tok.long(), exp.long(), sc.double(), w1.double(), None if b1 is None else b1.double(),
                   w2.double(), None if b2 is None else b2.double(), act)


def family_general(seed):
    from sonicmoe_cpp.functional import moe_general_routing_inputs
    rng = random.Random(seed)
    torch.manual_seed(seed)
    E, H, I, T = rng.randint(1, 5), rng.choice([8, 16]), rng.choice([4, 8]), rng.randint(1, 6)
    act = rng.choice(ACTS)
    ZW = 2 * I if act in GLU else I
    w1, w2 = torch.randn(E, ZW, H) * 0.3, torch.randn(E, H, I) * 0.3
    b1, b2 = (torch.randn(E, ZW), torch.randn(E, H)) if rng.random() < 0.5 else (None, None)
    x = torch.randn(T, H)
    n = rng.randint(0, 3 * T)
    tok = torch.tensor(sorted(rng.randrange(T) for _ in range(n)), dtype=torch.int64)
    exp = torch.tensor([rng.randrange(E) for _ in range(n)], dtype=torch.int64)
    sc = torch.rand(n)
    bad = None
    if n and rng.random() < 0.5:
        i = rng.randrange(n)
        bad, t = rng.choice([("token_indices", tok), ("expert_indices", exp)])
        t[i] = rng.choice([-1, -2 ** 31, 2 ** 31, 2 ** 32 + int(t[i]), T if bad == "token_indices" else E, 10 ** 6])
    if n > 1 and rng.random() < 0.15:
        tok = tok.flip(0).contiguous()
        bad = bad or ("token_indices" if tok[0] != tok[-1] else None)
    itype = rng.choice([torch.int32, torch.int64])
    if itype == torch.int32 and bad is not None and (tok.abs().max() >= 2 ** 31 or exp.abs().max() >= 2 ** 31):
        itype = torch.int64
    tok_i, exp_i = tok.to(itype), exp.to(itype)
    inference = rng.random() < 0.3
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    b1, b2 = (None, None) if b1 is None else (b1.to(dtype), b2.to(dtype))
    try:
        o, freq = moe_general_routing_inputs(x, sc, tok_i, exp_i, w1.permute(1, 2, 0), b1, w2.permute(1, 2, 0), b2, E,
                                             0, act, is_inference_mode_enabled=inference)
    except Exception as e:  # noqa: BLE001
        assert bad is not None, f"valid triples refused: {e}"
        refused(e)
        return
    assert bad is None, f"{bad} with an out-of-range / unsorted value accepted"
    assert o.dtype == dtype and o.shape == x.shape
    close(o.double(), _general_ref(x, tok, exp, sc, w1, b1, w2, b2, act), 1e-5 if dtype == torch.float32 else 3e-2,
          "general routing vs float64")
    assert torch.equal(freq.long(), torch.bincount(exp, minlength=E)), "expert_frequency"


# ---------------------------------------------------------------------------------------------------------------
# moe_deepep / moe_permuted, against the float64 loop


def family_dispatched(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    E, H, I, N, K = rng.randint(1, 4), 8, 4, rng.randint(0, 6), rng.randint(1, 3)
    act = rng.choice(ACTS)
    ZW = 2 * I if act in GLU else I
    w1, w2 = torch.randn(E, ZW, H) * 0.3, torch.randn(E, H, I) * 0.3
    b1, b2 = (torch.randn(E, ZW), torch.randn(E, H)) if rng.random() < 0.5 else (None, None)
    x = torch.randn(N, H)
    bad = None
    if rng.random() < 0.5:
        idx = torch.tensor([[rng.randint(-1, E - 1) for _ in range(K)] for _ in range(N)], dtype=torch.int64)
        idx = idx.reshape(N, K)
        wts = torch.rand(N, K)
        num_pairs = None
        if N and rng.random() < 0.4:
            bad = "recv_topk_idx"
            idx[rng.randrange(N), rng.randrange(K)] = rng.choice([-2, E, 2 ** 32 + 1, 2 ** 31, -2 ** 40])
        elif rng.random() < 0.3:
            num_pairs = int((idx >= 0).sum()) + rng.choice([0, 1, -1, 0.5])
            bad = None if isinstance(num_pairs, int) and num_pairs == int((idx >= 0).sum()) else "num_pairs"
        try:
            o = sm.moe_deepep(x, idx.to(rng.choice([torch.int32, torch.int64])) if bad is None else idx, wts, w1, b1,
                              w2, b2, act, num_pairs=num_pairs)
        except Exception as e:  # noqa: BLE001
            assert bad is not None, f"valid DeepEP input refused: {e}"
            refused(e, bad)
            return
        assert bad is None, f"{bad} accepted"
        rows, cols = (idx >= 0).nonzero().unbind(1)
        ref = _general_ref(x, rows, idx[rows, cols], wts[rows, cols], w1, b1, w2, b2, act)
    else:
        counts = [rng.randint(0, 3) for _ in range(E)]
        N = sum(counts)
        x = torch.randn(N, H)
        probs = torch.rand(N)
        tpe = torch.tensor(counts)
        if rng.random() < 0.3:
            bad = "tokens_per_expert"
            j = rng.randrange(E)
            tpe[j] = rng.choice([-1, tpe[j] + 1, 2 ** 32 + tpe[j]])
        try:
            o = sm.moe_permuted(x, tpe, probs, w1, b1, w2, b2, act)
        except Exception as e:  # noqa: BLE001
            assert bad is not None, f"valid permuted input refused: {e}"
            refused(e, bad)
            return
        assert bad is None, f"{bad} accepted"
        ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
        ref = _general_ref(x, torch.arange(N), ids, probs, w1, b1, w2, b2, act)
    close(o.double(), ref, 1e-5, "dispatched vs float64")


# ---------------------------------------------------------------------------------------------------------------
# the raw backward with corrupted saved state: refused, or (a value it does not read) the true state's gradients

_INDEX_STATE = ("pair_token", "pair_expert", "pair_slot", "counts", "offsets", "pair", "gather", "rev",
                "token_offsets", "demand", "dropped")


def family_state(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    E, K, H, I, T = rng.randint(2, 5), 0, 8, 4, rng.randint(1, 7)
    K = rng.randint(1, E)
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
    m = sm.MoE(E, K, H, I, "swiglu", rng.random() < 0.5, 0.3).to(dtype)
    x = torch.randn(T, H).to(dtype)
    routing = rng.choice(["topk", "topk", "round_nearest", "round_up", "round_down", "general"])
    kw = dict(capacity_factor=rng.choice([0.5, 1.0])) if routing == "topk" and rng.random() < 0.4 else {}
    weights = (m.router.weight.detach(), m.c_fc.weight.detach(), None if m.c_fc.bias is None else m.c_fc.bias.detach(),
               m.c_proj.weight.detach(), None if m.c_proj.bias is None else m.c_proj.bias.detach())
    triples = (None, None, None)
    d_out, d_aux = torch.randn(T, H).to(dtype), torch.ones(1)
    if routing == "general":  # caller-given pairs sorted by token; no router, no aux loss
        n = rng.randint(0, 3 * T)
        triples = (torch.tensor(sorted(rng.randrange(T) for _ in range(n)), dtype=torch.int32),
                   torch.tensor([rng.randrange(E) for _ in range(n)], dtype=torch.int32), torch.rand(n))
        weights, K, d_aux = (None,) + weights[1:], 1, None
    args = (x, *weights, "swiglu", K, routing)
    outs = list(torch.ops.sonicmoe.forward(*args, 2, *triples, **kw))

    op = rng.choice([torch.ops.sonicmoe.backward, torch.ops.sonicmoe.backward_act])

    def backward(state):
        return op(d_out, *args, *state, d_aux, False, True)

    truth = backward(outs[2:])
    name = rng.choice(_INDEX_STATE + ("z", "logits", "topk_score"))
    i = 2 + _ops._STATE_NAMES.index(name)
    t = outs[i].clone()
    # a wrong length (an absent state given, a present one short or long); float state only so: its values are data
    if rng.random() < 0.2 or name in ("z", "logits", "topk_score"):
        t = torch.cat([t.reshape(-1), t.reshape(-1)[:1] if t.numel() else torch.zeros(1, dtype=t.dtype)]) \
            if rng.random() < 0.5 or t.numel() == 0 else t.reshape(-1)[:-1].contiguous()
    elif t.numel():
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([-1, 0, 1, T, E, T * K, K, -2 ** 31, 2 ** 31 - 1, 10 ** 6])
    else:
        return
    outs[i] = t
    try:
        got = backward(outs[2:])
    except Exception as e:  # noqa: BLE001
        refused(e)
        return
    for i, (a, b) in enumerate(zip(got, truth)):
        assert torch.equal(a, b), f"corrupted state '{name}' accepted with another output {i} of {op}"


# ---------------------------------------------------------------------------------------------------------------
# gather_sum with caller-given rev / token_offsets


def family_gather_sum(seed):
    """gather_sum(rows, rev, token_offsets[, scores]): a range of the tokens (token_offsets starting past 0, as
    ExpertParallelMoE's split sums pass them) or all of them, with or without pair scores; one bad argument or none."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    N, Hc, T = rng.randint(0, 6), rng.randint(1, 4), rng.randint(0, 5)
    rows = torch.randn(N, Hc)
    P = N
    rev = [rng.randrange(N) for _ in range(P)] if N else []
    cuts = sorted(rng.randint(0, P) for _ in range(max(T - 1, 0)))
    off = [0] + cuts + [P] if T else [0]
    if len(off) > 1 and rng.random() < 0.3:  # a range of the tokens: the offsets from its first token
        off = off[rng.randrange(len(off) - 1):]
    scores = torch.rand(P) + 0.1 if rng.random() < 0.5 else None
    bad = None
    if rng.random() < 0.5 and (P or T):
        r = rng.random()
        if P and r < 0.4:
            rev[rng.randrange(P)] = rng.choice([-1, N, 2 ** 31 - 1, -2 ** 31])
            bad = "rev"
        elif r < 0.8:
            off[rng.randrange(len(off))] = rng.choice([-1, P + 1, 2 ** 31 - 1, -2 ** 31])
            bad = "token_offsets" if any(b < a for a, b in zip([0] + off, off)) or max(off) > P else None
        else:
            scores = rng.choice([torch.rand(P + 1), torch.rand(P, dtype=torch.float64), torch.rand(P, 1)])
            bad = "scores"
    try:
        out = torch.ops.sonicmoe.gather_sum(rows, torch.tensor(rev, dtype=torch.int32),
                                            torch.tensor(off, dtype=torch.int32), scores)
    except Exception as e:  # noqa: BLE001
        assert bad is not None, f"valid gather_sum input refused: {e}"
        refused(e, bad)
        return
    assert bad is None, f"bad {bad} accepted"
    ref = torch.zeros(max(len(off) - 1, 0), Hc, dtype=torch.float64)
    for t in range(len(off) - 1):
        for p in range(off[t], off[t + 1]):
            ref[t] += rows[rev[p]].double() * (1.0 if scores is None else float(scores[p]))
    close(out.double(), ref, 1e-6, "gather_sum")


def family_topk_op(seed):
    """torch.ops.sonicmoe.topk (the expert-parallel layer's top-K): reference.topk_reference's ids, counts and scores,
    ties included, or, for a bad k, a non-finite logit, another dtype, a non-contiguous or non-2-D logits, a refusal
    naming the argument."""
    from reference import topk_reference
    rng = random.Random(seed)
    torch.manual_seed(seed)
    T, E = rng.randint(0, 40), rng.randint(1, 70)
    k = rng.randint(1, E)
    logits = torch.randn(T, E) * rng.choice([1e-3, 1.0, 30.0])
    if rng.random() < 0.3:
        logits = (logits * 2).round() / 2  # ties at the k-th place
    bad, r = None, rng.random()
    if r < 0.1:
        k, bad = rng.choice([0, -1, E + 1, 2 ** 31, 2 ** 63 - 1]), "'k'"
    elif r < 0.2 and T:
        logits[rng.randrange(T), rng.randrange(E)] = rng.choice([math.nan, math.inf, -math.inf])
        bad = "logits"
    elif r < 0.3:
        logits, bad = logits.to(rng.choice([torch.float64, torch.bfloat16, torch.float16, torch.int32])), "logits"
    elif r < 0.4 and T > 1 and E > 1:
        logits, bad = torch.randn(E, T).t(), "logits"
    elif r < 0.5:
        logits, bad = (logits.reshape(-1) if rng.random() < 0.5 else logits[None]), "logits"
    try:
        ids, scores, counts = torch.ops.sonicmoe.topk(logits, k)
    except Exception as e:  # noqa: BLE001
        assert bad is not None, f"valid topk input refused: {e}"
        refused(e, bad)
        return
    assert bad is None, f"bad {bad} accepted"
    r_ids, r_scores, r_counts = topk_reference(logits, k)
    assert torch.equal(ids.long(), r_ids), "topk ids"
    assert torch.equal(counts.long(), r_counts), "topk counts"
    close(scores.double(), r_scores.double(), 1e-6, "topk scores")


def family_topk_fn(seed):
    """The original's moe_TC_softmax_topk_layer (weights in its [*, *, E] layouts: permuted views or copies) against
    MoE's KernelBackendMoE.torch on the same weights; bad K / router / bias shapes refused."""
    from sonicmoe_cpp.functional import moe_TC_softmax_topk_layer
    rng = random.Random(seed)
    torch.manual_seed(seed)
    E = rng.randint(1, 5)
    K = rng.randint(1, E)
    act = rng.choice(ACTS)
    softmax_over_topk, norm = rng.random() < 0.6, rng.random() < 0.5
    concat = act in GLU and rng.random() < 0.3
    m = sm.MoE(E, K, 16, 8, act, rng.random() < 0.5, 0.3, softmax_over_topk=softmax_over_topk,
               norm_topk_probs=norm, concat_layout=concat)
    x = torch.randn(rng.choice([0, 1, 4, 9]), 16, requires_grad=True)
    w1, w2 = m.c_fc.weight.permute(1, 2, 0), m.c_proj.weight.permute(1, 2, 0)
    if rng.random() < 0.3:  # a copy in the original's layout (not a view of the module's memory)
        w1, w2 = w1.detach().contiguous().requires_grad_(), w2.detach().contiguous().requires_grad_()
    b1, b2, rw, k = m.c_fc.bias, m.c_proj.bias, m.router.weight, K
    bad = None
    r = rng.random()
    if r < 0.1:
        bad, k = "K", rng.choice([0, E + 1, -1, 2.0, True, "2"])
    elif r < 0.15:
        bad, rw = "router_w", torch.randn(E + 1, 16)
    elif r < 0.2:
        bad, w2 = "w2", torch.randn(16, 9, E)
    elif r < 0.25 and b1 is not None:
        bad, b1 = "b1", torch.randn(E, 3)
    try:
        o, logits, counts = moe_TC_softmax_topk_layer(x, rw, w1, b1, w2, b2, k, 0, act, False, softmax_over_topk, norm,
                                                      concat)
    except Exception as e:  # noqa: BLE001
        assert bad is not None, f"valid input refused: {e}"
        refused(e, bad)
        return
    assert bad is None, f"bad {bad} accepted"
    ref, _ = m(x, kernel_backend_moe="torch")
    close(logits, x.float() @ rw.float().t(), 1e-5, "router_logits")
    assert counts.dtype == torch.int32 and int(counts.sum()) == x.shape[0] * K
    if near_tie(x.detach().double() @ rw.detach().double().t(), K):
        return  # two fp32 sums of the same logits may order a near-tie at the K-th place either way
    close(o, ref, 2e-5, "moe_TC_softmax_topk_layer vs KernelBackendMoE.torch")
    g = torch.randn(o.shape)
    gx, = torch.autograd.grad((o * g).sum(), [x])
    gx_ref, = torch.autograd.grad((ref * g).sum(), [x])
    close(gx, gx_ref, 1e-4, "moe_TC_softmax_topk_layer dx")


FAMILIES = {"moe": family_moe, "fp8": family_fp8, "topk_fn": family_topk_fn, "general": family_general,
            "dispatched": family_dispatched, "state": family_state,
            "gather_sum": family_gather_sum, "topk_op": family_topk_op}

if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    family, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for s in range(first, first + count):
        print(f"CASE {family} {s}", flush=True)
        FAMILIES[family](s)
    print(f"DONE {count}", flush=True)

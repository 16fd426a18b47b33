"""The ops' expert-rows path (forward(..., expert_rows=True), backward_act(..., expert_rows=True), gather_sum with
scores over ranges of tokens), which ExpertParallelMoE's split sums run on: bitwise the layer's own forward and
backward once the rows are summed, on the CPU and on CUDA; the fake kernels' shapes; the refusals."""
import pytest
import torch

import sonicmoe_cpp as sm

OPS = sm._ops
STATE = OPS._STATE_NAMES
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sm.built_with_cuda() else [])
# (tail of the backward ops after the state: d_aux_loss, consume_z, validate_state, the router's, precision)
TAIL = (None, False, False, "softmax", True, False, 1.0, "bf16")


def problem(device, T=37, H=64, I=32, E=6, act="swiglu", bias=True, seed=0):
    """Random weights and general-routing pairs (0-3 distinct experts a token, some tokens without any)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    zw = 2 * I if sm.is_glu(act) else I
    w1 = torch.randn(E, zw, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    b1 = torch.randn(E, zw, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    x = torch.randn(T, H, generator=g)
    d_out = torch.randn(T, H, generator=g)
    counts = torch.randint(0, 4, (T,), generator=g)
    counts[::5] = 0
    tok = torch.repeat_interleave(torch.arange(T), counts).int()
    exp = torch.cat([torch.randperm(E, generator=g)[:int(c)] for c in counts]).int()
    sc = torch.rand(tok.shape[0], generator=g) + 0.1
    to = lambda t: None if t is None else t.to(device, dt if t.is_floating_point() and t is not sc else t.dtype)
    return dict(x=to(x), w1=to(w1), b1=to(b1), w2=to(w2), b2=to(b2), d_out=to(d_out), tok=tok.to(device),
                exp=exp.to(device), sc=sc.to(device), act=act)


def forward(p, expert_rows):
    router = OPS.DEFAULT_ROUTER[:OPS._EXPERT_ROWS_ARG] + (expert_rows,)
    with torch.no_grad():
        return torch.ops.sonicmoe.forward(p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], p["act"], 1, "general",
                                          128, p["tok"], p["exp"], p["sc"], *router)


def backward(p, state, **kw):
    return torch.ops.sonicmoe.backward(p["d_out"], p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], p["act"], 1,
                                       "general", *state, *TAIL, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("gelu", False)])
def test_summed_rows_are_the_layer(device, act, bias):
    p = problem(device, act=act, bias=bias)
    T = p["x"].shape[0]
    ref = forward(p, False)
    ref_g = backward(p, ref[2:])
    for consume in (False, True):
        outs = forward(p, True)
        y, state = outs[0], outs[2:]
        N = p["tok"].shape[0]
        assert tuple(y.shape) == (N, p["x"].shape[1])
        rev, toff, ps = (state[STATE.index(n)] for n in ("rev", "token_offsets", "pair_score"))
        # the per-token sum over ranges of tokens (as ExpertParallelMoE sums the other rank's tokens first)
        cuts = [0, 1, 11, 12, T]
        out = torch.cat([torch.ops.sonicmoe.gather_sum(y, rev, toff[a:b + 1], ps) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(out, ref[0])
        tail = TAIL[:1] + (consume,) + TAIL[2:]
        dxe, drouter, dscore, dz, a_s, dw2, db2 = torch.ops.sonicmoe.backward_act(
            p["d_out"], p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], act, 1, "general", *state, *tail, True,
            None, True)
        assert tuple(dxe.shape) == (N, p["x"].shape[1]) and a_s.numel() == 0
        assert (dz.numel() == 0) == consume  # consumed: dZ is in Z's memory
        dx = torch.cat([torch.ops.sonicmoe.gather_sum(dxe, rev, toff[a:b + 1]) for a, b in zip(cuts, cuts[1:])])
        dw1, db1, _, _ = torch.ops.sonicmoe.backward_weights(
            p["d_out"], p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], act, 1, "general", *state,
            state[STATE.index("z")] if consume else dz, a_s, *TAIL)
        assert torch.equal(dx, ref_g[0])
        assert torch.equal(dw1, ref_g[1]) and torch.equal(dw2, ref_g[3]) and torch.equal(dscore, ref_g[6])
        if bias:
            assert torch.equal(db1, ref_g[2]) and torch.equal(db2, ref_g[4])


def test_fake_kernels_give_the_rows_shapes():
    p = problem("cpu")
    router = OPS.DEFAULT_ROUTER[:OPS._EXPERT_ROWS_ARG] + (True,)
    args = (p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], "swiglu", 1, "general", 128, p["tok"], p["exp"],
            p["sc"], *router)
    torch.library.opcheck(torch.ops.sonicmoe.forward.default, args, test_utils=("test_faketensor",))
    outs = forward(p, True)
    rev, toff, ps = (outs[2 + STATE.index(n)] for n in ("rev", "token_offsets", "pair_score"))
    torch.library.opcheck(torch.ops.sonicmoe.gather_sum.default, (outs[0], rev, toff[3:9], ps),
                          test_utils=("test_faketensor",))


def test_refusals_name_the_argument():
    p = problem("cpu")
    router = OPS.DEFAULT_ROUTER[:OPS._EXPERT_ROWS_ARG] + (True,)
    rw = torch.randn(6, 64)
    with pytest.raises(ValueError, match="general routing only"):
        with torch.no_grad():
            torch.ops.sonicmoe.forward(p["x"], rw, p["w1"], p["b1"], p["w2"], p["b2"], "swiglu", 2, "topk", 128,
                                       None, None, None, *router)
    fp8 = OPS.DEFAULT_ROUTER[:OPS._PRECISION_ARG] + ("fp8",) + OPS.DEFAULT_ROUTER[OPS._PRECISION_ARG + 1:-1] + (True,)
    q = problem("cpu", H=128, I=128)
    with pytest.raises(ValueError, match="16-bit layer only"):
        with torch.no_grad():
            torch.ops.sonicmoe.forward(q["x"], None, q["w1"], q["b1"], q["w2"], q["b2"], "swiglu", 1, "general", 128,
                                       q["tok"], q["exp"], q["sc"], *fp8)
    with pytest.raises(ValueError, match="'expert_rows' = True is for the training forward"):
        torch.ops.sonicmoe.inference(p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], "swiglu", 1, "general", 128,
                                     p["tok"], p["exp"], p["sc"], *router)
    w1 = p["w1"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable through autograd"):
        torch.ops.sonicmoe.forward(p["x"], None, w1, p["b1"], p["w2"], p["b2"], "swiglu", 1, "general", 128,
                                   p["tok"], p["exp"], p["sc"], *router)
    state = forward(p, True)[2:]
    with pytest.raises(ValueError, match="takes dw2_in_part1=True"):
        torch.ops.sonicmoe.backward_act(p["d_out"], p["x"], None, p["w1"], p["b1"], p["w2"], p["b2"], "swiglu", 1,
                                        "general", *state, *TAIL, False, None, True)
    y, rev, toff = forward(p, True)[0], state[STATE.index("rev")], state[STATE.index("token_offsets")]
    with pytest.raises(ValueError, match="argument 'scores' has shape"):
        torch.ops.sonicmoe.gather_sum(y, rev, toff, torch.ones(3))
    with pytest.raises(ValueError, match="argument 'scores'"):
        torch.ops.sonicmoe.gather_sum(y, rev, toff, torch.ones(rev.shape[0], dtype=torch.float64))

"""sonicmoe_cpp vs a plain float64 PyTorch MoE (tests/reference.py): forward, every gradient, routing modes,
activations, bias, dtypes; state dicts; argument errors; torch.compile; a short training run."""
import pytest
import torch

import sonicmoe_cpp as sm
from reference import GLU, experts, moe_reference

ACTS = ["swiglu", "geglu", "reglu", "gelu", "relu", "silu", "relu_sq", "geglu_tanh", "gelu_tanh"]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_params(E, H, I, act, bias, dtype, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    zw = 2 * I if act in GLU else I

    def r(*s, scale=std):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)

    p = dict(router=r(E, H, scale=1.0), w1=r(E, zw, H), w2=r(E, H, I))
    p["b1"] = r(E, zw, scale=0.1) if bias else None
    p["b2"] = r(E, H, scale=0.1) if bias else None
    return p


def leaves(p, dtype):
    return {k: (v.detach().to(dtype).requires_grad_(True) if v is not None else None) for k, v in p.items()}


def tol(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2


def check_grads(ours, ref, names, dtype, what):
    for n in names:
        a, b = ours[n], ref[n]
        if b is None:
            continue
        assert a is not None, f"{what}: no gradient for {n}"
        assert a.dtype == b.dtype or True
        e = rel_err(a, b)
        assert e < tol(dtype) * (3 if n in ("router", "scores") else 1), f"{what}: grad {n} rel err {e:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("swiglu", True), ("geglu", False), ("reglu", True),
                                      ("gelu", False), ("relu", True), ("silu", False), ("relu_sq", False),
                                      ("geglu_tanh", True), ("gelu_tanh", False)])
def test_topk_forward_backward(act, bias, dtype):
    T, H, I, E, K = 37, 32, 24, 6, 2
    torch.manual_seed(1)
    p = make_params(E, H, I, act, bias, dtype)
    x0 = (torch.randn(T, H, dtype=torch.float64)).to(dtype)
    g_out = torch.randn(T, H, dtype=torch.float64)
    g_aux = 0.7

    q = leaves(p, dtype)
    x = x0.clone().requires_grad_(True)
    out, aux = sm.moe_topk(x, q["router"], q["w1"], q["b1"], q["w2"], q["b2"], K, act)
    assert out.dtype == dtype and out.shape == (T, H) and aux.shape == ()
    ((out.double() * g_out).sum() + g_aux * aux.double()).backward()

    r = leaves(p, torch.float64)
    xr = x0.double().requires_grad_(True)
    out_r, aux_r = moe_reference(xr, r["router"], r["w1"], r["b1"], r["w2"], r["b2"], act, K)
    ((out_r * g_out).sum() + g_aux * aux_r).backward()

    assert rel_err(out, out_r) < tol(dtype), f"output rel err {rel_err(out, out_r):.3g}"
    assert abs(aux.item() - aux_r.item()) < 1e-4 * max(1.0, abs(aux_r.item())) * (1 if dtype == torch.float32 else 100)
    ours = {"x": x.grad, **{k: (v.grad if v is not None else None) for k, v in q.items()}}
    ref = {"x": xr.grad, **{k: (v.grad if v is not None else None) for k, v in r.items()}}
    check_grads(ours, ref, ["x", "router", "w1", "b1", "w2", "b2"], dtype, f"topk {act} bias={bias} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("relu_sq", False), ("geglu", False)])
def test_general_routing(act, bias, dtype):
    T, H, I, E = 19, 16, 12, 5
    g = torch.Generator().manual_seed(3)
    toks, exps = [], []
    for t in range(T):
        n = int(torch.randint(0, 4, (1,), generator=g))  # 0..3 experts, some tokens get none
        for e in sorted(torch.randperm(E, generator=g)[:n].tolist()):
            toks.append(t)
            exps.append(e)
    N = len(toks)
    tok = torch.tensor(toks, dtype=torch.int32)
    exp = torch.tensor(exps, dtype=torch.int32)
    s0 = torch.rand(N, generator=g, dtype=torch.float64) + 0.1
    p = make_params(E, H, I, act, bias, dtype)
    x0 = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    g_out = torch.randn(T, H, generator=g, dtype=torch.float64)

    q = leaves(p, dtype)
    x = x0.clone().requires_grad_(True)
    s = s0.float().requires_grad_(True)
    out = sm.moe_general_routing(x, tok, exp, s, q["w1"], q["b1"], q["w2"], q["b2"], act)
    (out.double() * g_out).sum().backward()

    r = leaves(p, torch.float64)
    xr = x0.double().requires_grad_(True)
    sr = s0.clone().requires_grad_(True)
    out_r = experts(xr, tok.long(), exp.long(), sr, r["w1"], r["b1"], r["w2"], r["b2"], act)
    (out_r * g_out).sum().backward()

    assert rel_err(out, out_r) < tol(dtype)
    ours = {"x": x.grad, "scores": s.grad, **{k: (v.grad if v is not None else None) for k, v in q.items()}}
    ref = {"x": xr.grad, "scores": sr.grad, **{k: (v.grad if v is not None else None) for k, v in r.items()}}
    assert q["router"].grad is None
    check_grads(ours, ref, ["x", "scores", "w1", "b1", "w2", "b2"], dtype, f"general {act} {dtype}")


@pytest.mark.parametrize("mode", ["round_down", "round_up", "round_nearest"])
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("gelu", True)])
def test_token_rounding(mode, act, bias):
    T, H, I, E, K, tile = 40, 16, 8, 4, 2, 8
    dtype = torch.float32
    p = make_params(E, H, I, act, bias, dtype, seed=5)
    x0 = torch.randn(T, H, generator=torch.Generator().manual_seed(6), dtype=torch.float64).float()
    g_out = torch.randn(T, H, dtype=torch.float64)

    q = leaves(p, dtype)
    x = x0.clone().requires_grad_(True)
    out, aux = sm.moe_token_rounding(x, q["router"], q["w1"], q["b1"], q["w2"], q["b2"], K, act,
                                     mode=mode.replace("round_", ""), tile=tile)
    ((out.double() * g_out).sum() + 0.5 * aux.double()).backward()

    r = leaves(p, torch.float64)
    xr = x0.double().requires_grad_(True)
    out_r, aux_r = moe_reference(xr, r["router"], r["w1"], r["b1"], r["w2"], r["b2"], act, K, mode, tile)
    ((out_r * g_out).sum() + 0.5 * aux_r).backward()

    assert rel_err(out, out_r) < 1e-4
    assert abs(aux.item() - aux_r.item()) < 1e-4
    ours = {"x": x.grad, **{k: (v.grad if v is not None else None) for k, v in q.items()}}
    ref = {"x": xr.grad, **{k: (v.grad if v is not None else None) for k, v in r.items()}}
    check_grads(ours, ref, ["x", "router", "w1", "b1", "w2", "b2"], dtype, f"rounding {mode} {act}")


def test_module_shapes_and_state_dict():
    torch.manual_seed(0)
    m = sm.MoE(num_experts=8, num_experts_per_tok=2, hidden_size=32, intermediate_size=16,
               activation_function=sm.ActivationType.SWIGLU, add_bias=True, std=0.02)
    sd = m.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "router.weight": (8, 32), "c_fc.weight": (8, 32, 32), "c_fc.bias": (8, 32),
        "c_proj.weight": (8, 32, 16), "c_proj.bias": (8, 32)}
    assert abs(m.c_fc.weight.std().item() - 0.02) < 0.005
    m2 = sm.MoE(8, 2, 32, 16, "swiglu", True, 0.02)
    m2.load_state_dict(sd)
    x = torch.randn(2, 7, 32)
    o1, a1 = m(x)
    o2, a2 = m2(x)
    assert o1.shape == (2, 7, 32) and a1.shape == ()
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    o3, _ = m(x.reshape(14, 32))
    torch.testing.assert_close(o3.reshape(2, 7, 32), o1)
    nonglu = sm.MoE(4, 1, 16, 8, "relu", False, 0.02)
    assert tuple(nonglu.c_fc.weight.shape) == (4, 8, 16) and nonglu.c_fc.bias is None
    assert [a.value for a in sm.ActivationType] == ACTS


def test_bad_inputs_name_the_argument():
    E, H, I, K, T = 4, 16, 8, 2, 10
    p = make_params(E, H, I, "swiglu", False, torch.float32)
    x = torch.randn(T, H)
    args = lambda **kw: {**dict(x=x, router_weight=p["router"], w1=p["w1"], b1=None, w2=p["w2"], b2=None,  # noqa
                                top_k=K), **kw}

    def call(**kw):
        a = args(**kw)
        return sm.moe_topk(a["x"], a["router_weight"], a["w1"], a["b1"], a["w2"], a["b2"], a["top_k"])

    errs = (ValueError, RuntimeError)
    with pytest.raises(errs, match="'w1'"):
        call(w1=p["w1"].double())
    with pytest.raises(errs, match="'x'"):
        call(x=torch.randn(H, T).t())  # not contiguous
    with pytest.raises(errs, match="'x'"):
        call(x=x.to(torch.float64))
    with pytest.raises(errs, match="'w1'"):  # one dtype per call: f16 x with f32 weights names the first weight
        call(x=x.to(torch.float16))
    with pytest.raises(errs, match="w2"):
        call(w2=torch.randn(E, H, I + 1))
    with pytest.raises(errs, match="w1"):
        call(w1=torch.randn(E, 2 * I + 2, H))
    with pytest.raises(errs, match="top_k"):
        call(top_k=E + 1)
    with pytest.raises(errs, match="router"):
        call(router_weight=torch.randn(E + 1, H))
    with pytest.raises(errs, match="activation"):
        sm.moe_topk(x, p["router"], p["w1"], None, p["w2"], None, K, "tanh")
    with pytest.raises(errs, match="routing"):
        torch.ops.sonicmoe.forward(x, p["router"], p["w1"], None, p["w2"], None, "swiglu", K, "bogus", 128,
                                   None, None, None)
    tok = torch.tensor([0, 1, 2], dtype=torch.int32)
    sc = torch.ones(3)
    with pytest.raises(errs, match="expert"):
        sm.moe_general_routing(x, tok, torch.tensor([0, 1, E], dtype=torch.int32), sc, p["w1"], None, p["w2"], None)
    with pytest.raises(errs, match="token_idx"):
        sm.moe_general_routing(x, tok.long(), tok, sc, p["w1"], None, p["w2"], None)
    with pytest.raises(errs, match="scores"):
        sm.moe_general_routing(x, tok, tok, sc.double(), p["w1"], None, p["w2"], None)
    with pytest.raises(errs, match="activation_function"):
        sm.MoE(4, 2, 16, 8, "tanh")
    with pytest.raises(errs, match="'x'"):
        sm.MoE(4, 2, 16, 8)(torch.randn(3, 15))


def test_opcheck_forward():
    E, H, I, K, T = 4, 16, 8, 2, 9
    p = make_params(E, H, I, "swiglu", True, torch.float32)
    x = torch.randn(T, H)
    args = (x, p["router"].clone().requires_grad_(), p["w1"].clone().requires_grad_(), p["b1"], p["w2"], p["b2"],
            "swiglu", K, "topk", 128, None, None, None)
    torch.library.opcheck(torch.ops.sonicmoe.forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("routing", ["topk", "round_nearest"])
def test_torch_compile_fullgraph(routing):
    torch.manual_seed(0)
    torch._dynamo.reset()
    m = sm.MoE(4, 2, 16, 8, "swiglu", True, 0.1, routing=routing, tile=4)
    x = torch.randn(3, 8, 16)
    x1 = x.clone().requires_grad_(True)
    o, a = m(x1)
    (o.sum() + a).backward()
    ref = [x1.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()

    backend = "inductor" if routing == "topk" else "aot_eager"
    cm = torch.compile(m, fullgraph=True, backend=backend)
    x2 = x.clone().requires_grad_(True)
    o2, a2 = cm(x2)
    (o2.sum() + a2).backward()
    torch.testing.assert_close(o2, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a2, a, rtol=1e-5, atol=1e-5)
    got = [x2.grad] + [p.grad for p in m.parameters()]
    for g1, g2 in zip(got, ref):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_training_reduces_loss():
    torch.manual_seed(0)
    H = 16
    m = sm.MoE(4, 2, H, 16, "swiglu", False, 0.1)
    teacher = torch.nn.Sequential(torch.nn.Linear(H, 32), torch.nn.Tanh(), torch.nn.Linear(32, H))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for step in range(50):
        x = torch.randn(64, H)
        with torch.no_grad():
            y = teacher(x)
        out, aux = m(x)
        loss = torch.nn.functional.mse_loss(out, y) + 0.01 * aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"loss {first:.4f} -> {last:.4f}"


def test_backward_does_not_zero_fill_state_grads():
    # The forward op's state outputs (z, logits, routing metadata) get no gradient; autograd must not materialise
    # zero tensors for them on each backward (z is [TK, z_width]: 1 GiB at the benchmark's readme-default).
    from torch.profiler import ProfilerActivity, profile
    T, H, I, E, K = 37, 32, 24, 6, 2
    p = leaves(make_params(E, H, I, "swiglu", False, torch.float32), torch.float32)
    x = torch.randn(T, H).requires_grad_(True)
    out, aux = sm.moe_topk(x, p["router"], p["w1"], None, p["w2"], None, K, "swiglu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (out.sum() + aux).backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::zeros") == 0 and names.count("aten::zero_") == 0, \
        f"backward zero-filled {names.count('aten::zeros')} tensors"
    assert x.grad is not None and p["w1"].grad is not None and p["router"].grad is not None


def test_gelu_tanh_names_and_difference():
    """The tanh GELU by name (and Hugging Face's aliases); it is not the exact GELU (the gap is ~1e-3 at O(1) inputs)."""
    for name in ("gelu_tanh", "GELU-TANH", "gelu_pytorch_tanh", "gelu_new", sm.ActivationType.GELU_TANH):
        assert sm.MoE(4, 1, 16, 8, name).activation_function == sm.ActivationType.GELU_TANH
    m = sm.MoE(4, 1, 16, 8, "geglu_tanh")
    assert m.c_fc.weight.shape == (4, 16, 16) and sm.is_glu("geglu_tanh")
    torch.manual_seed(0)
    x = torch.randn(9, 16)
    exact = sm.MoE(4, 2, 16, 8, "gelu", std=1.0)
    approx = sm.MoE(4, 2, 16, 8, "gelu_tanh", std=1.0)
    approx.load_state_dict(exact.state_dict())
    o1, _ = exact(x)
    o2, _ = approx(x)
    d = rel_err(o2, o1)
    assert 1e-6 < d < 1e-2, d


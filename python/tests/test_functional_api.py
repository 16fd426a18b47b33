"""The original's functional API (sonicmoe_cpp.functional): moe_TC_softmax_topk_layer and moe_general_routing_inputs
against MoE, moe_general_routing and a float64 PyTorch reference (tests/reference.py); layouts, inference, errors."""
import pytest
import torch
import torch.nn.functional as F

import sonicmoe_cpp as sm
from sonicmoe_cpp import functional as smf
from reference import GLU, experts

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2


def make_moe(E, H, I, K, act, bias, dtype, seed=0):
    torch.manual_seed(seed)
    moe = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.3)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 1.0)
        if bias:
            moe.c_fc.bias.normal_(0.0, 0.1)
            moe.c_proj.bias.normal_(0.0, 0.1)
    return moe.to(dtype)


def orig_weights(moe):
    """The original's functional layouts: views of the module's parameters."""
    return (moe.router.weight, moe.c_fc.weight.permute(1, 2, 0), moe.c_fc.bias, moe.c_proj.weight.permute(1, 2, 0),
            moe.c_proj.bias)


def grads(moe, x):
    return {"x": x.grad, "router": moe.router.weight.grad, "w1": moe.c_fc.weight.grad,
            "b1": None if moe.c_fc.bias is None else moe.c_fc.bias.grad, "w2": moe.c_proj.weight.grad,
            "b2": None if moe.c_proj.bias is None else moe.c_proj.bias.grad}


def test_permuted_views_are_not_copied():
    moe = make_moe(4, 16, 8, 2, "swiglu", True, torch.float32)
    _, w1, _, w2, _ = orig_weights(moe)
    assert not w1.is_contiguous() and not w2.is_contiguous()
    m1, m2 = smf._expert_major(w1), smf._expert_major(w2)
    assert m1.data_ptr() == moe.c_fc.weight.data_ptr() and m1.shape == moe.c_fc.weight.shape and m1.is_contiguous()
    assert m2.data_ptr() == moe.c_proj.weight.data_ptr() and m2.shape == moe.c_proj.weight.shape
    # A [2I, H, E] tensor that is not such a view is copied (same values).
    w1c = w1.contiguous()
    m1c = smf._expert_major(w1c)
    assert m1c.is_contiguous() and m1c.data_ptr() != w1c.data_ptr() and torch.equal(m1c, moe.c_fc.weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("swiglu", True), ("gelu", True), ("reglu", False)])
def test_topk_layer_equals_moe(act, bias, dtype):
    T, H, I, E, K = 29, 32, 16, 6, 2
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    g_out = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)

    moe_a = make_moe(E, H, I, K, act, bias, dtype)
    xa = x0.clone().requires_grad_(True)
    out_a, _ = moe_a(xa)
    (out_a * g_out).sum().backward()

    moe_b = make_moe(E, H, I, K, act, bias, dtype)
    xb = x0.clone().requires_grad_(True)
    o, logits, freq = sm.moe_TC_softmax_topk_layer(xb, *orig_weights(moe_b), K, 0, act)
    assert o.dtype == dtype and o.shape == (T, H)
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    assert freq.dtype == torch.int32 and freq.shape == (E,)
    (o * g_out).sum().backward()

    assert torch.equal(o, out_a)
    ga, gb = grads(moe_a, xa), grads(moe_b, xb)
    for n in ga:
        if ga[n] is None:
            assert gb[n] is None
            continue
        assert gb[n] is not None and gb[n].dtype == ga[n].dtype, n
        assert torch.equal(gb[n], ga[n]), f"grad {n}: rel err {rel_err(gb[n], ga[n]):.3g}"

    ref_logits = x0.float() @ moe_b.router.weight.detach().float().t()
    assert rel_err(logits, ref_logits) < 1e-6
    # Counts of the top-K choice (ties to the lower id: a stable descending sort of the logits).
    ids = torch.sort(logits.detach(), dim=-1, descending=True, stable=True)[1][:, :K]
    assert torch.equal(freq, torch.bincount(ids.flatten(), minlength=E).to(torch.int32))
    assert int(freq.sum()) == T * K


def ref_softmax_topk(x, router, k, softmax_over_topk, norm):
    """float64 reference of the original's routing variants; ties to the lower expert id."""
    logits = x @ router.t()
    if softmax_over_topk:
        vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        vals, ids = torch.softmax(vals[:, :k], -1), ids[:, :k]
    else:
        vals, ids = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True)
        vals, ids = vals[:, :k], ids[:, :k]
        if norm:
            vals = vals / vals.sum(-1, keepdim=True)
    T = x.shape[0]
    return logits, torch.arange(T).repeat_interleave(k), ids.flatten(), vals.flatten()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax_over_topk,norm", [(False, False), (False, True), (True, True), (True, False)])
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("relu_sq", False)])
def test_routing_variants_vs_reference(softmax_over_topk, norm, act, bias, dtype):
    T, H, I, E, K = 31, 24, 12, 8, 3
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    g_out = torch.randn(T, H, generator=g, dtype=torch.float64)
    g_log = torch.randn(T, E, generator=g, dtype=torch.float64)
    moe = make_moe(E, H, I, K, act, bias, dtype, seed=3)

    x = x0.clone().requires_grad_(True)
    o, logits, freq = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, act,
                                                    is_softmax_over_topk=softmax_over_topk, norm_topk_probs=norm)
    assert o.dtype == dtype and logits.dtype == torch.float32 and freq.dtype == torch.int32
    ((o.double() * g_out).sum() + (logits.double() * g_log).sum()).backward()

    p = {n: (t.detach().double().requires_grad_(True) if t is not None else None)
         for n, t in zip(("router", "w1", "b1", "w2", "b2"),
                         (moe.router.weight, moe.c_fc.weight, moe.c_fc.bias, moe.c_proj.weight, moe.c_proj.bias))}
    xr = x0.double().requires_grad_(True)
    lr, tok, exp, score = ref_softmax_topk(xr, p["router"], K, softmax_over_topk, norm)
    out_r = experts(xr, tok, exp, score, p["w1"], p["b1"], p["w2"], p["b2"], act)
    ((out_r * g_out).sum() + (lr * g_log).sum()).backward()

    assert rel_err(o, out_r) < tol(dtype), f"output rel err {rel_err(o, out_r):.3g}"
    assert rel_err(logits, lr) < 1e-6
    assert torch.equal(freq, torch.bincount(exp, minlength=E).to(torch.int32))
    ours = grads(moe, x)
    for n, ref in (("x", xr.grad), ("router", p["router"].grad), ("w1", p["w1"].grad), ("w2", p["w2"].grad),
                   ("b1", p["b1"].grad if bias else None), ("b2", p["b2"].grad if bias else None)):
        if ref is None:
            continue
        assert ours[n] is not None, f"no gradient for {n}"
        e = rel_err(ours[n], ref)
        assert e < tol(dtype) * (3 if n == "router" else 1), f"grad {n} rel err {e:.3g}"


def test_ties_go_to_the_lower_expert():
    # Identical router rows: every expert has the same logit; top-K must pick experts 0..K-1 for every token.
    T, H, I, E, K = 9, 8, 4, 5, 2
    moe = make_moe(E, H, I, K, "swiglu", False, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # small integers: every logit is exact, so all E are equal
        moe.router.weight.copy_(torch.randint(-3, 4, (1, H), generator=g).float().expand(E, H))
    x = torch.randint(-3, 4, (T, H), generator=g).float()
    for over_topk in (True, False):
        _, _, freq = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "swiglu",
                                                   is_softmax_over_topk=over_topk)
        assert freq.tolist() == [T] * K + [0] * (E - K), over_topk


def to_concat(w):
    """Interleaved [E, 2I, ...] (gate_0, up_0, gate_1, ...) -> concatenated (gate_0..gate_{I-1}, up_0..)."""
    E, ZW = w.shape[0], w.shape[1]
    return w.reshape(E, ZW // 2, 2, *w.shape[2:]).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softmax_over_topk", [True, False])
def test_concat_layout(softmax_over_topk, dtype):
    T, H, I, E, K = 21, 16, 8, 4, 2
    moe = make_moe(E, H, I, K, "swiglu", True, dtype, seed=4)
    x0 = torch.randn(T, H, dtype=torch.float64).to(dtype)
    g_out = torch.randn(T, H, dtype=torch.float64).to(dtype)

    x = x0.clone().requires_grad_(True)
    o, logits, freq = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "swiglu",
                                                    is_softmax_over_topk=softmax_over_topk)
    (o * g_out).sum().backward()

    w1c = to_concat(moe.c_fc.weight.detach()).requires_grad_(True)     # [E, 2I, H], concatenated rows
    b1c = to_concat(moe.c_fc.bias.detach()).requires_grad_(True)
    assert not torch.equal(w1c, moe.c_fc.weight)
    router = moe.router.weight.detach().clone().requires_grad_(True)
    w2 = moe.c_proj.weight.detach().clone().requires_grad_(True)
    b2 = moe.c_proj.bias.detach().clone().requires_grad_(True)
    xc = x0.clone().requires_grad_(True)
    oc, logits_c, freq_c = smf.moe_TC_softmax_topk_layer(xc, router, w1c.permute(1, 2, 0), b1c, w2.permute(1, 2, 0),
                                                         b2, K, 0, "swiglu", is_softmax_over_topk=softmax_over_topk,
                                                         concat_layout=True)
    (oc * g_out).sum().backward()
    assert torch.equal(oc, o) and torch.equal(logits_c, logits) and torch.equal(freq_c, freq)
    assert torch.equal(xc.grad, x.grad) and torch.equal(router.grad, moe.router.weight.grad)
    assert torch.equal(w1c.grad, to_concat(moe.c_fc.weight.grad))
    assert torch.equal(b1c.grad, to_concat(moe.c_fc.bias.grad))
    assert torch.equal(w2.grad, moe.c_proj.weight.grad)

    # General-routing entry: same conversion.
    tok = torch.arange(T).repeat_interleave(2)
    exp = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1).flatten()
    s = torch.rand(2 * T)
    oi, _ = smf.moe_general_routing_inputs(x0, s, tok, exp, *orig_weights(moe)[1:], E, 0, "swiglu")
    og, _ = smf.moe_general_routing_inputs(x0, s, tok, exp, w1c.permute(1, 2, 0), b1c, w2.permute(1, 2, 0), b2, E, 0,
                                           "swiglu", concat_layout=True)
    assert torch.equal(oi, og)


def triples(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    toks, exps = [], []
    for t in range(T):
        n = int(torch.randint(0, 4, (1,), generator=g))  # 0..3 experts; some tokens get none
        for e in sorted(torch.randperm(E, generator=g)[:n].tolist()):
            toks.append(t)
            exps.append(e)
    s = torch.rand(len(toks), generator=g, dtype=torch.float64) + 0.1
    return torch.tensor(toks, dtype=torch.int64), torch.tensor(exps, dtype=torch.int64), s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("gelu", False)])
def test_general_routing_inputs(act, bias, index_dtype, dtype):
    T, H, I, E = 23, 16, 12, 5
    tok, exp, s0 = triples(T, E, 11)
    moe = make_moe(E, H, I, 2, act, bias, dtype, seed=2)
    x0 = torch.randn(T, H, dtype=torch.float64).to(dtype)
    g_out = torch.randn(T, H, dtype=torch.float64).to(dtype)

    x = x0.clone().requires_grad_(True)
    s = s0.to(dtype).requires_grad_(True)   # not fp32: cast inside, gradient in s's dtype
    # E = 999: ignored, the expert count is w2's (as in the original).
    o, freq = smf.moe_general_routing_inputs(x, s, tok.to(index_dtype), exp.to(index_dtype),
                                             *orig_weights(moe)[1:], 999, 0, act)
    assert o.dtype == dtype and freq.dtype == torch.int32
    assert torch.equal(freq, torch.bincount(exp, minlength=E).to(torch.int32))
    (o * g_out).sum().backward()
    assert s.grad is not None and s.grad.dtype == dtype
    assert moe.router.weight.grad is None

    ref = make_moe(E, H, I, 2, act, bias, dtype, seed=2)
    xr = x0.clone().requires_grad_(True)
    sr = s0.to(dtype).float().detach().requires_grad_(True)
    out_r = sm.moe_general_routing(xr, tok.int(), exp.int(), sr, ref.c_fc.weight, ref.c_fc.bias, ref.c_proj.weight,
                                   ref.c_proj.bias, act)
    (out_r * g_out).sum().backward()
    assert torch.equal(o, out_r)
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(s.grad, sr.grad.to(dtype))
    assert torch.equal(moe.c_fc.weight.grad, ref.c_fc.weight.grad)
    assert torch.equal(moe.c_proj.weight.grad, ref.c_proj.weight.grad)
    if bias:
        assert torch.equal(moe.c_fc.bias.grad, ref.c_fc.bias.grad)
        assert torch.equal(moe.c_proj.bias.grad, ref.c_proj.bias.grad)

    # And against the float64 reference.
    out64 = experts(x0.double(), tok, exp, s0.to(dtype).double(), *[None if t is None else t.detach().double() for t in
                    (ref.c_fc.weight, ref.c_fc.bias, ref.c_proj.weight, ref.c_proj.bias)], act)
    assert rel_err(o, out64) < tol(dtype)


@pytest.mark.parametrize("softmax_over_topk", [True, False])
def test_inference_mode(softmax_over_topk):
    T, H, I, E, K = 17, 16, 8, 6, 2
    moe = make_moe(E, H, I, K, "swiglu", True, torch.bfloat16, seed=9)
    x = torch.randn(T, H, dtype=torch.bfloat16).requires_grad_(True)
    o, logits, freq = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "swiglu",
                                                    is_softmax_over_topk=softmax_over_topk)
    assert o.requires_grad and logits.requires_grad
    oi, li, fi = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "swiglu",
                                               is_inference_mode_enabled=True, is_softmax_over_topk=softmax_over_topk)
    assert not oi.requires_grad and oi.grad_fn is None and not li.requires_grad and li.grad_fn is None
    assert torch.equal(oi, o) and torch.equal(li, logits) and torch.equal(fi, freq)

    tok, exp, s = triples(T, E, 5)
    s = s.float().requires_grad_(True)
    og, fg = smf.moe_general_routing_inputs(x, s, tok, exp, *orig_weights(moe)[1:], E, 0, "swiglu")
    ogi, fgi = smf.moe_general_routing_inputs(x, s, tok, exp, *orig_weights(moe)[1:], E, 0, "swiglu",
                                              is_inference_mode_enabled=True)
    assert og.requires_grad and not ogi.requires_grad and ogi.grad_fn is None
    assert torch.equal(ogi, og) and torch.equal(fgi, fg)


def test_activation_enum_and_string():
    T, H, I, E, K = 7, 8, 4, 3, 2
    moe = make_moe(E, H, I, K, "geglu", False, torch.float32)
    x = torch.randn(T, H)
    a = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, sm.ActivationType.GEGLU)[0]
    b = smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "GEGLU")[0]
    c, _ = moe(x)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_bad_inputs():
    T, H, I, E, K = 7, 8, 4, 3, 2
    moe = make_moe(E, H, I, K, "swiglu", True, torch.float32)
    x = torch.randn(T, H)
    r, w1, b1, w2, b2 = orig_weights(moe)
    f = smf.moe_TC_softmax_topk_layer

    def raises(exc, arg, *args, **kw):
        with pytest.raises(exc, match=f"'{arg}'"):
            f(*args, **kw)

    raises(ValueError, "w1", x, r, moe.c_fc.weight, b1, w2, b2, K, 0)                  # [E, 2I, H] not [2I, H, E]
    raises(ValueError, "w1", x, r, w1[:I], b1, w2, b2, K, 0)                           # I rows for a GLU
    raises(ValueError, "w1", x, r, w1[0], b1, w2, b2, K, 0)                            # rank 2
    raises(ValueError, "w2", x, r, w1, b1, moe.c_proj.weight, b2, K, 0)                # [E, H, I]
    raises(ValueError, "router_w", x, r[:2], w1, b1, w2, b2, K, 0)                     # mismatched E
    raises(ValueError, "router_w", x, r[:, :4], w1, b1, w2, b2, K, 0)
    raises(ValueError, "x", x[None], r, w1, b1, w2, b2, K, 0)
    raises(ValueError, "b1", x, r, w1, b1, w2, None, K, 0)                             # b1 alone
    raises(ValueError, "b2", x, r, w1, None, w2, b2, K, 0)                             # b2 alone
    raises(ValueError, "b1", x, r, w1, b1[:, :3], w2, b2, K, 0)
    raises(ValueError, "b2", x, r, w1, b1, w2, b2[:2], K, 0)
    raises(ValueError, "activation_type", x, r, w1, b1, w2, b2, K, 0, "tanh")
    raises(ValueError, "K", x, r, w1, b1, w2, b2, E + 1, 0)
    raises(TypeError, "K", x, r, w1, b1, w2, b2, 1.5, 0)
    raises(TypeError, "x", x.numpy(), r, w1, b1, w2, b2, K, 0)

    g = smf.moe_general_routing_inputs
    tok, exp, s = triples(T, E, 1)
    with pytest.raises(ValueError, match="'expert_indices'"):
        g(x, s.float(), tok, exp[1:], w1, b1, w2, b2, E, 0, "swiglu")
    with pytest.raises(TypeError, match="'token_indices'"):
        g(x, s.float(), tok.float(), exp, w1, b1, w2, b2, E, 0, "swiglu")
    with pytest.raises(ValueError, match="'router_scores'"):
        g(x, s.float()[:, None], tok, exp, w1, b1, w2, b2, E, 0, "swiglu")
    with pytest.raises(ValueError, match="'w2'"):
        g(x, s.float(), tok, exp, w1, b1, w2[:, :, :2], b2, E, 0, "swiglu")
    with pytest.raises(ValueError, match="'activation_type'"):
        g(x, s.float(), tok, exp, w1, b1, w2, b2, E, 0, "nope")


@pytest.mark.parametrize("softmax_over_topk", [True, False])
def test_torch_compile_fullgraph(softmax_over_topk):
    T, H, I, E, K = 10, 16, 8, 4, 2
    moe = make_moe(E, H, I, K, "swiglu", True, torch.float32, seed=6)
    x0 = torch.randn(T, H)

    def run(x):
        return smf.moe_TC_softmax_topk_layer(x, *orig_weights(moe), K, 0, "swiglu",
                                             is_softmax_over_topk=softmax_over_topk, norm_topk_probs=True)

    results = []
    for fn in (run, torch.compile(run, fullgraph=True)):
        moe.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        o, logits, freq = fn(x)
        (o.square().sum() + logits.sum()).backward()
        results.append((o.detach(), logits.detach(), freq, x.grad, moe.router.weight.grad.clone()))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-5


def test_w1_layout_conversions_round_trip():
    """Interleaved <-> concatenated <-> separate gate/up, both ways, and a state dict loaded from a concat checkpoint
    computes what the concat-layout functional call computes."""
    torch.manual_seed(2)
    E, I, H = 3, 5, 8
    w = torch.randn(E, 2 * I, H)
    b = torch.randn(E, 2 * I)
    wc = sm.w1_to_concat(w)
    assert torch.equal(wc[:, :I], w[:, 0::2]) and torch.equal(wc[:, I:], w[:, 1::2])
    assert torch.equal(sm.w1_to_interleaved(wc), w)
    assert torch.equal(sm.w1_to_interleaved(sm.w1_to_concat(b)), b)
    gate, up = sm.w1_to_gate_up(w)
    assert torch.equal(sm.w1_from_gate_up(gate, up), w)
    moe = sm.MoE(E, 2, H, I, "swiglu", add_bias=True)
    sd = moe.state_dict()
    concat_sd = sm.convert_moe_state_dict(sd, "concat")
    assert torch.equal(concat_sd["c_fc.weight"], sm.w1_to_concat(sd["c_fc.weight"]))
    back = sm.convert_moe_state_dict(concat_sd, "interleaved")
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    relu_sd = sm.MoE(E, 2, H, I, "relu").state_dict()
    assert torch.equal(sm.convert_moe_state_dict(relu_sd, "concat", activation="relu")["c_fc.weight"],
                       relu_sd["c_fc.weight"])
    with pytest.raises(ValueError, match="'to'"):
        sm.convert_moe_state_dict(sd, "bogus")
    separate_sd = sm.convert_moe_state_dict(sd, "separate")  # and to separate gate / up entries (test_w1_layout.py)
    assert torch.equal(separate_sd["c_fc.up_weight"], sd["c_fc.weight"][:, 1::2])

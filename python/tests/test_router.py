"""The router variants of sonicmoe_cpp.MoE (scoring_func, softmax_over_topk, norm_topk_probs, n_group / topk_group,
routed_scaling_factor, e_score_correction_bias) against a plain float64 PyTorch router written the Hugging Face way
(tests/reference.py runs the experts): output, aux loss, every gradient, the chosen experts; the buffer; errors."""
import pytest
import torch

import sonicmoe_cpp as sm
from reference import aux_loss, experts

T, H, I, E = 37, 32, 24, 16


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def router_reference(logits, k, scoring_func="softmax", softmax_over_topk=True, norm_topk_probs=False, n_group=1,
                     topk_group=1, routed_scaling_factor=1.0, bias=None):
    """(ids [T, K], weights [T, K]) of the router formulas (DeepSeek-V3 / Qwen3 / Mixtral as in Hugging Face)."""
    Tn, En = logits.shape
    if scoring_func == "softmax" and softmax_over_topk:
        vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        w = torch.softmax(vals[:, :k], dim=-1)
        return ids[:, :k], w * routed_scaling_factor
    s = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = s.detach() + (bias.to(s.dtype) if bias is not None else 0)
    if n_group > 1:
        gscore = choice.view(Tn, n_group, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros(Tn, n_group, dtype=torch.bool)
        keep.scatter_(1, torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :topk_group], True)
        choice = choice.masked_fill(~keep.repeat_interleave(En // n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(1, ids)
    if norm_topk_probs:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if scoring_func == "sigmoid" else 0.0))
    return ids, w * routed_scaling_factor


ROUTERS = {
    "qwen3": (4, dict(softmax_over_topk=False, norm_topk_probs=True)),
    "softmax_full_scaled": (3, dict(softmax_over_topk=False, routed_scaling_factor=2.5)),
    "mixtral_scaled": (2, dict(is_softmax_over_topk=True, norm_topk_probs=True, routed_scaling_factor=0.5)),
    "deepseek_v3": (4, dict(scoring_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, e_score_correction_bias=True)),
    "sigmoid_k1": (1, dict(scoring_func="sigmoid")),
    "softmax_groups_bias": (5, dict(softmax_over_topk=False, norm_topk_probs=True, n_group=8, topk_group=3,
                                    e_score_correction_bias=True)),
}


def reference_kwargs(kw):
    """The module's keywords as router_reference's (aliases resolved)."""
    r = dict(kw)
    r.pop("e_score_correction_bias", None)
    if "is_softmax_over_topk" in r:
        r["softmax_over_topk"] = r.pop("is_softmax_over_topk")
    if "norm_topk_prob" in r:
        r["norm_topk_probs"] = r.pop("norm_topk_prob")
    return r


def make_moe(K, kw, seed=0):
    torch.manual_seed(seed)
    moe = sm.MoE(E, K, H, I, activation_function="swiglu", std=0.3, **kw)
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 0.5)
        if kw.get("e_score_correction_bias"):
            moe.router.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    return moe


def run_vs_reference(name, moe, x, K, kw, capacity=None):
    """moe on x, forward and backward of (out * g_out).sum() + 0.7 aux, against the float64 reference with the same
    parameters: output, aux loss and the gradients of x, the router and the weights. capacity: C of the capacity
    rule (the reference keeps each expert's first C pairs), None for none. Returns the reference's keep [T, K]."""
    g_out = torch.randn(T, H)
    out, aux = moe(x)
    (out * g_out).sum().add(0.7 * aux).backward()

    p = {n: t.detach().double().requires_grad_(True) for n, t in
         (("x", x), ("router", moe.router.weight), ("w1", moe.c_fc.weight), ("w2", moe.c_proj.weight))}
    bias = getattr(moe.router, "e_score_correction_bias", None)
    logits = p["x"] @ p["router"].t()
    ids, w = router_reference(logits, K, bias=None if bias is None else bias.double(), **reference_kwargs(kw))
    keep = torch.ones_like(ids, dtype=torch.bool) if capacity is None else capacity_keep(ids, E, capacity)
    tok = torch.arange(T).repeat_interleave(K)
    m = keep.flatten()
    ref_out = experts(p["x"], tok[m], ids.flatten()[m], w.flatten()[m], p["w1"], None, p["w2"], None, "swiglu")
    ref_aux = aux_loss(logits, torch.bincount(ids.flatten(), minlength=E))
    (ref_out * g_out.double()).sum().add(0.7 * ref_aux).backward()

    assert rel_err(out, ref_out) < 1e-5, name
    assert abs(aux.item() - ref_aux.item()) < 1e-5 * max(1.0, abs(ref_aux.item())), name
    for n, ours in (("x", x.grad), ("router", moe.router.weight.grad), ("w1", moe.c_fc.weight.grad),
                    ("w2", moe.c_proj.weight.grad)):
        assert rel_err(ours, p[n].grad) < 1e-4, f"{name}: grad {n}"
    return keep


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_matches_pytorch_formula(name):
    K, kw = ROUTERS[name]
    moe = make_moe(K, kw)
    x = torch.randn(T, H, requires_grad=True)
    run_vs_reference(name, moe, x, K, kw)
    bias = getattr(moe.router, "e_score_correction_bias", None)
    if bias is not None:
        assert bias.grad is None and not bias.requires_grad


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3", "softmax_groups_bias"])
def test_router_picks_the_reference_experts(name):
    """The op's top-K expert ids equal the reference router's, ties included (logits on a coarse grid)."""
    K, kw = ROUTERS[name]
    moe = make_moe(K, kw, seed=3)
    x = torch.randn(T, H)
    with torch.no_grad():
        moe.router.weight.copy_(torch.round(moe.router.weight * 4) / 4)
        x = torch.round(x * 2) / 2
    args = (x, moe.router.weight, moe.c_fc.weight, None, moe.c_proj.weight, None, "swiglu", K, "topk", 128, None,
            None, None, *moe._router_args())
    outs = torch.ops.sonicmoe.forward(*args)
    logits = outs[3]
    topk_expert = outs[4]
    bias = getattr(moe.router, "e_score_correction_bias", None)
    ids, w = router_reference(logits.double(), K, bias=None if bias is None else bias.double(), **reference_kwargs(kw))
    assert torch.equal(topk_expert.long(), ids), name
    assert rel_err(outs[5], w) < 1e-6, name


def test_bias_buffer_and_state_dict():
    moe = sm.MoE(E, 2, H, I, scoring_func="sigmoid", e_score_correction_bias=True)
    assert "router.e_score_correction_bias" in moe.state_dict()
    assert all("e_score_correction_bias" not in n for n, _ in moe.named_parameters())
    assert moe.router.e_score_correction_bias.dtype == torch.float32
    plain = sm.MoE(E, 2, H, I)
    assert "router.e_score_correction_bias" not in plain.state_dict()
    assert "scoring_func=sigmoid" in repr(moe)
    # The bias steers the choice: a large bias on one expert makes every token pick it.
    with torch.no_grad():
        moe.router.e_score_correction_bias[5] = 100.0
    x = torch.randn(8, H)
    outs = torch.ops.sonicmoe.forward(x, moe.router.weight, moe.c_fc.weight, None, moe.c_proj.weight, None, "swiglu",
                                      2, "topk", 128, None, None, None, *moe._router_args())
    assert (outs[4][:, 0] == 5).all()
    assert outs[5].max() <= 1.0  # weights from the sigmoid scores, not from score + bias


@pytest.mark.parametrize("kw,needle", [
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(scoring_func="sigmoid", n_group=2.5), "n_group"),
    (dict(routing="round_up", scoring_func="sigmoid"), "routing='topk'"),
])
def test_constructor_errors(kw, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        sm.MoE(E, 2, H, I, **kw)


@pytest.mark.parametrize("kw,needle", [
    (dict(scoring_func="sigmoid", n_group=3), "router.n_group = 3"),
    (dict(scoring_func="sigmoid", n_group=4, topk_group=5), "router.topk_group = 5"),
    (dict(n_group=4, topk_group=2), "softmax_over_topk"),
    (dict(scoring_func="sigmoid", routed_scaling_factor=-1.0), "routed_scaling_factor"),
])
def test_library_errors_name_the_router_field(kw, needle):
    # MoE checks the router's rules at construction (KernelBackendMoE.torch would run them otherwise), naming the
    # keyword; the library names the RouterSpec field when the op gets them (moe_topk, the raw op).
    with pytest.raises(ValueError, match=needle.split(".")[-1].split(" ")[0]):
        sm.MoE(E, 2, H, I, **kw)
    moe = sm.MoE(E, 2, H, I)
    with pytest.raises(Exception, match=needle):
        sm.moe_topk(torch.randn(4, H), moe.router.weight, moe.c_fc.weight, None, moe.c_proj.weight, None, 2, **kw)


def test_moe_topk_router_keywords():
    K, kw = ROUTERS["qwen3"]
    moe = make_moe(K, kw, seed=5)
    x = torch.randn(T, H)
    out_mod, aux_mod = moe(x)
    out_fn, aux_fn = sm.moe_topk(x, moe.router.weight, moe.c_fc.weight, None, moe.c_proj.weight, None, K,
                                 softmax_over_topk=False, norm_topk_probs=True)
    assert torch.equal(out_mod, out_fn) and torch.equal(aux_mod, aux_fn)


def cuda_vs_cpu(name, moe, kw):
    """moe in bf16 (its correction bias kept in f32) on the CPU reference backend and on the CUDA layer, the same
    inputs: out, aux and the gradients of x, the router and the weights within 3e-2. Returns num_dropped of the
    (cpu, cuda) runs."""
    moe = moe.to(torch.bfloat16)
    if kw.get("e_score_correction_bias"):
        moe.router.e_score_correction_bias.data = moe.router.e_score_correction_bias.float()
    x = torch.randn(T, H).to(torch.bfloat16)
    g_out = torch.randn(T, H).to(torch.bfloat16)
    results, dropped = [], []
    for dev in ("cpu", "cuda"):
        m = moe.to(dev)
        xi = x.to(dev).detach().clone().requires_grad_(True)  # a leaf on each device (x itself stays grad-free)
        m.zero_grad()
        out, aux = m(xi)
        (out.float() * g_out.to(dev).float()).sum().add(0.7 * aux).backward()
        results.append([t.detach().float().cpu() for t in (out, aux, xi.grad, m.router.weight.grad, m.c_fc.weight.grad,
                                                           m.c_proj.weight.grad)])
        dropped.append(None if m.num_dropped is None else m.num_dropped.detach().cpu())
        if m.num_dropped is not None:  # is_inference_mode reports the same count (the inference op's buffer)
            m.num_dropped = None
            m(x.to(dev), is_inference_mode=True)
            assert torch.equal(m.num_dropped.cpu(), dropped[-1]), f"{name}: num_dropped under is_inference_mode"
    for what, a, b in zip(("out", "aux", "dx", "drouter", "dw1", "dw2"), *results):
        assert rel_err(b, a) < 3e-2, f"{name}: {what}"
    return dropped


@pytest.mark.skipif(not (torch.cuda.is_available() and sm.built_with_cuda()), reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_cuda_matches_cpu(name):
    """The fused CUDA router (bf16 layer) against the CPU reference backend on the same bf16 parameters."""
    K, kw = ROUTERS[name]
    cuda_vs_cpu(name, make_moe(K, kw), kw)


def test_router_under_torch_compile():
    """torch.compile(fullgraph=True) of a DeepSeek-V3-routed MoE: the same output, aux loss and gradients."""
    K, kw = ROUTERS["deepseek_v3"]
    moe = make_moe(K, kw, seed=7)
    x = torch.randn(T, H)
    grads = []
    for fn in (moe, torch.compile(moe, fullgraph=True)):
        xi = x.clone().requires_grad_(True)
        moe.zero_grad()
        out, aux = fn(xi)
        (out.sum() + aux).backward()
        grads.append((out.detach(), aux.detach(), xi.grad, moe.router.weight.grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def capacity_keep(ids, E, C):
    """keep [T, K] of the capacity rule: per expert, its first C pairs in pair order (t*K + k)."""
    flat = ids.flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    for e in range(E):
        keep[(flat == e).nonzero().flatten()[:C]] = True
    return keep.view(ids.shape)


@pytest.mark.parametrize("name,factor", [("qwen3", 0.5), ("deepseek_v3", 1.0), ("sigmoid_k1", 0.75),
                                         ("mixtral_scaled", 100.0)])
def test_capacity_matches_pytorch_formula(name, factor):
    """capacity_factor: the dropped pairs add nothing and get no gradient; the kept pairs keep the router's weights;
    the aux loss counts the router's choices; num_dropped reports the count."""
    import math
    K, kw = ROUTERS[name]
    moe = make_moe(K, dict(kw, capacity_factor=factor), seed=11)
    with torch.no_grad():
        moe.router.weight[:, 0] += torch.linspace(1.0, -1.0, E)  # skew the load: drops
    x = torch.randn(T, H, requires_grad=True)
    with torch.no_grad():
        x[:, 0] += 1.5
    keep = run_vs_reference(name, moe, x, K, kw, capacity=min(T, math.ceil(T * K / E * factor)))
    dropped = int((~keep).sum())
    assert moe.num_dropped is not None and moe.num_dropped.dtype == torch.int32
    assert int(moe.num_dropped.item()) == dropped, name
    if factor < 10:
        assert dropped > 0, "the case is meant to drop"
    # is_inference_mode reports the same count (the inference op writes it into the module's buffer)
    moe.num_dropped = None
    out_inf, aux_inf = moe(x.detach(), is_inference_mode=True)
    assert aux_inf is None and int(moe.num_dropped.item()) == dropped, name


def test_capacity_state_and_errors():
    """No capacity: num_dropped None and the op's capacity state empty; a bad factor is an error naming it; token
    rounding refuses a capacity."""
    moe = sm.MoE(E, 2, H, I)
    moe(torch.randn(5, H))
    assert moe.num_dropped is None
    assert "capacity_factor" not in repr(moe)
    capped = sm.MoE(E, 2, H, I, capacity_factor=1.0)
    assert "capacity_factor=1.0" in repr(capped)
    capped(torch.randn(5, H))
    assert capped.num_dropped.shape == (1,)
    moe(torch.randn(5, H), is_inference_mode=True)
    assert moe.num_dropped is None
    capped(torch.randn(5, H), is_inference_mode=True)
    assert capped.num_dropped.shape == (1,) and capped.num_dropped.dtype == torch.int32
    with pytest.raises(ValueError, match="dropped_out"):  # the raw op checks the buffer it writes
        torch.ops.sonicmoe.inference(torch.randn(5, H), capped.router.weight.detach(), capped.c_fc.weight.detach(),
                                     None, capped.c_proj.weight.detach(), None, "swiglu", 2, "topk", 128, None, None,
                                     None, capacity_factor=1.0, dropped_out=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="capacity_factor"):
        sm.MoE(E, 2, H, I, capacity_factor=-1.0)
    with pytest.raises(ValueError, match="routing='topk'"):
        sm.MoE(E, 2, H, I, routing="round_up", capacity_factor=1.0)
    # moe_topk takes the keyword too.
    torch.manual_seed(0)
    x = torch.randn(T, H)
    out_mod, aux_mod = capped(x)
    dropped = []
    out_fn, aux_fn = sm.moe_topk(x, capped.router.weight, capped.c_fc.weight, None, capped.c_proj.weight, None, 2,
                                 capacity_factor=1.0, dropped_out=dropped)
    assert torch.equal(out_mod, out_fn) and torch.equal(aux_mod, aux_fn)
    assert len(dropped) == 1 and torch.equal(dropped[0], capped.num_dropped)
    with pytest.raises(TypeError, match="dropped_out"):
        sm.moe_topk(x, capped.router.weight, capped.c_fc.weight, None, capped.c_proj.weight, None, 2,
                    capacity_factor=1.0, dropped_out=True)


@pytest.mark.skipif(not (torch.cuda.is_available() and sm.built_with_cuda()), reason="needs a GPU and a CUDA build")
@pytest.mark.parametrize("name,factor", [("qwen3", 0.5), ("deepseek_v3", 1.0)])
def test_capacity_cuda_matches_cpu(name, factor):
    """Under a capacity the CUDA layer (bf16) against the CPU reference backend: outputs, gradients, the count."""
    K, kw = ROUTERS[name]
    dropped = cuda_vs_cpu(name, make_moe(K, dict(kw, capacity_factor=factor), seed=13), kw)
    assert torch.equal(dropped[0], dropped[1]), "num_dropped"


def test_capacity_under_torch_compile():
    """torch.compile(fullgraph=True) of a capacity-limited MoE: the same output, aux loss, dx and dropped count."""
    torch.manual_seed(0)
    moe = sm.MoE(8, 2, 32, 16, capacity_factor=0.5)
    x = torch.randn(40, 32, requires_grad=True)
    out, aux = moe(x)
    (out.sum() + aux).backward()
    dx, dropped = x.grad.clone(), moe.num_dropped.clone()
    x.grad = None
    out_c, aux_c = torch.compile(moe, fullgraph=True)(x)
    (out_c.sum() + aux_c).backward()
    assert torch.equal(out, out_c) and torch.equal(aux, aux_c) and torch.equal(dx, x.grad)
    assert torch.equal(moe.num_dropped, dropped) and int(dropped.item()) > 0

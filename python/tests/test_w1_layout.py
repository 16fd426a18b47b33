"""MoE(..., concat_layout=True): c_fc's rows (and c_fc.bias's) stored concatenated [gate; up] and read in place by the
ops (w1_layout="concat", MoEConfig::w1_layout), against the interleaved module loaded with the converted state dict:
output, aux loss and every gradient equal (bitwise: both run the same arithmetic), the gradients of c_fc in the
concatenated layout; non-GLU activations ignore the flag; refusals. MoE(..., w1_layout="separate"): gate and up
parameters read in place, the same equalities; the binding's fallback copy for a pair the layer cannot read in place
(up below gate); state-dict conversion between the three layouts. CUDA cases skip without a GPU build and device."""
import pytest
import torch

import sonicmoe_cpp as sm

HAS_CUDA = sm.built_with_cuda() and torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA build and GPU"))]

_W1_ARG = sm._ops._ROUTER_ARG_NAMES.index("w1_layout")  # the ops' w1_layout argument, after the router's


def modules(E, K, H, I, act, bias, dtype, device, routing="topk", seed=0):
    """(interleaved MoE, concat_layout MoE) holding the same layer: the second's state dict is the first's converted
    to the concatenated layout."""
    torch.manual_seed(seed)
    ref = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.3, routing=routing, tile=4)
    with torch.no_grad():
        ref.router.weight.normal_(0.0, 1.0)
        if bias:
            ref.c_fc.bias.normal_(0.0, 0.1)
            ref.c_proj.bias.normal_(0.0, 0.1)
    cat = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.3, routing=routing, tile=4, concat_layout=True)
    cat.load_state_dict(sm.convert_moe_state_dict(ref.state_dict(), "concat", activation=act))
    return ref.to(device=device, dtype=dtype), cat.to(device=device, dtype=dtype)


def run(m, x0, g_out):
    x = x0.clone().requires_grad_(True)
    o, aux = m(x)
    ((o * g_out).sum() + 0.3 * aux).backward()
    return o.detach(), aux.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("swiglu", False), ("geglu", True), ("reglu", False),
                                      ("geglu_tanh", True), ("gelu", True), ("relu_sq", False)])
def test_concat_module_equals_interleaved(act, bias, dtype, device):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernels are bf16 (fp32 inputs are cast): covered by the bf16 case")
    # CUDA: widths multiples of 8 (the kernels' 16-byte rows); CPU: awkward sizes too.
    T, H, I, E, K = (300, 136, 72, 6, 2) if device == "cuda" else (37, 24, 20, 6, 2)
    ref, cat = modules(E, K, H, I, act, bias, dtype, device, seed=3)
    glu = sm.is_glu(act)
    if glu:
        assert not torch.equal(cat.c_fc.weight, ref.c_fc.weight)  # the comparison is not vacuous
    x0 = torch.randn(T, H, dtype=torch.float64).to(device=device, dtype=dtype)
    g_out = torch.randn(T, H, dtype=torch.float64).to(device=device, dtype=dtype)
    o, aux, dx, g = run(ref, x0, g_out)
    oc, auxc, dxc, gc = run(cat, x0, g_out)
    assert torch.equal(oc, o) and torch.equal(auxc, aux) and torch.equal(dxc, dx)
    conv = sm.w1_to_concat if glu else (lambda t: t)
    assert torch.equal(gc["c_fc.weight"], conv(g["c_fc.weight"]))
    if bias:
        assert torch.equal(gc["c_fc.bias"], conv(g["c_fc.bias"]))
        assert torch.equal(gc["c_proj.bias"], g["c_proj.bias"])
    assert torch.equal(gc["c_proj.weight"], g["c_proj.weight"])
    assert torch.equal(gc["router.weight"], g["router.weight"])
    # Back to interleaved: the state dict converts both ways.
    back = sm.convert_moe_state_dict(cat.state_dict(), "interleaved", activation=act)
    for k, v in ref.state_dict().items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("device", DEVICES)
def test_concat_module_token_rounding_and_inference(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ref, cat = modules(8, 2, 32, 16, "swiglu", True, dtype, device, routing="round_nearest", seed=5)
    x = torch.randn(2, 40, 32, device=device, dtype=dtype)
    with torch.no_grad():
        o, _ = ref(x, is_inference_mode=True)
        oc, _ = cat(x, is_inference_mode=True)
    assert torch.equal(oc, o)
    o, aux, dx, g = run(ref, x, torch.ones_like(x))
    oc, auxc, dxc, gc = run(cat, x, torch.ones_like(x))
    assert torch.equal(oc, o) and torch.equal(dxc, dx)
    assert torch.equal(gc["c_fc.weight"], sm.w1_to_concat(g["c_fc.weight"]))


def test_concat_layout_refusals_and_repr():
    with pytest.raises(ValueError, match="concat_layout"):
        sm.MoE(4, 2, 128, 128, "swiglu", concat_layout=True, precision="fp8")
    sm.MoE(4, 2, 128, 128, "gelu", concat_layout=True, precision="fp8")  # no gate/up halves: nothing to refuse
    assert "concat_layout=True" in repr(sm.MoE(4, 2, 16, 8, "swiglu", concat_layout=True))
    E, H, I, K, T = 4, 16, 8, 2, 5
    x = torch.randn(T, H)
    args = (x, torch.randn(E, H), torch.randn(E, 2 * I, H), None, torch.randn(E, H, I), None, "swiglu", K, "topk", 128,
            None, None, None)
    with pytest.raises((RuntimeError, ValueError), match="w1_layout"):
        torch.ops.sonicmoe.forward(*args, *sm._ops.DEFAULT_ROUTER[:_W1_ARG], "bogus")
    # The op refuses fp8 with a concatenated W1 (MoEConfig validation), naming the field.
    with pytest.raises((RuntimeError, ValueError), match="w1_layout"):
        torch.ops.sonicmoe.forward(torch.randn(T, 128), torch.randn(E, 128), torch.randn(E, 256, 128), None,
                                   torch.randn(E, 128, 128), None, "swiglu", K, "topk", 128, None, None, None,
                                   *sm._ops.DEFAULT_ROUTER[:_W1_ARG - 1], "fp8", "concat")


def test_opcheck_forward_concat():
    E, H, I, K, T = 4, 16, 8, 2, 9
    x = torch.randn(T, H)
    args = (x, torch.randn(E, H).requires_grad_(), torch.randn(E, 2 * I, H).requires_grad_(), torch.randn(E, 2 * I),
            torch.randn(E, H, I), torch.randn(E, H), "swiglu", K, "topk", 128, None, None, None,
            *sm._ops.DEFAULT_ROUTER[:_W1_ARG], "concat")
    torch.library.opcheck(torch.ops.sonicmoe.forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_expert_parallel_from_concat_moe():
    """ExpertParallelMoE holds interleaved weights: from_moe converts a concat_layout MoE's (one rank, no
    torch.distributed), and computes the same layer."""
    ref, cat = modules(8, 2, 16, 12, "swiglu", True, torch.float32, "cpu", seed=9)
    ep = sm.ExpertParallelMoE.from_moe(cat)
    for k, v in ref.state_dict().items():
        assert torch.equal(ep.state_dict()[k], v), k
    x = torch.randn(10, 16)
    with torch.no_grad():
        assert torch.allclose(ep(x)[0], cat(x)[0], rtol=1e-5, atol=1e-6)


# ---- w1_layout="separate": gate and up as two parameters (torchtitan's w1 / w3) -------------------------------------

def separate_modules(E, K, H, I, act, bias, dtype, device, routing="topk", seed=0):
    """(interleaved MoE, w1_layout="separate" MoE) holding the same layer (the second loads the first's state dict
    converted to the separate keys)."""
    ref, _ = modules(E, K, H, I, act, bias, torch.float32, "cpu", routing=routing, seed=seed)
    sep = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.3, routing=routing, tile=4, w1_layout="separate")
    sep.load_state_dict(sm.convert_moe_state_dict(ref.state_dict(), "separate", activation=act))
    return ref.to(device=device, dtype=dtype), sep.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,bias", [("swiglu", True), ("swiglu", False), ("geglu", True), ("reglu", False),
                                      ("geglu_tanh", True), ("gelu", True), ("relu_sq", False)])
def test_separate_module_equals_interleaved(act, bias, dtype, device):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernels are bf16 (fp32 inputs are cast): covered by the bf16 case")
    T, H, I, E, K = (300, 136, 72, 6, 2) if device == "cuda" else (37, 24, 20, 6, 2)
    ref, sep = separate_modules(E, K, H, I, act, bias, dtype, device, seed=3)
    glu = sm.is_glu(act)
    names = {n for n, _ in sep.named_parameters()}
    if glu:
        assert {"c_fc.gate_weight", "c_fc.up_weight"} <= names and "c_fc.weight" not in names
        assert tuple(sep.c_fc.gate_weight.shape) == (E, I, H)
        # the two halves of one allocation, also after .to(device, dtype): read in place
        assert sm.w1_separate.addresses_ok(sep.c_fc.gate_weight, sep.c_fc.up_weight)
        if bias:
            assert sm.w1_separate.addresses_ok(sep.c_fc.gate_bias, sep.c_fc.up_bias)
    else:
        assert "c_fc.weight" in names  # plain activations: no halves, the layout is ignored
    x0 = torch.randn(T, H, dtype=torch.float64).to(device=device, dtype=dtype)
    g_out = torch.randn(T, H, dtype=torch.float64).to(device=device, dtype=dtype)
    o, aux, dx, g = run(ref, x0, g_out)
    with warnings_as_errors():  # no fallback copy for the module's own parameters
        os_, auxs, dxs, gs = run(sep, x0, g_out)
    assert torch.equal(os_, o) and torch.equal(auxs, aux) and torch.equal(dxs, dx)
    if glu:
        gate, up = sm.w1_to_gate_up(g["c_fc.weight"])
        assert torch.equal(gs["c_fc.gate_weight"], gate) and torch.equal(gs["c_fc.up_weight"], up)
        if bias:
            gate_b, up_b = sm.w1_to_gate_up(g["c_fc.bias"])
            assert torch.equal(gs["c_fc.gate_bias"], gate_b) and torch.equal(gs["c_fc.up_bias"], up_b)
    else:
        assert torch.equal(gs["c_fc.weight"], g["c_fc.weight"])
    for k in ("c_proj.weight", "router.weight") + (("c_proj.bias",) if bias else ()):
        assert torch.equal(gs[k], g[k]), k
    back = sm.convert_moe_state_dict(sep.state_dict(), "interleaved", activation=act)
    for k, v in ref.state_dict().items():
        assert torch.equal(back[k], v), k


class warnings_as_errors:
    def __enter__(self):
        import warnings
        self._c = warnings.catch_warnings()
        self._c.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._c.__exit__(*exc)


@pytest.mark.parametrize("device", DEVICES)
def test_separate_functional_fallback_copy(device):
    """moe_topk(w1_layout="separate") with gate / up in place (halves of one tensor) and with a pair the layer cannot
    read in place (up below gate): the binding copies the pair (cached, one warning), same results, gradients to the
    caller's tensors; the op itself refuses such a pair naming both tensors."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    E, K, H, I, T = 6, 2, 32, 16, 40
    torch.manual_seed(1)
    x = torch.randn(T, H, device=device, dtype=dtype)
    router = torch.randn(E, H, device=device, dtype=dtype)
    w1 = (0.3 * torch.randn(E, 2 * I, H)).to(device=device, dtype=dtype)
    b1 = (0.1 * torch.randn(E, 2 * I)).to(device=device, dtype=dtype)
    w2 = (0.3 * torch.randn(E, H, I)).to(device=device, dtype=dtype)
    b2 = (0.1 * torch.randn(E, H)).to(device=device, dtype=dtype)
    o_ref, aux_ref = sm.moe_topk(x, router, w1, b1, w2, b2, K)
    gate, up = sm.w1_to_gate_up(w1)
    gate_b, up_b = sm.w1_to_gate_up(b1)

    # in place: the halves of one [2, E, I, H]
    pair = sm.w1_separate.pair_storage((E, I, H), dtype, device)
    pair[0].copy_(gate)
    pair[1].copy_(up)
    bpair = sm.w1_separate.pair_storage((E, I), dtype, device)
    bpair[0].copy_(gate_b)
    bpair[1].copy_(up_b)
    with warnings_as_errors():
        o, aux = sm.moe_topk(x, router, pair[0], bpair[0], w2, b2, K, w1_layout="separate", w1_up=pair[1],
                             b1_up=bpair[1])
    assert torch.equal(o, o_ref) and torch.equal(aux, aux_ref)

    # up below gate: the op refuses, naming both tensors; the functional entry copies (one warning) and caches
    buf = torch.empty(2, E, I, H, device=device, dtype=dtype)
    buf[0].copy_(up)
    buf[1].copy_(gate)
    g_t = buf[1].detach().requires_grad_()  # leaves whose memory puts up (buf[0]) below gate (buf[1])
    u_t = buf[0].detach().requires_grad_()
    assert not sm.w1_separate.addresses_ok(g_t, u_t)
    args = (x, router, g_t.detach(), None, w2, None, "swiglu", K, "topk", 128, None, None, None,
            *sm._ops.DEFAULT_ROUTER[:_W1_ARG], "separate", None, u_t.detach(), None)
    with pytest.raises((RuntimeError, ValueError), match="must lie above"):
        torch.ops.sonicmoe.forward(*args)
    sm.w1_separate._WARNED[0] = False
    sm.w1_separate.clear_cache()
    with pytest.warns(UserWarning, match="copied into one"):
        o2, aux2 = sm.moe_topk(x, router, g_t, None, w2, None, K, w1_layout="separate", w1_up=u_t)
    o_nb, _ = sm.moe_topk(x, router, w1, None, w2, None, K)
    assert torch.equal(o2, o_nb)
    (o2.float().sum()).backward()
    # the gradients reach the caller's tensors: those of the interleaved layer's W1, split
    w1r = w1.clone().requires_grad_()
    o3, _ = sm.moe_topk(x, router, w1r, None, w2, None, K)
    o3.float().sum().backward()
    ggate, gup = sm.w1_to_gate_up(w1r.grad)
    assert torch.equal(g_t.grad, ggate) and torch.equal(u_t.grad, gup)
    # cached: a second call with the weights unchanged makes no new copy
    entry = sm.w1_separate._CACHE.get(id(g_t))
    assert entry is not None
    sm.moe_topk(x, router, g_t, None, w2, None, K, w1_layout="separate", w1_up=u_t)
    assert sm.w1_separate._CACHE.get(id(g_t))[2] is entry[2]
    with torch.no_grad():
        g_t.mul_(1.0)  # an in-place update bumps the version: a new copy
    sm.moe_topk(x, router, g_t, None, w2, None, K, w1_layout="separate", w1_up=u_t)
    assert sm.w1_separate._CACHE.get(id(g_t))[2] is not entry[2]


def test_separate_module_after_parameter_replacement_falls_back():
    """A wrapper that replaces the parameters with independent tensors breaks the pair: the module still computes the
    same layer (through the cached copy) and warns."""
    ref, sep = separate_modules(4, 2, 16, 8, "swiglu", False, torch.float32, "cpu", seed=2)
    up = sep.c_fc.up_weight.detach().clone()
    gate = sep.c_fc.gate_weight.detach().clone()
    # allocate so that up lies below gate
    lo, hi = (up, gate) if up.data_ptr() < gate.data_ptr() else (gate, up)
    lo_vals, hi_vals = up.clone(), gate.clone()
    lo.copy_(lo_vals)  # the up values in the lower allocation
    hi.copy_(hi_vals)
    sep.c_fc.up_weight = torch.nn.Parameter(lo)
    sep.c_fc.gate_weight = torch.nn.Parameter(hi)
    assert not sm.w1_separate.addresses_ok(sep.c_fc.gate_weight, sep.c_fc.up_weight)
    sm.w1_separate._WARNED[0] = False
    x = torch.randn(12, 16)
    with pytest.warns(UserWarning, match="copied into one"):
        o, _ = sep(x)
    assert torch.equal(o, ref(x)[0])


def test_separate_state_dict_conversions():
    """convert_moe_state_dict between all three layouts, both directions, with and without a prefix."""
    ref, _ = modules(4, 2, 16, 8, "swiglu", True, torch.float32, "cpu", seed=4)
    sd = {"layer." + k: v for k, v in ref.state_dict().items()}
    for a in sm.W1_LAYOUTS:
        for b in sm.W1_LAYOUTS:
            x = sm.convert_moe_state_dict(sd, a, activation="swiglu", prefix="layer.", from_layout="interleaved")
            y = sm.convert_moe_state_dict(x, b, activation="swiglu", prefix="layer.", from_layout=a)
            z = sm.convert_moe_state_dict(y, "interleaved", activation="swiglu", prefix="layer.", from_layout=b)
            assert set(z) == set(sd), (a, b)
            for k, v in sd.items():
                assert torch.equal(z[k], v), (a, b, k)
    s = sm.convert_moe_state_dict(sd, "separate", activation="swiglu", prefix="layer.")
    assert tuple(s["layer.c_fc.gate_weight"].shape) == (4, 8, 16) and "layer.c_fc.weight" not in s
    assert torch.equal(s["layer.c_fc.up_bias"], sd["layer.c_fc.bias"][:, 1::2])
    # from_layout defaults to "separate" when the separate keys are there
    back = sm.convert_moe_state_dict(s, "concat", activation="swiglu", prefix="layer.")
    assert torch.equal(back["layer.c_fc.weight"], sm.w1_to_concat(sd["layer.c_fc.weight"]))
    with pytest.raises(ValueError, match="from_layout"):
        sm.convert_moe_state_dict(sd, "separate", from_layout="bogus")
    assert sm.convert_moe_state_dict(sd, "separate", activation="gelu") == sd  # no halves


def test_separate_refusals_and_repr():
    with pytest.raises(ValueError, match="separate"):
        sm.MoE(4, 2, 128, 128, "swiglu", w1_layout="separate", precision="fp8")
    with pytest.raises(ValueError, match="separate"):
        sm.MoE(4, 2, 16, 8, "swiglu", w1_layout="separate", accumulate_main_grad=True)
    with pytest.raises(ValueError, match="contradicts"):
        sm.MoE(4, 2, 16, 8, "swiglu", w1_layout="separate", concat_layout=True)
    with pytest.raises(ValueError, match="w1_layout"):
        sm.MoE(4, 2, 16, 8, "swiglu", w1_layout="split")
    assert sm.MoE(4, 2, 16, 8, "swiglu", w1_layout="concat").concat_layout
    assert "w1_layout=separate" in repr(sm.MoE(4, 2, 16, 8, "swiglu", w1_layout="separate"))
    E, H, I, K, T = 4, 16, 8, 2, 5
    x = torch.randn(T, H)
    with pytest.raises(ValueError, match="w1_up"):
        sm.moe_topk(x, torch.randn(E, H), torch.randn(E, I, H), None, torch.randn(E, H, I), None, K,
                    w1_layout="separate")
    with pytest.raises(ValueError, match="w1_up"):
        sm.moe_topk(x, torch.randn(E, H), torch.randn(E, 2 * I, H), None, torch.randn(E, H, I), None, K,
                    w1_up=torch.randn(E, I, H))
    pair = sm.w1_separate.pair_storage((E, I, H))
    base = (x, torch.randn(E, H), pair[0], None, torch.randn(E, H, I), None, "swiglu", K, "topk", 128, None, None,
            None, *sm._ops.DEFAULT_ROUTER[:_W1_ARG])
    with pytest.raises((RuntimeError, ValueError), match="w1_up"):  # the op: separate needs w1_up
        torch.ops.sonicmoe.forward(*base, "separate")
    with pytest.raises((RuntimeError, ValueError), match="w1_up"):  # shapes differ
        torch.ops.sonicmoe.forward(*base, "separate", None, torch.randn(E, I + 1, H), None)
    with pytest.raises((RuntimeError, ValueError), match="w1_layout"):  # fp8 refused
        torch.ops.sonicmoe.forward(torch.randn(T, 128), torch.randn(E, 128), torch.randn(E, 128, 128), None,
                                   torch.randn(E, 128, 128), None, "swiglu", K, "topk", 128, None, None, None,
                                   *sm._ops.DEFAULT_ROUTER[:_W1_ARG - 1], "fp8", "separate", None,
                                   torch.randn(E, 128, 128), None)


def test_fake_forward_separate():
    """The forward op's fake kernel under w1_layout "separate" (w1 the gate, z [N, 2I]) gives the real op's shapes.
    (opcheck runs the op on copies of its arguments: independent allocations, which the layer may refuse; the schema
    is opcheck'ed with the other layouts.)"""
    E, H, I, K, T = 4, 16, 8, 2, 9
    pair = sm.w1_separate.pair_storage((E, I, H))
    pair.normal_()
    bpair = sm.w1_separate.pair_storage((E, I))
    bpair.normal_()
    args = (torch.randn(T, H), torch.randn(E, H), pair[0], bpair[0], torch.randn(E, H, I), torch.randn(E, H), "swiglu",
            K, "topk", 128, None, None, None, *sm._ops.DEFAULT_ROUTER[:_W1_ARG], "separate", None, pair[1], bpair[1])
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = torch.ops.sonicmoe.forward(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.sonicmoe.forward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]
    assert tuple(fake[2 + sm._ops._STATE_NAMES.index("z")].shape) == (T * K, 2 * I)


def test_expert_parallel_from_separate_moe():
    ref, sep = separate_modules(8, 2, 16, 12, "swiglu", True, torch.float32, "cpu", seed=9)
    ep = sm.ExpertParallelMoE.from_moe(sep)
    for k, v in ref.state_dict().items():
        assert torch.equal(ep.state_dict()[k], v), k
    x = torch.randn(10, 16)
    with torch.no_grad():
        assert torch.allclose(ep(x)[0], sep(x)[0], rtol=1e-5, atol=1e-6)


def test_separate_module_torch_compile():
    """torch.compile of a w1_layout="separate" MoE (the op's fake kernels with w1_up / b1_up, dw1 / db1 split in the
    backward): forward and gradients equal eager."""
    _, sep = separate_modules(4, 2, 16, 8, "swiglu", True, torch.float32, "cpu", seed=6)
    x0 = torch.randn(10, 16)
    g_out = torch.randn(10, 16)
    o, aux, dx, g = run(sep, x0, g_out)
    for p in sep.parameters():
        p.grad = None
    oc, auxc, dxc, gc = run(torch.compile(sep, fullgraph=True), x0, g_out)
    assert torch.equal(oc, o) and torch.equal(auxc, aux) and torch.equal(dxc, dx)
    for k in g:
        assert torch.equal(gc["_orig_mod." + k], g[k]), k

"""MoE(..., concat_layout=True): c_fc's rows (and c_fc.bias's) stored concatenated [gate; up] and read in place by the
ops (w1_layout="concat", MoEConfig::w1_layout), against the interleaved module loaded with the converted state dict:
output, aux loss and every gradient equal (bitwise: both run the same arithmetic), the gradients of c_fc in the
concatenated layout; non-GLU activations ignore the flag; refusals. CUDA cases skip without a GPU build and device."""
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

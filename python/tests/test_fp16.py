"""fp16 (torch.float16) as well as bf16: MoE(...).half() forward and backward against the same module in float32,
torch.compile of a half module, the FP8 precision's refusal, one dtype per call. CPU build and CUDA alike (the
CUDA cases of the layer are in test_cuda.py)."""
import copy

import pytest
import torch

import sonicmoe_cpp as sm


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(act="swiglu", bias=True, routing="topk", E=6, K=2, H=32, I=16, seed=0):
    torch.manual_seed(seed)
    m = sm.MoE(E, K, H, I, act, bias, 0.3, routing=routing, tile=8)
    with torch.no_grad():
        m.router.weight.normal_(0.0, 1.0)
    return m


def run(m, x, g):
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad()
    out, aux = m(x)
    ((out.float() * g).sum() + 0.3 * aux.float()).backward()
    return out, aux, [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("act,bias,routing", [("swiglu", True, "topk"), ("geglu", False, "topk"),
                                              ("relu_sq", True, "topk"), ("gelu_tanh", False, "round_nearest")])
def test_half_module_matches_float32(act, bias, routing):
    m32 = make(act, bias, routing)
    with torch.no_grad():  # f16-representable weights: both modules see the same values (and routing)
        for p in m32.parameters():
            p.copy_(p.half().float())
    m16 = copy.deepcopy(m32).half()
    assert all(p.dtype == torch.float16 for p in m16.parameters())
    T = 40
    x = torch.randn(T, 32).half()
    g = torch.randn(T, 32)
    out16, aux16, grads16 = run(m16, x, g)
    out32, aux32, grads32 = run(m32, x.float(), g)
    assert out16.dtype == torch.float16 and out16.shape == (T, 32)
    assert rel_err(out16, out32) < 1e-2
    assert abs(aux16.item() - aux32.item()) < 1e-3
    for i, (a, b) in enumerate(zip(grads16, grads32)):
        assert a.dtype == torch.float16, f"grad {i} is {a.dtype}"
        assert rel_err(a, b) < 2e-2, f"grad {i}: rel err {rel_err(a, b):.3g}"


def test_half_torch_compile_fullgraph():
    torch._dynamo.reset()
    m = make().half()
    x = torch.randn(3, 8, 32).half()
    x1 = x.clone().requires_grad_(True)
    o, a = m(x1)
    (o.float().sum() + a.float()).backward()
    ref = [x1.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    cm = torch.compile(m, fullgraph=True, backend="inductor")
    x2 = x.clone().requires_grad_(True)
    o2, a2 = cm(x2)
    (o2.float().sum() + a2.float()).backward()
    assert o2.dtype == torch.float16
    torch.testing.assert_close(o2, o, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(a2, a, rtol=1e-3, atol=1e-3)
    for g1, g2 in zip([x2.grad] + [p.grad for p in m.parameters()], ref):
        torch.testing.assert_close(g1, g2, rtol=1e-3, atol=1e-3)


def test_half_functional_and_general_routing():
    m = make(bias=False).half()
    T, H = 17, 32
    x = torch.randn(T, H).half()
    o, logits, freq = sm.moe_TC_softmax_topk_layer(x, m.router.weight, m.c_fc.weight.permute(1, 2, 0), None,
                                                   m.c_proj.weight.permute(1, 2, 0), None, 2)
    out, _ = m(x)
    assert o.dtype == torch.float16 and logits.dtype == torch.float32
    assert torch.equal(o, out)
    tok = torch.tensor([0, 0, 3, 5], dtype=torch.int32)
    exp = torch.tensor([1, 4, 0, 5], dtype=torch.int32)
    sc = torch.rand(4)
    og = sm.moe_general_routing(x, tok, exp, sc, m.c_fc.weight, None, m.c_proj.weight, None)
    assert og.dtype == torch.float16 and og.shape == (T, H)
    assert torch.count_nonzero(og[1]) == 0  # token 1 is routed nowhere


def test_half_refusals():
    errs = (ValueError, RuntimeError)
    m = make(bias=False, H=128, I=128).half()
    m.precision = "fp8"
    with pytest.raises(errs, match="precision fp8_blockwise takes bf16 or f32"):
        m(torch.randn(4, 128).half())
    m.precision = "bf16"
    with pytest.raises(errs, match="'x'|w1"):  # one 16-bit type per call
        sm.moe_topk(torch.randn(4, 128).bfloat16(), m.router.weight, m.c_fc.weight, None, m.c_proj.weight, None, 2)

"""The original SonicMoE's remaining names: KernelBackendMoE.torch (the layer in plain PyTorch ops) against the kernels,
count_cumsum, enable_quack_gemm, and the `sonicmoe` import alias (sonicmoe_cpp.original) running the original's test
pattern. CPU tensors here (the CPU backend); the CUDA cases run on a GPU machine."""
import sys

import pytest
import torch

import sonicmoe_cpp as sm
from sonicmoe_cpp import KernelBackendMoE
from sonicmoe_cpp import original

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sm.built_with_cuda() else [])


def _both(moe, x, dy, **fw):
    """Output, aux loss and the gradients of x and every parameter, for the kernels and for the torch backend."""
    res = []
    for backend in (KernelBackendMoE.sonicmoe, KernelBackendMoE.torch):
        xi = x.detach().clone().requires_grad_()
        out, aux = moe(xi, kernel_backend_moe=backend, **fw)
        params = [p for p in moe.parameters()]
        grads = torch.autograd.grad((out.float() * dy.float()).sum() + aux, [xi] + params)
        res.append((out, aux, grads))
    return res


def _close(a, b, tol, what):
    a, b = a.float(), b.float()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol}"


ROUTERS = [
    dict(),
    dict(softmax_over_topk=False, norm_topk_probs=True),
    dict(scoring_func="sigmoid", norm_topk_probs=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
         e_score_correction_bias=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act,bias,router", [("swiglu", False, 0), ("geglu_tanh", True, 0), ("relu_sq", True, 0),
                                             ("swiglu", True, 1), ("gelu", False, 2)])
def test_torch_backend_matches_kernels(device, dtype, act, bias, router):
    torch.manual_seed(0)
    T, H, I, E, K = 77, 64, 48, 12, 3
    moe = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.1, **ROUTERS[router]).to(device=device, dtype=dtype)
    if bias:
        with torch.no_grad():
            moe.c_fc.bias.normal_(0, 0.1)
            moe.c_proj.bias.normal_(0, 0.1)
    if hasattr(moe.router, "e_score_correction_bias"):
        moe.router.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, E))
    x = torch.randn(T, H, device=device, dtype=dtype)
    dy = torch.randn(T, H, device=device, dtype=dtype)
    (o1, a1, g1), (o2, a2, g2) = _both(moe, x, dy)
    assert o2.dtype == dtype and o2.shape == (T, H)
    tol = 1e-5 if dtype == torch.float32 and device == "cpu" else 2e-2
    _close(o1, o2, tol, "output")
    _close(a1, a2, 1e-5 if device == "cpu" else 1e-3, "aux loss")  # CUDA: the kernels take bf16 logits inputs
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for n, ga, gb in zip(names, g1, g2):
        assert ga.dtype == gb.dtype, n
        _close(ga, gb, tol, f"grad of {n}")


def test_torch_backend_inference_and_refusals():
    torch.manual_seed(1)
    moe = sm.MoE(8, 2, 32, 16)
    x = torch.randn(5, 32, requires_grad=True)
    out, aux = moe(x, kernel_backend_moe=KernelBackendMoE.torch, is_inference_mode=True)
    assert aux is None and not out.requires_grad
    ref, _ = moe(x, kernel_backend_moe="torch")
    torch.testing.assert_close(out, ref.detach())
    with pytest.raises(ValueError, match="routing"):
        sm.MoE(8, 2, 32, 16, routing="round_up")(x, kernel_backend_moe="torch")
    with pytest.raises(ValueError, match="capacity_factor"):
        sm.MoE(8, 2, 32, 16, capacity_factor=1.0)(x, kernel_backend_moe="torch")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("size,E", [(0, 4), (1, 1), (1000, 7), (4099, 256), (3001, 50000)])
def test_count_cumsum_matches_bincount(device, dtype, size, E):
    torch.manual_seed(size)
    x = torch.randint(0, E, (size,), device=device, dtype=dtype)
    want = torch.bincount(x.long(), minlength=E)
    counts, csum = sm.count_cumsum(x, E, do_cumsum=True)
    assert counts.dtype == torch.int32 and csum.dtype == torch.int32 and counts.shape == (E,)
    assert torch.equal(counts.long(), want) and torch.equal(csum.long(), want.cumsum(0))
    assert torch.equal(sm.count_cumsum(x=x, E=E, do_cumsum=False).long(), want)


def test_count_cumsum_errors_and_compile():
    with pytest.raises(ValueError, match="expert id 9"):
        sm.count_cumsum(torch.tensor([0, 9, 1]), 4)
    with pytest.raises(ValueError, match="expert id -1"):
        sm.count_cumsum(torch.tensor([-1], dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="dtype"):
        sm.count_cumsum(torch.tensor([0.0]), 4)
    with pytest.raises(ValueError, match="1-D"):
        sm.count_cumsum(torch.zeros(2, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="'E'"):
        sm.count_cumsum(torch.zeros(2, dtype=torch.long), 0)
    f = torch.compile(sm.count_cumsum, fullgraph=True)
    for size, E in ((999, 72), (1000, 80), (517, 9)):  # sizes and E vary: dynamic shapes, a symbolic E
        x = torch.randint(0, E, (size,))
        c, s = f(x=x, E=E, do_cumsum=True)
        assert torch.equal(c.long(), torch.bincount(x, minlength=E)) and torch.equal(s, c.cumsum(0, dtype=torch.int32))


def test_enable_quack_gemm_is_a_scoped_flag():
    assert not sm.is_using_quack_gemm()
    with sm.enable_quack_gemm(True):
        assert sm.is_using_quack_gemm()
        with sm.enable_quack_gemm(False):
            assert not sm.is_using_quack_gemm()
        assert sm.is_using_quack_gemm()
    with pytest.raises(RuntimeError):
        with sm.enable_quack_gemm():
            raise RuntimeError("inside")
    assert not sm.is_using_quack_gemm()


@pytest.fixture
def alias():
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n == "sonicmoe" or n.startswith("sonicmoe.")}
    yield original.install()
    original.uninstall()
    sys.modules.update(saved)


def test_alias_runs_the_original_test_pattern(alias):
    """The original's moe_test.py pattern: kernels vs its torch backend on one module, under autocast and
    enable_quack_gemm, gradients by torch.autograd.grad with retain_graph."""
    from sonicmoe import KernelBackendMoE as B, MoE, enable_quack_gemm  # noqa: N814
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_TC_softmax_topk_layer
    import sonicmoe.moe
    assert sonicmoe.moe.MoE is sm.MoE and moe_TC_softmax_topk_layer is sm.moe_TC_softmax_topk_layer
    torch.manual_seed(42)
    T, H, I, E, K = 96, 64, 32, 8, 2
    moe = MoE(num_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I,
              activation_function=ActivationType.SWIGLU, add_bias=True, std=0.02).to(dtype=torch.bfloat16)
    torch.nn.init.normal_(moe.c_fc.bias, 0, 0.01)
    torch.nn.init.normal_(moe.c_proj.bias, 0, 0.01)
    x_t = 0.02 * torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    x_k = x_t.clone().detach().requires_grad_()
    with torch.autocast("cpu", torch.float32, enabled=False):
        with enable_quack_gemm(True):
            y_k = moe(x_k, kernel_backend_moe=B.sonicmoe)[0]
        y_t = moe(x_t, kernel_backend_moe=B.torch)[0]
        torch.testing.assert_close(y_k.float(), y_t.float(), atol=1.4e-2, rtol=2e-2)
        dy = 0.02 * torch.randn(T, H, dtype=torch.bfloat16)
        W = list(moe.parameters())
        gk = torch.autograd.grad(y_k, [x_k] + W, grad_outputs=dy, retain_graph=True)
        gt = torch.autograd.grad(y_t, [x_t] + W, grad_outputs=dy, retain_graph=True)
    for a, b in zip(gk, gt):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        _close(a, b, 3e-2, "gradient")  # tighter than the original's tolerance, which these small values always meet


def test_alias_refuses_a_foreign_sonicmoe(alias):
    original.uninstall()
    sys.modules["sonicmoe"] = type(sys)("sonicmoe")  # stands for the original package
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            original.install()
    finally:
        del sys.modules["sonicmoe"]

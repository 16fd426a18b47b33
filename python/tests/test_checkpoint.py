"""sonicmoe_cpp.MoE under activation checkpointing (torch.utils.checkpoint, reentrant and not): the forward runs
again in the backward (the first run without a graph), and output, aux loss, dx and every gradient (or main_grad)
must be bitwise those of the module without checkpointing, in bf16 and FP8, for several steps; on the CPU backend
and (where a GPU is visible) on CUDA, there at every bench config's full size too."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sonicmoe_cpp as sm
from bench_configs import CONFIGS, IDS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sm.built_with_cuda() else [])


def _steps(m, x, dy, mode, steps=2):
    """Per step (output, aux, dx), and the parameters' gradients (or main_grad) after all steps."""
    outs = []
    for _ in range(steps):
        xs = x.clone().requires_grad_()
        if mode is None:
            y, aux = m(xs)
        else:
            y, aux = checkpoint(m, xs, use_reentrant=mode)
        ((y.float() * dy).sum() + 0.3 * aux).backward()
        outs.append((y.detach(), aux.detach(), xs.grad))
    grads = {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for n, p in m.named_parameters()}
    return outs, grads


def _check(m, x, dy, mode):
    ref = copy.deepcopy(m)
    for p, q in zip(m.parameters(), ref.parameters()):  # (a deep copy does not carry a parameter's attributes)
        if hasattr(p, "main_grad"):
            q.main_grad = torch.zeros_like(p.main_grad)
    ref_outs, ref_grads = _steps(ref, x, dy, None)
    outs, grads = _steps(m, x, dy, mode)
    for (y, aux, dx), (y_r, aux_r, dx_r) in zip(outs, ref_outs):
        assert torch.equal(y, y_r) and torch.equal(aux, aux_r) and torch.equal(dx, dx_r)
    for n, g in grads.items():
        assert torch.equal(g, ref_grads[n]), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_checkpointed_module_is_bitwise_the_plain_one(device, reentrant, precision):
    torch.manual_seed(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = sm.MoE(8, 2, 128, 128, add_bias=True, std=0.05, precision=precision).to(device, dtype)
    x = torch.randn(77, 128).to(device, dtype)
    dy = torch.randn(77, 128).to(device)
    _check(m, x, dy, reentrant)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_main_grad_and_capacity(device):
    """accumulate_main_grad (the sums land once per backward, not again for the recomputed forward) and a capacity
    factor (the same pairs dropped in both runs of the forward)."""
    torch.manual_seed(2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = sm.MoE(8, 2, 64, 32, accumulate_main_grad=True, capacity_factor=0.6).to(device, dtype)
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    x = torch.randn(50, 64).to(device, dtype)
    dy = torch.randn(50, 64).to(device)
    _check(m, x, dy, False)
    assert int(m.num_dropped.item()) > 0
    assert all(p.grad is None and p.main_grad.abs().max() > 0 for p in m.parameters())


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_checkpointed_full_size(cfg):
    """Every bench config at its full size, non-reentrant checkpointing, bitwise the plain module over two steps."""
    torch.manual_seed(3)
    T, H = cfg["T"], cfg["H"]
    m = sm.MoE(cfg["E"], cfg["K"], H, cfg["I"]).to("cuda", torch.bfloat16)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda")
    _check(m, x, dy, False)

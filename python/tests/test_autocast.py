"""sonicmoe_cpp under torch.autocast: a module with fp32 parameters computes in autocast's dtype (x and the weights cast
by differentiable copies, as autocast's linear casts its operands) and returns its output in that dtype; the
gradients reach the fp32 parameters (or their fp32 main_grad). Checked bitwise against the same module converted to
that dtype, on the CPU backend and (where a GPU is visible) on CUDA, at a small shape and at every bench config's
full size; the functional entry, W1 as separate gate / up tensors, precision "fp8", torch.compile,
KernelBackendMoE.torch; what stays refused (float64 inputs, FP8 under an f16 autocast, ExpertParallelMoE's
accumulate_main_grad with parameters of another dtype)."""
import copy

import pytest
import torch

import sonicmoe_cpp as sm
from bench_configs import CONFIGS, IDS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and sm.built_with_cuda() else [])


def _step(m, x, dy):
    """(output, aux, x.grad, {name: grad}) of one forward+backward of m on a copy of x."""
    x = x.clone().requires_grad_()
    y, aux = m(x)
    ((y.float() * dy).sum() + 0.5 * aux).backward()
    return y, aux, x.grad, {n: p.grad for n, p in m.named_parameters()}


def _pair(E, K, H, I, dev, dtype, **kw):
    """An fp32 module and its copy converted to dtype (the reference), same weights."""
    torch.manual_seed(3)
    m = sm.MoE(E, K, H, I, add_bias=True, std=0.05, **kw).to(dev)
    return m, copy.deepcopy(m).to(dtype)


def _assert_bitwise(got, ref, dtype):
    y, aux, dx, grads = got
    y_r, aux_r, dx_r, grads_r = ref
    assert y.dtype == dtype and torch.equal(y, y_r)
    assert aux.dtype == torch.float32 and torch.equal(aux, aux_r)
    assert torch.equal(dx.to(dtype), dx_r)
    for n, g in grads.items():  # the fp32 parameters get the converted module's gradients, widened
        assert g.dtype == torch.float32 and torch.equal(g, grads_r[n].float()), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", ["autocast", "float32"])
def test_module_under_autocast_is_the_converted_module(device, dtype, x_dtype):
    m, ref = _pair(8, 2, 64, 32, device, dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 64, generator=g).to(device, dtype)  # values the cast keeps
    dy = torch.randn(37, 64, generator=g).to(device)
    with torch.autocast(device, dtype=dtype):
        got = _step(m, x if x_dtype == "autocast" else x.float(), dy)
    _assert_bitwise(got, _step(ref, x, dy), dtype)
    # outside autocast the module keeps its own rule: an input of another dtype is refused, naming both
    with pytest.raises(ValueError, match="expected the module's torch.float32"):
        m(x)


@pytest.mark.parametrize("device", DEVICES)
def test_three_dim_input_and_a_second_step(device):
    m, ref = _pair(6, 3, 32, 16, device, torch.bfloat16)
    x = torch.randn(2, 9, 32).to(device, torch.bfloat16)
    dy = torch.randn(2, 9, 32).to(device)
    for _ in range(2):  # gradients accumulate into the fp32 parameters as into the converted module's
        with torch.autocast(device, dtype=torch.bfloat16):
            got = _step(m, x, dy)
        want = _step(ref, x, dy)
    assert got[0].shape == (2, 9, 32)
    _assert_bitwise(got, want, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_separate_gate_up_weights(device):
    m, ref = _pair(8, 2, 64, 32, device, torch.bfloat16, w1_layout="separate")
    x = torch.randn(21, 64).to(device, torch.bfloat16)
    dy = torch.randn(21, 64).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = _step(m, x, dy)
    _assert_bitwise(got, _step(ref, x, dy), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_under_bf16_autocast(device):
    """precision "fp8": the layer quantises the bf16 copies, as the converted module quantises its bf16 weights (with
    its weight cache; on the CPU under autocast the call quantises its copies itself)."""
    m, ref = _pair(4, 2, 128, 128, device, torch.bfloat16, precision="fp8")
    x = torch.randn(50, 128).to(device, torch.bfloat16)
    dy = torch.randn(50, 128).to(device)
    for _ in range(2):  # the second call on CUDA reads the cache
        m.zero_grad(), ref.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            got = _step(m, x, dy)
        _assert_bitwise(got, _step(ref, x, dy), torch.bfloat16)
    with torch.autocast(device, dtype=torch.float16), pytest.raises(ValueError, match="autocast"):
        m(x.half())


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_under_autocast(device):
    """accumulate_main_grad=True: the weights' gradients go into the fp32 parameters' main_grad (found before the
    casts), .grad stays None; within bf16 tolerance of the converted module's .grad (main_grad is not rounded)."""
    m, ref = _pair(8, 2, 64, 32, device, torch.bfloat16, accumulate_main_grad=True)
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    x = torch.randn(40, 64).to(device, torch.bfloat16)
    dy = torch.randn(40, 64).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        _step(m, x, dy)
    ref.accumulate_main_grad = False
    _, _, _, want = _step(ref, x, dy)
    for n, p in m.named_parameters():
        assert p.grad is None, n
        w = want[n].double()
        err = ((p.main_grad.double() - w).norm() / w.norm()).item()
        assert 0 < p.main_grad.abs().max() and err < 1e-2, (n, err)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_entry_under_autocast(device):
    torch.manual_seed(5)
    E, K, H, I = 8, 2, 64, 32
    ws = [torch.randn(E, H) * 0.1, torch.randn(E, 2 * I, H) * 0.05, None, torch.randn(E, H, I) * 0.05, None]
    ws = [None if w is None else w.to(device) for w in ws]
    x = torch.randn(19, H).to(device, torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y, aux = sm.moe_topk(x, ws[0], ws[1], ws[2], ws[3], ws[4], K)
    y_ref, aux_ref = sm.moe_topk(x, *[None if w is None else w.to(torch.bfloat16) for w in ws[:1] + ws[1:]], K)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(aux, aux_ref)


def test_compiled_module_under_autocast():
    m, _ = _pair(8, 2, 64, 32, "cpu", torch.bfloat16)
    x = torch.randn(12, 64, dtype=torch.bfloat16)
    cm = torch.compile(m, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = cm(x)
        y_eager, aux_eager = m(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_eager) and torch.equal(aux, aux_eager)


def test_torch_backend_under_autocast_runs():
    """KernelBackendMoE.torch (plain PyTorch ops, which autocast handles op by op) runs on an autocast input, close to
    the kernels' result."""
    m, _ = _pair(8, 2, 64, 32, "cpu", torch.bfloat16)
    x = torch.randn(12, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_t, _ = m(x, kernel_backend_moe=sm.KernelBackendMoE.torch)
        y_k, _ = m(x)
    err = ((y_t.double() - y_k.double()).norm() / y_k.double().norm()).item()
    assert err < 2e-2, err


def test_float64_input_stays_refused():
    m, _ = _pair(8, 2, 64, 32, "cpu", torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.float64"):
        m(torch.randn(4, 64, dtype=torch.float64))


def test_expert_parallel_under_autocast():
    """ExpertParallelMoE (world size 1 here, no process group; test_ep.py runs world sizes 2 and 4): parameters in
    autocast's dtype take an fp32 input, cast to it, bitwise the bf16 input's result; fp32 parameters compute in
    bf16 as MoE's do; with accumulate_main_grad they are refused (before any collective), naming autocast."""
    torch.manual_seed(6)
    moe = sm.MoE(8, 2, 64, 32)
    ep16 = sm.ExpertParallelMoE.from_moe(copy.deepcopy(moe).to(torch.bfloat16))
    x = torch.randn(15, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = ep16(x.float())
    y_ref, aux_ref = ep16(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref) and torch.equal(aux, aux_ref)
    ep32 = sm.ExpertParallelMoE.from_moe(moe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32, aux32 = ep32(x)
    assert y32.dtype == torch.bfloat16 and torch.equal(y32, y_ref) and torch.equal(aux32, aux_ref)
    ep32.accumulate_main_grad = True
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.autocast"):
        ep32(x)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_full_size_on_cuda(cfg):
    """Every bench config at its full size under autocast, fp32 parameters, against the module converted to bf16:
    output, dx and every gradient bitwise."""
    T, H = cfg["T"], cfg["H"]
    m, ref = _pair(cfg["E"], cfg["K"], H, cfg["I"], "cuda", torch.bfloat16)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _step(m, x, dy)
    _assert_bitwise(got, _step(ref, x, dy), torch.bfloat16)


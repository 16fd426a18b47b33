"""sonicmoe_cpp.ep.moe_deepep on DeepEP's FP8 dispatch output (recv_x = float8_e4m3fn codes, recv_x_scale = their
1x128 scales): bitwise the FP8 layer (moe_general_routing, precision "fp8") on the dequantised rows, forward and
every gradient, recv_x's gradient written into recv_x_grad; moe_deepep / moe_permuted with precision "fp8" on
unquantised rows; scales that are not powers of two; N = 0; the errors. CPU always, CUDA when a device is visible."""
import pytest
import torch

import sonicmoe_cpp as sm
from sonicmoe_cpp import ep

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
N, K, E, H, I = 37, 3, 5, 256, 128


def _rows(device, dtype, scale_jitter=False, seed=0):
    """Codes [N, H] with a +-448 in every 1x128 block (so that the dequantised rows quantise back to them under a
    power-of-two amax scale) and their scales; the rows' values in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.rand(N, H, generator=g) * 800 - 400).to(torch.float8_e4m3fn).float()
    codes.view(N, H // 128, 128)[:, :, 5] = 448.0 * torch.sign(torch.randn(N, H // 128, generator=g))
    scale = torch.exp2(torch.randint(-12, -4, (N, H // 128), generator=g).float())
    if scale_jitter:  # DeepEP's amax / 448: not powers of two
        scale = scale * (0.7 + 0.5 * torch.rand(N, H // 128, generator=g))
    q = codes.to(torch.float8_e4m3fn).to(device)
    scale = scale.to(device)
    return q, scale, ep.dequantize_rows(q, scale, dtype)


def _layer(device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(device, dtype).requires_grad_()
    b1 = (torch.randn(E, 2 * I, generator=g) * 0.05).to(device, dtype).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(device, dtype).requires_grad_()
    b2 = (torch.randn(E, H, generator=g) * 0.05).to(device, dtype).requires_grad_()
    idx = torch.randint(-1, E - 1, (N, K), generator=g)
    idx[4] = -1  # a row without local experts
    for k in range(1, K):  # distinct ids per row, as DeepEP sends them
        idx[:, k] = torch.where((idx[:, k:k + 1] == idx[:, :k]).any(1), -1, idx[:, k])
    wts = torch.rand(N, K, generator=g)
    return [w1, b1, w2, b2], idx.to(device), wts.to(device)


def _grads(params, wts, *extra):
    return [p.grad.clone() for p in params] + [wts.grad.clone()] + list(extra)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rows_bitwise_the_fp8_layer_on_the_dequantised_rows(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, scale, xd = _rows(device, dtype)
    params, idx, wts = _layer(device, dtype)
    wts.requires_grad_()
    dy = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    buf = torch.full((N, H), float("nan"), device=device, dtype=dtype)
    y = ep.moe_deepep(q, idx, wts, *[params[i] for i in (0, 1, 2, 3)], recv_x_scale=scale, recv_x_grad=buf)
    assert y.dtype == dtype and y.shape == (N, H)
    assert torch.equal(y[4], torch.zeros_like(y[4])), "a row without local experts comes out zero"
    (y.float() * dy.float()).sum().backward()
    got = _grads(params, wts, y.detach(), buf)
    for p in params:
        p.grad = None
    wts.grad = None
    x = xd.clone().requires_grad_()
    rows, cols = (idx >= 0).nonzero().unbind(1)
    y2 = sm.moe_general_routing(x, rows.int(), idx[rows, cols].int(), wts[rows, cols], *params, "swiglu",
                                precision="fp8")
    (y2.float() * dy.float()).sum().backward()
    want = _grads(params, wts, y2.detach(), x.grad)
    names = ["dw1", "db1", "dw2", "db2", "dweights", "out", "dx"]
    bad = [n for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    assert not bad, f"not bitwise equal: {bad}"
    # without recv_x_grad: the same output, recv_x's gradient dropped
    y3 = ep.moe_deepep(q, idx, wts.detach(), *params, recv_x_scale=scale)
    assert torch.equal(y3, y.detach())
    # bf16 / f32 rows with precision "fp8": the FP8 layer quantises them, here back to the same codes
    with torch.no_grad():
        assert torch.equal(ep.moe_deepep(xd, idx, wts, *params, precision="fp8"), y.detach())
        perm = torch.sort(idx[:, 0] % E, stable=True).indices  # moe_permuted: the rows of each expert together
        counts = torch.bincount(idx[perm, 0] % E, minlength=E)
        out_p = ep.moe_permuted(xd[perm], counts, wts[perm, 0], *params, precision="fp8")
        rows = torch.arange(N, device=device, dtype=torch.int32)
        ref_p = sm.moe_general_routing(xd[perm], rows, (idx[perm, 0] % E).int(), wts[perm, 0], *params, "swiglu",
                                       precision="fp8")
        assert torch.equal(out_p, ref_p)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rows_honour_scales_that_are_not_powers_of_two(device):
    """The rows' values are codes * scales: the output tracks the bf16 / f32 layer on those values within FP8's error,
    not the layer on the codes times other scales."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, scale, xd = _rows(device, dtype, scale_jitter=True)
    params, idx, wts = _layer(device, dtype)
    with torch.no_grad():
        y = ep.moe_deepep(q, idx, wts, *params, recv_x_scale=scale).float()
        ref = ep.moe_deepep(xd, idx, wts, *params).float()
        other = ep.moe_deepep(ep.dequantize_rows(q, scale * 1.3, dtype), idx, wts, *params).float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    assert rel(y, ref) < 0.06, rel(y, ref)
    assert rel(y, other) > 3 * rel(y, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rows_no_rows(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    params, _, _ = _layer(device, dtype)
    q = torch.empty(0, H, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(0, H // 128, device=device)
    y = ep.moe_deepep(q, torch.empty(0, K, dtype=torch.long, device=device), torch.empty(0, K, device=device), *params,
                      recv_x_scale=scale)
    assert y.shape == (0, H) and y.dtype == dtype
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in params)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rows_accumulate_main_grad(device):
    """accumulate_main_grad=True on FP8 rows: every weight's gradient lands in its fp32 main_grad (.grad None): W1's
    and W2's from the op's GEMMs (rounded to the weights' dtype, bitwise the gradients without the option), the
    biases' as those gradients in fp32; two steps add them twice; recv_x_grad and the scores' gradient unchanged."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, scale, _ = _rows(device, dtype)
    params, idx, wts = _layer(device, dtype)
    wts.requires_grad_()
    dy = torch.randn(N, H, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    buf = torch.empty(N, H, device=device, dtype=dtype)
    y = ep.moe_deepep(q, idx, wts, *params, recv_x_scale=scale, recv_x_grad=buf)
    (y.float() * dy.float()).sum().backward()
    want = _grads(params, wts, buf.clone())
    for p in params:
        p.grad = None
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    wts.grad = None
    firsts = None
    for step in range(2):
        wts.grad = None
        y = ep.moe_deepep(q, idx, wts, *params, recv_x_scale=scale, recv_x_grad=buf, accumulate_main_grad=True)
        (y.float() * dy.float()).sum().backward()
        assert all(p.grad is None for p in params)
        assert torch.equal(wts.grad, want[4]) and torch.equal(buf, want[5])
        if step == 0:
            for p, w in zip(params, want):
                assert torch.equal(p.main_grad.to(dtype), w)
            firsts = [p.main_grad.clone() for p in params]
    for p, f in zip(params, firsts):
        assert torch.equal(p.main_grad, 2 * f)


def test_fp8_rows_errors_name_the_argument():
    q, scale, xd = _rows("cpu", torch.float32)
    params, idx, wts = _layer("cpu", torch.float32)
    cases = [
        (dict(recv_x=xd, recv_x_scale=scale), "argument 'recv_x'"),
        (dict(recv_x=q, recv_x_scale=scale[:, :1]), "argument 'recv_x_scale'"),
        (dict(recv_x=q, recv_x_scale=scale.double()), "argument 'recv_x_scale'"),
        (dict(recv_x=q, recv_x_scale=scale, recv_x_grad=torch.empty(N, H, dtype=torch.bfloat16)),
         "argument 'recv_x_grad'"),
        (dict(recv_x=xd, recv_x_grad=torch.empty(N, H)), "argument 'recv_x_grad'"),
        (dict(recv_x=xd, precision="fp16"), "argument 'precision'"),
    ]
    for kw, msg in cases:
        x = kw.pop("recv_x")
        with pytest.raises(ValueError, match=msg):
            ep.moe_deepep(x, idx, wts, *params, **kw)
    with pytest.raises(ValueError, match="requires grad"):
        ep.moe_deepep(q.float().to(torch.float8_e4m3fn).requires_grad_(), idx, wts, *params, recv_x_scale=scale)
    # H not a multiple of 128: the FP8 layer's own error
    q2 = torch.zeros(N, 64, dtype=torch.float8_e4m3fn)
    w = [torch.zeros(E, 2 * I, 64), None, torch.zeros(E, 64, I), None]
    with pytest.raises((ValueError, RuntimeError), match="128"):
        ep.moe_deepep(q2, idx, wts, *w, recv_x_scale=torch.ones(N, 1))


def test_fp8_rows_op_fake_kernel():
    """The op's fake kernel (torch.compile) gives the real kernel's output shapes and dtypes. (opcheck's schema test
    cannot compare float8 inputs: torch's allclose has no float8 kernel.)"""
    q, scale, _ = _rows("cpu", torch.float32)
    params, idx, wts = _layer("cpu", torch.float32)
    rows = torch.arange(N, dtype=torch.int32)
    exp = (rows % E).int()
    args = (q, scale, params[0].detach(), None, params[2].detach(), None, "swiglu", rows, exp, torch.rand(N))
    torch.library.opcheck(torch.ops.sonicmoe.forward_fp8_rows.default, args, test_utils=("test_faketensor",))


def test_dequantize_rows_is_decode_times_scale():
    """ep.dequantize_rows (the library's torch.ops.sonicmoe.fp8_dequantize_rows): the codes times their block's scale
    in float32, rounded once to the dtype; its fake kernel; f16 refused."""
    q, scale, _ = _rows("cpu", torch.float32, scale_jitter=True)
    want = q.float().view(N, H // 128, 128).mul(scale.unsqueeze(-1)).view(N, H)
    assert torch.equal(ep.dequantize_rows(q, scale, torch.float32), want)
    assert torch.equal(ep.dequantize_rows(q, scale, torch.bfloat16), want.bfloat16())
    torch.library.opcheck(torch.ops.sonicmoe.fp8_dequantize_rows.default, (q, scale, torch.bfloat16),
                          test_utils=("test_faketensor",))
    with pytest.raises((ValueError, RuntimeError), match="argument 'out'"):
        ep.dequantize_rows(q, scale, torch.float16)


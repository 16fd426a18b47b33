"""The PyTorch module at the full size of every shape of bench/bench_configs.json, as users run it: forward+backward
through sonicmoe_cpp.MoE against a torch._grouped_mm implementation of the same layer, and sequences that mix
training steps, forward-only calls, no_grad and inference-mode forwards, two modules alive at once and other GPU
libraries (cuBLAS, Triton) between steps, in one process. Skipped without a GPU."""

import pytest
import torch
import torch.nn.functional as F

import sonicmoe_cpp as sm
from bench_configs import CONFIGS, IDS

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not sm.built_with_cuda(), reason="sonicmoe_cpp was built without CUDA"),
]



def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference_layer(x, m):
    """The same layer in plain PyTorch (top-K softmax over the K logits, gather, torch._grouped_mm, SwiGLU on
    interleaved gate/up rows, weighted scatter-add); autograd gives its gradients."""
    T, H = x.shape
    E, K = m.num_experts, m.top_k
    logits = x.float() @ m.router.weight.float().t()  # fp32 logits, as the library's router: bf16 ones tie often
    vals, ids = torch.topk(logits, K, dim=-1)
    s = torch.softmax(vals, -1)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    z = torch._grouped_mm(x[tok], m.c_fc.weight.transpose(1, 2), offs=offs)
    a = F.silu(z[:, 0::2]) * z[:, 1::2]
    y = torch._grouped_mm(a, m.c_proj.weight.transpose(1, 2), offs=offs)
    y = y * s.flatten()[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)


def make(cfg, seed=0):
    torch.manual_seed(seed)
    return sm.MoE(cfg["E"], cfg["K"], cfg["H"], cfg["I"], "swiglu", False, 0.02).cuda().bfloat16()


def grads(m, x, out, g):
    for p in m.parameters():
        p.grad = None
    x.grad = None
    out.backward(g)
    torch.cuda.synchronize()
    return [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_module_full_size_matches_grouped_mm(cfg):
    m = make(cfg)
    x = torch.randn(cfg["T"], cfg["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for step in range(2):  # the first backward crashed at fine-grained-256 once; a second catches leftover state
        out, aux = m(x)
        ours = grads(m, x, out, g)
        assert torch.isfinite(out).all() and torch.isfinite(aux)
        for t in ours:
            assert t is not None and torch.isfinite(t).all() and t.abs().sum() > 0
        if step == 0:
            first = [out.detach().clone()] + [t.clone() for t in ours]
        else:  # deterministic: bit-exact repeats
            for a, b in zip([out.detach()] + ours, first):
                assert torch.equal(a, b)
    ref = reference_layer(x, m)
    ref_grads = grads(m, x, ref, g)
    assert rel_err(out.detach(), ref.detach()) < 2e-2
    names = ["x", "router", "c_fc", "c_proj"]
    for name, a, b in zip(names, ours, ref_grads):
        # The router's gradient goes through the top-K softmax (small values, bf16 logits): a looser bound.
        assert rel_err(a, b) < (6e-2 if name == "router" else 3e-2), name
    del m, x, g, out, ref, ours, ref_grads, first
    torch.cuda.empty_cache()


def chunked_stats(a, b, rows=1 << 20):
    """(cosine, relative RMS error) of a against b in float64, summed over flat chunks: a single reduction over
    more than 2^31 elements (dW1 at fine-grained-256 has 2^31) is not what this should depend on."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    dot = aa = bb = dd = 0.0
    for i in range(0, a.numel(), rows):
        x, y = a[i:i + rows].double(), b[i:i + rows].double()
        dot += (x * y).sum().item()
        aa += (x * x).sum().item()
        bb += (y * y).sum().item()
        dd += ((x - y) ** 2).sum().item()
    return dot / max((aa * bb) ** 0.5, 1e-300), (dd / max(bb, 1e-300)) ** 0.5


def _step(m, x, g, **kw):
    """One forward+backward: [out, dx, every parameter's gradient] (detached, the module's grads cleared)."""
    out, _ = m(x, **kw)
    return [out.detach()] + grads(m, x, out, g)


def _bf16_start(cfg):
    """A fresh module, an input and an output gradient at the config's size, and the bf16 step's results."""
    m = make(cfg)
    x = torch.randn(cfg["T"], cfg["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    return m, x, g, _step(m, x, g)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_fp8_module_full_size(cfg):
    """MoE(precision="fp8") with its weight cache at full size, two steps (the cache filled, then hit) bit-exact, the
    second equal to a cache-less module's step; against the bf16 module on the same weights: out, dx, dW1, dW2 within
    the FP8 gate (cosine >= 0.997, relative RMS < 7.6%; docs/ALGORITHM.md), the router's gradient (through ds, which
    misses the RMS gate by 0.2 points) cosine >= 0.99."""
    m, x, g, want = _bf16_start(cfg)
    m.precision = "fp8"
    first = _step(m, x, g)
    second = _step(m, x, g)
    assert (m._fp8_cache.misses, m._fp8_cache.hits) == (1, 1)  # quantised once, then served from the cache
    for a, b in zip(second, first):
        assert torch.equal(a, b)
    del second
    m.fp8_weight_cache = False
    for a, b in zip(_step(m, x, g), first):
        assert torch.equal(a, b)
    names = ["out", "x", "router", "c_fc", "c_proj"]
    for name, a, b in zip(names, first, want):
        assert torch.isfinite(a).all(), name
        cos, rms = chunked_stats(a, b)
        if name == "router":
            assert cos >= 0.99, (name, cos, rms)
        else:
            assert cos >= 0.997 and rms < 0.076, (name, cos, rms)
    del m, x, g, want, first
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_fp8_wgrad_module_full_size(cfg):
    """MoE(precision="fp8_wgrad") (weight gradients on FP8 operands: the per-expert transposed copies and the FP8
    varlen-K GEMM) at full size: two steps bit-exact; out, dx and the router's gradient bitwise those of
    precision="fp8" (only dW1 / dW2 change); dW1 / dW2 against the bf16 module's: cosine >= 0.996 and relative RMS
    < 8.5% (the CPU reference's FP8 weight gradients miss the 7.6% gate for dW2 by up to 0.4 points,
    docs/ALGORITHM.md), and against "fp8"'s bf16 weight gradients cosine >= 0.998."""
    m, x, g, want = _bf16_start(cfg)
    m.precision = "fp8"
    fp8 = _step(m, x, g)
    m.precision = "fp8_wgrad"
    first = _step(m, x, g)
    for a, b in zip(_step(m, x, g), first):
        assert torch.equal(a, b)
    names = ["out", "x", "router", "c_fc", "c_proj"]
    for name, a, b, w in zip(names, first, fp8, want):
        assert torch.isfinite(a).all(), name
        if name in ("out", "x", "router"):
            assert torch.equal(a, b), name
            continue
        cos, rms = chunked_stats(a, w)
        assert cos >= 0.996 and rms < 0.085, (name, "vs bf16", cos, rms)
        cos8, rms8 = chunked_stats(a, b)
        assert cos8 >= 0.998, (name, "vs fp8", cos8, rms8)
        print(f"{cfg['name']} {name}: vs bf16 cos {cos:.5f} rms {rms:.4f}; vs fp8 cos {cos8:.5f} rms {rms8:.4f}")
    del m, x, g, want, fp8, first
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_concat_layout_module_full_size(cfg):
    """MoE(concat_layout=True) at full size, loaded with the interleaved module's converted weights: output and
    every gradient bitwise equal to the interleaved module's (c_fc's gradient converted)."""
    ref = make(cfg)
    x = torch.randn(cfg["T"], cfg["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    want = _step(ref, x, g)
    sd = sm.convert_moe_state_dict(ref.state_dict(), "concat", activation="swiglu")
    del ref
    torch.manual_seed(0)
    cat = sm.MoE(cfg["E"], cfg["K"], cfg["H"], cfg["I"], "swiglu", False, 0.02, concat_layout=True).cuda().bfloat16()
    cat.load_state_dict(sd)
    del sd
    got = _step(cat, x, g)
    names = ["out", "x", "router", "c_fc", "c_proj"]
    for name, a, b in zip(names, got, want):
        if name == "c_fc":
            b = sm.w1_to_concat(b)
        assert torch.equal(a, b), name
    del cat, x, g, want, got
    torch.cuda.empty_cache()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_main_grad_module_full_size(cfg):
    """MoE(accumulate_main_grad=True) at full size with fp32 main_grads: W1's, W2's and the router's are added by
    the library's weight-gradient GEMMs (unrounded; after one step from zeros, rounded to bf16, bitwise the module's
    bf16 gradients); output, x's gradient unchanged; .grad stays None; a second step adds the same values again
    (bitwise 2x)."""
    ref = make(cfg)
    x = torch.randn(cfg["T"], cfg["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    want = _step(ref, x, g)
    del ref
    m = make(cfg)
    m.accumulate_main_grad = True
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    got = _step(m, x, g)  # [out, x.grad, then .grad of each parameter]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    params = [m.router.weight, m.c_fc.weight, m.c_proj.weight]
    for name, p, w in zip(("router", "c_fc", "c_proj"), params, want[2:]):
        assert p.grad is None, name
        assert torch.equal(p.main_grad.bfloat16(), w), name
    first = [p.main_grad.clone() for p in params]
    _step(m, x, g)
    for p, f in zip(params, first):  # fp32 f + f = 2f exactly
        assert torch.equal(p.main_grad, 2 * f)
    del m, x, g, want, got, first, params
    torch.cuda.empty_cache()


def _other_libraries(x):
    """cuBLAS and (when present) a Triton kernel on the same stream, between our calls."""
    y = x @ x.t()
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _scale(p, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(p + i, mask=i < n)
            tl.store(p + i, v * 2, mask=i < n)

        buf = torch.ones(4096, device=x.device)
        _scale[(4,)](buf, buf.numel(), BLOCK=1024)
        assert buf.sum().item() == 2 * 4096
    except ImportError:
        pass
    return y


def test_mixed_sequence_in_one_process():
    """Training steps, forward-only calls, no_grad and inference forwards, two modules alive, other libraries in
    between: each result checked against a fresh step of the same module."""
    big = next(c for c in CONFIGS if c["name"] == "fine-grained-256")
    small = next(c for c in CONFIGS if c["name"] == "small-k2")
    m1, m2 = make(big, 1), make(small, 2)
    x1 = torch.randn(big["T"], big["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = torch.randn(small["T"], small["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g1, g2 = torch.randn_like(x1), torch.randn_like(x2)
    out1, _ = m1(x1)
    want1 = [out1.detach().clone()] + [t.clone() for t in grads(m1, x1, out1, g1)]
    out2, _ = m2(x2)
    want2 = [out2.detach().clone()] + [t.clone() for t in grads(m2, x2, out2, g2)]
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(m1(x1)[0], want1[0])
        inf, aux = m1(x1, is_inference_mode=True)
        assert aux is None and torch.equal(inf, want1[0])
        _other_libraries(x2.detach())
        pending, _ = m2(x2)        # forward kept alive while the other module trains
        out1, aux1 = m1(x1)        # forward with grad, then a forward-only call before its backward
        m1(x1.detach())
        got1 = [out1.detach()] + grads(m1, x1, out1, g1)
        got2 = [pending.detach()] + grads(m2, x2, pending, g2)
        for a, b in zip(got1, want1):
            assert torch.equal(a, b)
        for a, b in zip(got2, want2):
            assert torch.equal(a, b)
    del m1, m2
    torch.cuda.empty_cache()


def test_retain_graph_second_backward_raises():
    """dZ is written over the saved Z: a second backward through the same graph raises autograd's in-place error
    instead of computing with dZ as Z."""
    m = make(dict(E=8, K=2, H=256, I=128))
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = m(x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_misaligned_view_is_an_exception():
    m = make(dict(E=8, K=2, H=256, I=128))
    buf = torch.randn(256 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    x = buf[1:].view(256, 256)  # contiguous, 2 bytes past a 16-byte boundary
    with pytest.raises((ValueError, RuntimeError), match="'x'.*16-byte aligned"):
        m(x)


def test_cpu_tensor_mixed_with_cuda_is_an_exception():
    m = make(dict(E=8, K=2, H=256, I=128))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="all tensors must be on one device"):
        torch.ops.sonicmoe.forward(x, m.router.weight.cpu(), m.c_fc.weight, None, m.c_proj.weight, None, "swiglu", 2,
                                   "topk", 128, None, None, None)


def test_inference_mode_is_smaller_than_training_forward():
    cfg = next(c for c in CONFIGS if c["name"] == "mid-128x8")
    m = make(cfg)
    x = torch.randn(cfg["T"], cfg["H"], device="cuda", dtype=torch.bfloat16)

    def peak(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, r

    p_inf, (out_inf, aux) = peak(lambda: m(x, is_inference_mode=True))
    with torch.no_grad():
        p_train, (out_train, _) = peak(lambda: m(x))
    assert aux is None
    assert torch.equal(out_inf, out_train)
    assert p_inf < p_train

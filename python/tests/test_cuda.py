"""CUDA backend through the binding: forward/backward vs the CPU backend, allocation through torch, CUDA graph
capture, torch.compile. Skipped without a GPU (or when sonicmoe_cpp was built without CUDA)."""
import pytest
import torch

import sonicmoe_cpp as sm

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not sm.built_with_cuda(), reason="sonicmoe_cpp was built without CUDA"),
]


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_module(act="swiglu", bias=False, routing="topk", E=8, K=2, H=256, I=128, dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = sm.MoE(E, K, H, I, act, bias, 0.05, routing=routing, tile=128)
    return m.to(dtype)


def run(m, x, g_out):
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad()
    out, aux = m(x)
    ((out.float() * g_out).sum() + 0.1 * aux).backward()
    return out.detach().clone(), aux.detach().clone(), [t.detach().clone() for t in [x.grad] + [p.grad for p in m.parameters()]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("act,bias,routing", [("swiglu", False, "topk"), ("geglu", True, "topk"),
                                              ("relu_sq", False, "topk"), ("swiglu", False, "round_nearest"),
                                              ("swiglu", True, "round_up"), ("geglu_tanh", True, "topk"),
                                              ("gelu_tanh", False, "topk")])
def test_cuda_matches_cpu(act, bias, routing, dtype):
    m = make_module(act, bias, routing, dtype=dtype)
    T = 512
    x = torch.randn(T, 256).to(dtype)
    if dtype == torch.float32:
        # fp32 inputs run in bf16 on the GPU: give both sides bf16-representable values so that the CPU's fp32
        # routing sees the same logits (up to summation order) and the comparison measures the kernels.
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.bfloat16().float())
        x = x.bfloat16().float()
    g = torch.randn(T, 256)
    out_c, aux_c, grads_c = run(m, x, g)
    mc = m.cuda()
    out_g, aux_g, grads_g = run(mc, x.cuda(), g.cuda())
    tol = 2e-2  # fp32 inputs run in bf16 on the GPU (the kernels are bf16 or f16): bf16 tolerance either way
    assert out_g.device.type == "cuda" and out_g.dtype == dtype
    assert rel_err(out_g, out_c) < tol
    assert abs(aux_g.item() - aux_c.item()) < 1e-3
    for i, (a, b) in enumerate(zip(grads_g, grads_c)):
        assert rel_err(a, b) < 2 * tol, f"grad {i}: {rel_err(a, b):.3g}"


def test_cuda_general_routing_matches_cpu():
    torch.manual_seed(0)
    T, H, I, E = 300, 128, 64, 6
    tok = torch.arange(T).repeat_interleave(2).to(torch.int32)
    exp = torch.stack([torch.randperm(E)[:2].sort().values for _ in range(T)]).flatten().to(torch.int32)
    s = torch.rand(tok.numel())
    w1 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.05
    x = torch.randn(T, H, dtype=torch.bfloat16)
    res = []
    for dev in ("cpu", "cuda"):
        # detach(): leaves of their own per device (x.to("cpu") is x itself, and would otherwise carry
        # requires_grad into the cuda copy, making it a non-leaf without .grad).
        leaf = lambda t: t.detach().to(dev).clone().requires_grad_(True)  # noqa: E731
        xs, ss, a, b = leaf(x), leaf(s), leaf(w1), leaf(w2)
        out = sm.moe_general_routing(xs, tok.to(dev), exp.to(dev), ss, a, None, b, None)
        out.float().square().sum().backward()
        res.append([out, xs.grad, ss.grad, a.grad, b.grad])
    for c, g in zip(*res):
        assert rel_err(g, c) < 3e-2


def test_cuda_memory_is_torch_allocated():
    m = make_module().cuda()
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, aux = m(x)
    torch.cuda.synchronize()
    # Z [T*K, 2I] bf16 alone is 1 MiB here: the caching allocator must have seen sonicmoe's buffers.
    assert torch.cuda.max_memory_allocated() - base >= 1024 * 2 * 256 * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_capture(dtype):
    m = make_module(dtype=dtype).cuda()
    T = 512
    static_x = torch.randn(T, 256, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(T, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up on a side stream, as torch.cuda.graphs requires
            m.zero_grad(set_to_none=False)
            static_x.grad = None
            out, aux = m(static_x)
            (out.float() * g).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    m.zero_grad(set_to_none=False)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_aux = m(static_x)
        (static_out.float() * g).sum().backward()
    new_x = torch.randn(T, 256, device="cuda", dtype=dtype)
    with torch.no_grad():
        static_x.copy_(new_x)
    for p in m.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _, ref_grads = run(m, new_x, g)
    assert rel_err(static_out, ref_out) < 1e-2
    assert rel_err(static_x.grad, ref_grads[0]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_torch_compile(dtype):
    m = make_module(dtype=dtype).cuda()
    x = torch.randn(256, 256, device="cuda", dtype=dtype)
    g = torch.randn(256, 256, device="cuda")
    ref_out, _, ref_grads = run(m, x, g)
    torch._dynamo.reset()
    cm = torch.compile(m, fullgraph=True)
    out, _, grads = run(cm, x, g)
    assert rel_err(out, ref_out) < 1e-2
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) < 1e-2


def test_cuda_topk_op():
    """torch.ops.sonicmoe.topk's kernel (the expert-parallel layer's routing) against the plain-PyTorch selection."""
    from test_ep import check_topk_op
    check_topk_op("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [64, 6])  # the vectorised kernel, and the scalar one (rows of 6 values)
def test_cuda_gather_sum_bad_indices_give_nan_rows_not_a_fault(dtype, H):
    """gather_sum's rev / token_offsets are not read on the host on CUDA: a token whose offsets or rows are out of
    range gets a NaN row and the kernel reads nothing out of bounds (an index of 2^30 would fault and leave the CUDA
    context unusable); -1 (the layer's dropped pair) adds nothing; the other tokens are exact."""
    torch.manual_seed(0)
    rows = torch.randn(6, H, device="cuda").to(dtype)
    i32 = dict(dtype=torch.int32, device="cuda")
    # tokens: 0 -> rows 0, 1; 1 -> row 2**30 (bad); 2 -> rows 3, -1 (dropped); 3 -> rows 4, -5 (bad); 4 -> row 5
    rev = torch.tensor([0, 1, 2 ** 30, 3, -1, 4, -5, 5], **i32)
    rows8 = torch.cat([rows, rows[:2]])  # 8 rows, so that rev has one entry per row
    off = torch.tensor([0, 2, 3, 5, 7, 8], **i32)
    out = torch.ops.sonicmoe.gather_sum(rows8, rev, off)
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()
    torch.testing.assert_close(out[0].float(), (rows[0].float() + rows[1].float()).to(dtype).float())
    torch.testing.assert_close(out[2], rows[3])
    torch.testing.assert_close(out[4], rows[5])
    # offsets out of range (decreasing, past P, negative): those tokens NaN, nothing read
    for bad_off, bad_tok in (([0, 5, 3, 8], 1), ([0, 2, 3, 2 ** 30], 2), ([-7, 2, 3, 8], 0)):
        out = torch.ops.sonicmoe.gather_sum(rows8, torch.arange(8, **i32), torch.tensor(bad_off, **i32))
        assert torch.isnan(out[bad_tok]).all(), bad_off
    torch.cuda.synchronize()  # no sticky CUDA error: the context still works
    ok = torch.ops.sonicmoe.gather_sum(rows8, torch.arange(8, **i32), torch.tensor([0, 8], **i32))
    torch.testing.assert_close(ok[0].float(), rows8.float().sum(0), rtol=1e-2, atol=1e-2)


def _fill_free_memory(value):
    """Blocks of several sizes filled with `value`, then freed: the caching allocator hands their memory (and its
    contents) to the next tensors of those sizes."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full((n // 4,), value, device="cuda") for n in (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 23)
              for _ in range(12)]
    del blocks
    torch.cuda.synchronize()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("main_grad", [False, True])
def test_capacity_rows_past_offsets_never_enter_gradients(precision, main_grad):
    """Under a capacity the pair rows past offsets[E] (dropped pairs) of dZ and s*A are never written; the
    weight-gradient GEMMs read whole k-tiles past each expert's last row and must not sum them: with the allocator's
    free memory full of NaN, every output and gradient is bitwise that of the same step on zeroed memory."""
    torch.manual_seed(0)
    m = sm.MoE(8, 2, 256, 128, capacity_factor=0.6, accumulate_main_grad=main_grad,
               precision=precision).cuda().bfloat16()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 256, generator=g).cuda().bfloat16()
    dy = torch.randn(1000, 256, generator=g).cuda()

    def step(fill):
        for p in m.parameters():
            p.grad = None
            if main_grad:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        _fill_free_memory(fill)
        xs = x.clone().requires_grad_()
        y, aux = m(xs)
        ((y.float() * dy).sum() + 0.1 * aux).backward()
        return [y, aux, xs.grad] + [p.main_grad if main_grad else p.grad for p in m.parameters()]

    ref = step(0.0)
    assert int(m.num_dropped.item()) > 0
    got = step(float("nan"))
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.isfinite(b).all(), i
        assert torch.equal(a, b), i

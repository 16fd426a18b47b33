"""accumulate_main_grad (Megatron's gradient-accumulation fusion) on the CPU: the backward adds each weight's
gradient into the weight's fp32 `main_grad` and leaves `.grad` None. Checked exactly against the fp32 sum, in the
same order, of the gradients computed without the option (fp32 weights; bf16 ones: W1's and W2's are added unrounded
by the library, the rest as their bf16 gradients)."""
import pytest
import torch

import sonicmoe_cpp as sm

PARAMS = ("router.weight", "c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")


def make(cls=sm.MoE, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    m = cls(8, 2, 16, 12, "swiglu", add_bias=True, std=0.3, **kw)
    with torch.no_grad():
        m.c_fc.bias.normal_(0, 0.1)
        m.c_proj.bias.normal_(0, 0.1)
    return m.to(dtype)


def batches(n, dtype=torch.float32, T=10, H=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H, generator=g).to(dtype)) for _ in range(n)]


def step(m, x, d_out):
    x = x.clone().requires_grad_(True)
    out, aux = m(x)
    ((out.float() * d_out.float()).sum() + 0.3 * aux).backward()
    return x.grad


def reference_sums(m, data, names=PARAMS):
    """fp32 sums (in micro-batch order) of the gradients of `names` computed without the option, and the x grads."""
    sums = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in m.named_parameters() if n in names}
    xgrads = []
    for x, d in data:
        m.zero_grad(set_to_none=True)
        xgrads.append(step(m, x, d))
        for n, p in m.named_parameters():
            if n in sums:
                sums[n].add_(p.grad.float())
    m.zero_grad(set_to_none=True)
    return sums, xgrads


def attach(m, names=PARAMS):
    for n, p in m.named_parameters():
        if n in names:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)


def accumulate(m, data):
    return [step(m, x, d) for x, d in data]


@pytest.mark.parametrize("routing,layout", [("topk", False), ("round_nearest", False), ("topk", True)])
def test_main_grad_equals_fp32_sum_and_grad_is_none(routing, layout):
    """(layout: concat_layout=True, W1 and its main_grad in the concatenated layout)"""
    data = batches(4)
    ref = make(routing=routing, tile=4, concat_layout=layout)
    sums, xgrads_ref = reference_sums(ref, data)

    runs = []
    for _ in range(2):  # two identical accumulation sequences
        m = make(routing=routing, tile=4, accumulate_main_grad=True, concat_layout=layout)
        attach(m)
        xgrads = accumulate(m, data)
        for n, p in m.named_parameters():
            assert p.grad is None, n
            assert torch.equal(p.main_grad, sums[n]), n  # exactly: the same fp32 adds in the same order
        for a, b in zip(xgrads, xgrads_ref):
            assert torch.equal(a, b)  # the input gradient is untouched by the option
        runs.append({n: p.main_grad.clone() for n, p in m.named_parameters()})
    for n in PARAMS:
        assert torch.equal(runs[0][n], runs[1][n]), n
        assert runs[0][n].abs().sum() > 0, n


def test_main_grad_only_where_present():
    """Parameters without main_grad get .grad as today; without the module flag main_grad is ignored."""
    data = batches(3)
    sums, _ = reference_sums(make(), data)
    m = make(accumulate_main_grad=True)
    attach(m, names=("c_fc.weight", "router.weight"))
    accumulate(m, data)
    for n, p in m.named_parameters():
        if n in ("c_fc.weight", "router.weight"):
            assert p.grad is None and torch.equal(p.main_grad, sums[n]), n
        else:
            assert not hasattr(p, "main_grad")
            torch.testing.assert_close(p.grad, sums[n], rtol=1e-6, atol=1e-7)  # autograd's own .grad accumulation

    off = make()  # accumulate_main_grad=False (the default): main_grad untouched, .grad as usual
    attach(off)
    accumulate(off, data)
    for n, p in off.named_parameters():
        assert p.grad is not None and p.main_grad.abs().max() == 0, n


def test_main_grad_bf16_params():
    """bf16 weights, fp32 main_grad: W1's, W2's and the router's gradients are added by the library's GEMMs in
    fp32, unrounded (one micro-batch into zeros, rounded to bf16, is the bf16 gradient bitwise; three stay within
    bf16 rounding of the sum of bf16 gradients); the biases' bf16 gradients are added in fp32."""
    data = batches(3, dtype=torch.bfloat16)
    sums, _ = reference_sums(make(dtype=torch.bfloat16), data)
    first, _ = reference_sums(make(dtype=torch.bfloat16), data[:1])
    fused = ("router.weight", "c_fc.weight", "c_proj.weight")
    one = make(dtype=torch.bfloat16, accumulate_main_grad=True)
    attach(one)
    accumulate(one, data[:1])
    m = make(dtype=torch.bfloat16, accumulate_main_grad=True)
    attach(m)
    accumulate(m, data)
    for n, p in m.named_parameters():
        assert p.grad is None and p.main_grad.dtype == torch.float32, n
        if n in fused:
            assert torch.equal(dict(one.named_parameters())[n].main_grad.bfloat16().float(), first[n]), n
            if n != "router.weight":  # (E x H = 64 values: could happen to be the bf16 sums)
                assert not torch.equal(p.main_grad, sums[n]), n  # unrounded: not the sum of bf16 values
            torch.testing.assert_close(p.main_grad, sums[n], rtol=2e-2, atol=1e-2 * sums[n].abs().max().item())
        else:
            assert torch.equal(p.main_grad, sums[n]), n


def test_main_grad_not_fusable_falls_back():
    """A main_grad the GEMMs cannot add into in place (not 16-byte aligned, or not contiguous) gets the bf16
    gradient added by autograd, as for the biases: exactly the fp32 sum of the bf16 gradients."""
    data = batches(2, dtype=torch.bfloat16)
    sums, _ = reference_sums(make(dtype=torch.bfloat16), data)
    m = make(dtype=torch.bfloat16, accumulate_main_grad=True)
    attach(m)
    w1, w2, wr = m.c_fc.weight, m.c_proj.weight, m.router.weight
    w1.main_grad = torch.zeros(w1.numel() + 1)[1:].view(w1.shape)  # 4 bytes past an aligned start
    w2.main_grad = torch.zeros(w2.shape[::-1]).transpose(0, 2)  # a non-contiguous view
    wr.main_grad = torch.zeros(wr.numel() + 2)[2:].view(wr.shape)
    accumulate(m, data)
    for n, p in m.named_parameters():
        assert p.grad is None and torch.equal(p.main_grad, sums[n]), n


def test_main_grad_megatron_protocol_and_errors():
    data = batches(2)
    sums, _ = reference_sums(make(), data)
    m = make(accumulate_main_grad=True)
    attach(m)
    w, b = m.c_fc.weight, m.c_proj.bias
    w.grad_added_to_main_grad = False  # Megatron DDP (overlap_grad_reduce): a dummy grad fires its hooks
    b.grad_added_to_main_grad = False
    b.zero_out_wgrad = True
    accumulate(m, data)
    assert w.grad_added_to_main_grad is True and w.grad is not None and w.grad.shape == w.shape
    assert b.grad_added_to_main_grad is True and b.grad.abs().max() == 0
    assert torch.equal(w.main_grad, sums["c_fc.weight"]) and torch.equal(b.main_grad, sums["c_proj.bias"])
    assert m.router.weight.grad is None

    # a frozen parameter: nothing is added
    m2 = make(accumulate_main_grad=True)
    attach(m2)
    m2.c_proj.weight.requires_grad_(False)
    accumulate(m2, data)
    assert m2.c_proj.weight.main_grad.abs().max() == 0 and m2.c_proj.weight.grad is None
    assert torch.equal(m2.c_fc.weight.main_grad, sums["c_fc.weight"])

    bad = make(accumulate_main_grad=True)
    bad.c_fc.weight.main_grad = torch.zeros(bad.c_fc.weight.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="main_grad of argument 'w1' is torch.bfloat16"):
        bad(torch.randn(4, 16))
    bad.c_fc.weight.main_grad = torch.zeros(3)
    with pytest.raises(ValueError, match="main_grad of argument 'w1'.*expected torch.float32 \\(8, 24, 16\\)"):
        bad(torch.randn(4, 16))
    # inference and no_grad never look at main_grad
    with torch.no_grad():
        bad(torch.randn(4, 16))
    bad(torch.randn(4, 16), is_inference_mode=True)


def test_main_grad_expert_parallel_single_rank():
    """ExpertParallelMoE (R = 1): the router's gradient (logits and aux loss) through an identity Function, the
    experts' through the op."""
    data = batches(3)
    ref = make(sm.ExpertParallelMoE)
    sums, _ = reference_sums(ref, data)
    m = make(sm.ExpertParallelMoE, accumulate_main_grad=True)
    attach(m)
    accumulate(m, data)
    for n, p in m.named_parameters():
        assert p.grad is None and torch.equal(p.main_grad, sums[n]), n
        assert p.main_grad.abs().sum() > 0, n


def test_main_grad_moe_permuted_and_no_rows():
    torch.manual_seed(3)
    E, H, I = 3, 8, 4
    w1 = torch.randn(E, 2 * I, H, requires_grad=True)
    w2 = torch.randn(E, H, I, requires_grad=True)
    tpe = torch.tensor([2, 0, 3])
    x, p = torch.randn(5, H), torch.rand(5)
    sm.moe_permuted(x, tpe, p, w1, None, w2, None).sum().backward()
    g1, g2 = w1.grad.clone(), w2.grad.clone()
    w1.grad = w2.grad = None
    w1.main_grad = torch.zeros(w1.shape)
    sm.moe_permuted(x, tpe, p, w1, None, w2, None, accumulate_main_grad=True).sum().backward()
    assert w1.grad is None and torch.equal(w1.main_grad, g1) and torch.equal(w2.grad, g2)
    # no rows: main_grad unchanged, no .grad for w1, a zero .grad for w2
    w2.grad = None
    out = sm.moe_permuted(torch.zeros(0, H), torch.zeros(E, dtype=torch.int32), torch.zeros(0, requires_grad=True),
                          w1, None, w2, None, accumulate_main_grad=True)
    out.sum().backward()
    assert w1.grad is None and torch.equal(w1.main_grad, g1) and w2.grad.abs().max() == 0


def test_main_grad_sharing_memory_is_refused():
    """A main_grad that is the weight itself (or overlaps another main_grad) would be read by the backward while it
    adds into it: refused, naming both, and the weights stay as they were."""
    m = make(accumulate_main_grad=True)
    x, d = batches(1)[0]
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.c_fc.weight.main_grad = m.c_fc.weight.data  # f32 weights: dtype and shape of a main_grad
    with pytest.raises(ValueError, match=r"main_grad of argument 'w1' overlaps argument 'w1'"):
        step(m, x, d)
    attach(m)
    flat = torch.zeros(m.c_fc.weight.numel() + m.c_proj.weight.numel())
    m.c_fc.weight.main_grad = flat[: m.c_fc.weight.numel()].view(m.c_fc.weight.shape)
    m.c_proj.weight.main_grad = flat[-m.c_proj.weight.numel() - 1: -1].view(m.c_proj.weight.shape)  # one shared
    with pytest.raises(ValueError, match=r"main_grad of argument 'w1' overlaps the main_grad of argument 'w2'"):
        step(m, x, d)
    for n, p in m.named_parameters():
        assert torch.equal(p.detach(), before[n]), n

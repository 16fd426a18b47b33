"""Expert parallelism (sonicmoe_cpp.ep) on the CPU: moe_permuted and moe_deepep against general routing and the
float64 reference; the two-part backward ops against the fused backward (bitwise); ExpertParallelMoE over gloo with
world sizes 1, 2 and 4, unchunked and in 2 and 3 chunks, against the single-process MoE with the same weights (output,
aux loss and every gradient), its overlapped backward against the unsplit one (bitwise)."""

import math

import pytest
import torch

import gloo_world

import sonicmoe_cpp as sm
from reference import GLU, experts, topk_reference

TOL = 1e-5  # fp32 against fp32 (the CPU backend computes in fp32): only the summation order differs


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0 if a.numel() == 0 else float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def weights(E, H, I, act, bias, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    zw = 2 * I if act in GLU else I
    r = lambda *s, scale=0.3: (torch.randn(*s, generator=g) * scale).to(dtype).requires_grad_(True)
    return dict(w1=r(E, zw, H), b1=r(E, zw, scale=0.1) if bias else None, w2=r(E, H, I),
                b2=r(E, H, scale=0.1) if bias else None)


def grads(ts):
    return {k: v.grad.clone() for k, v in ts.items() if v is not None}


def clear(ts):
    for v in ts.values():
        if v is not None:
            v.grad = None


# ---------------------------------------------------------------------------------------------------------------
# moe_permuted / moe_deepep, one process


@pytest.mark.parametrize("act,bias", [("swiglu", False), ("gelu", True)])
def test_moe_permuted_matches_general_routing(act, bias):
    E, H, I = 5, 16, 12
    tpe = torch.tensor([3, 0, 7, 1, 4])  # expert 1 gets no rows
    N = int(tpe.sum())
    w = weights(E, H, I, act, bias)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(N, H, generator=g)
    p0 = torch.rand(N, generator=g)
    d_out = torch.randn(N, H, generator=g)

    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    out = sm.moe_permuted(x, tpe, p, w["w1"], w["b1"], w["w2"], w["b2"], act)
    assert out.shape == (N, H) and out.dtype == torch.float32
    (out * d_out).sum().backward()
    ours = dict(x=x.grad, p=p.grad, **grads(w))
    clear(w)

    # the same pairs through moe_general_routing
    eid = torch.repeat_interleave(torch.arange(E), tpe).int()
    xr, pr = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    ref = sm.moe_general_routing(xr, torch.arange(N, dtype=torch.int32), eid, pr, w["w1"], w["b1"], w["w2"], w["b2"],
                                 act)
    (ref * d_out).sum().backward()
    assert rel_err(out, ref) < TOL
    for k, v in dict(x=xr.grad, p=pr.grad, **grads(w)).items():
        assert rel_err(ours[k], v) < TOL, k
    clear(w)

    # and against the float64 reference: out[r] = p[r] * expert_e(r)(x[r])
    wd = {k: (v.detach().double().requires_grad_() if v is not None else None) for k, v in w.items()}
    xd, pd = x0.double().requires_grad_(), p0.double().requires_grad_()
    refd = experts(xd, torch.arange(N), eid.long(), pd, wd["w1"], wd["b1"], wd["w2"], wd["b2"], act)
    (refd * d_out.double()).sum().backward()
    assert rel_err(out, refd) < 1e-4
    assert rel_err(ours["p"], pd.grad) < 1e-4 and rel_err(ours["x"], xd.grad) < 1e-4
    assert rel_err(ours["w1"], wd["w1"].grad) < 1e-4 and rel_err(ours["w2"], wd["w2"].grad) < 1e-4
    assert ours["w1"][1].abs().max() == 0  # the expert without rows


def test_moe_permuted_contract_errors():
    E, H, I = 3, 8, 4
    w = weights(E, H, I, "swiglu", False)
    x, p = torch.randn(6, H), torch.rand(6)
    args = (w["w1"], None, w["w2"], None)
    with pytest.raises(ValueError, match="tokens_per_expert.*sums to 5, expected N = 6"):
        sm.moe_permuted(x, torch.tensor([2, 2, 1]), p, *args)
    with pytest.raises(ValueError, match="tokens_per_expert.*expected \\[E_local\\] = \\[3\\]"):
        sm.moe_permuted(x, torch.tensor([2, 4]), p, *args)
    with pytest.raises(ValueError, match="tokens_per_expert.*negative"):
        sm.moe_permuted(x, torch.tensor([4, -1, 3]), p, *args)
    with pytest.raises(ValueError, match="tokens_per_expert.*integer dtype"):
        sm.moe_permuted(x, torch.tensor([2.0, 2.0, 2.0]), p, *args)
    with pytest.raises(ValueError, match="'probs'.*expected \\[N\\] = \\[6\\]"):
        sm.moe_permuted(x, torch.tensor([2, 2, 2]), torch.rand(5), *args)
    with pytest.raises(ValueError, match="'w1'"):
        sm.moe_permuted(x, torch.tensor([2, 2, 2]), p, w["w1"][:, :, :4], None, w["w2"], None)
    # no rows: a [0, H] output, zero (not None) weight gradients
    x0 = torch.zeros(0, H, requires_grad=True)
    out = sm.moe_permuted(x0, torch.zeros(E, dtype=torch.int32), torch.zeros(0, requires_grad=True), *args)
    assert out.shape == (0, H)
    out.sum().backward()
    assert w["w1"].grad is not None and w["w1"].grad.abs().max() == 0


@pytest.mark.parametrize("act,bias", [("swiglu", True), ("relu_sq", False)])
def test_moe_deepep_matches_reference(act, bias):
    E, H, I, N, K = 4, 16, 8, 9, 3
    w = weights(E, H, I, act, bias, seed=2)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(N, H, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:K] for _ in range(N)]) - 2  # ids in [-2, 4): -2, -1 -> -1
    idx = idx.clamp_min(-1)
    idx[4] = -1  # a row with no local expert
    wt0 = torch.rand(N, K, generator=g)
    d_out = torch.randn(N, H, generator=g)

    x, wt = x0.clone().requires_grad_(), wt0.clone().requires_grad_()
    out = sm.moe_deepep(x, idx, wt, w["w1"], w["b1"], w["w2"], w["b2"], act, debug=True)
    (out * d_out).sum().backward()
    assert out[4].abs().max() == 0
    assert (wt.grad[idx < 0] == 0).all(), "weights of experts on other ranks must get a zero gradient"

    valid = idx >= 0
    rows, cols = valid.nonzero(as_tuple=True)
    wd = {k: (v.detach().double().requires_grad_() if v is not None else None) for k, v in w.items()}
    xd, wtd = x0.double().requires_grad_(), wt0.double().requires_grad_()
    ref = experts(xd, rows, idx[rows, cols], wtd[rows, cols], wd["w1"], wd["b1"], wd["w2"], wd["b2"], act)
    (ref * d_out.double()).sum().backward()
    assert rel_err(out, ref) < 1e-4
    assert rel_err(x.grad, xd.grad) < 1e-4
    assert rel_err(wt.grad, wtd.grad) < 1e-4
    for k in ("w1", "b1", "w2", "b2"):
        if w[k] is not None:
            assert rel_err(w[k].grad, wd[k].grad) < 1e-4, k


def test_moe_deepep_contract_errors():
    E, H, I = 3, 8, 4
    w = weights(E, H, I, "swiglu", False)
    args = (w["w1"], None, w["w2"], None)
    x = torch.randn(4, H)
    idx = torch.tensor([[0, -1], [2, 1], [-1, -1], [1, 0]])
    wt = torch.rand(4, 2)
    with pytest.raises(ValueError, match="recv_topk_idx.*ids in \\[-1, 3\\].*\\[0, 3\\)"):
        sm.moe_deepep(x, idx + (idx >= 0).long(), wt, *args, debug=True)
    with pytest.raises(ValueError, match="recv_topk_idx.*ids in \\[-2, 2\\]"):
        sm.moe_deepep(x, torch.where(idx < 0, -2, idx), wt, *args, debug=True)
    with pytest.raises(ValueError, match="recv_topk_weights.*expected \\(4, 2\\)"):
        sm.moe_deepep(x, idx, torch.rand(4, 3), *args)
    with pytest.raises(ValueError, match="recv_topk_idx.*integer dtype"):
        sm.moe_deepep(x, idx.float(), wt, *args)
    with pytest.raises(ValueError, match="recv_topk_idx.*expected \\[N, K\\] with N = 4"):
        sm.moe_deepep(x, idx[:3], wt[:3], *args)
    with pytest.raises(ValueError):  # an id >= E_local is rejected by the op even without debug
        sm.moe_deepep(x, idx + 1, wt, *args)
    # no rows
    out = sm.moe_deepep(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), *args)
    assert out.shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum(dtype):
    """torch.ops.sonicmoe.gather_sum (the layer's aggregation stage alone): out[t] = sum of rows[rev[p]] over token
    t's p, in p order, fp32 accumulation; the EP layer's combine."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 16, generator=g).to(dtype)
    rev = torch.randperm(9, generator=g).int()
    tok_off = torch.tensor([0, 2, 2, 3, 7, 9], dtype=torch.int32)  # token 1 has no rows
    out = torch.ops.sonicmoe.gather_sum(rows, rev, tok_off)
    ref = torch.stack([rows.float()[rev[a:b].long()].sum(0) for a, b in zip(tok_off[:-1], tok_off[1:])]).to(dtype)
    assert out.dtype == dtype and out.shape == (5, 16)
    assert torch.equal(out, ref) if dtype == torch.bfloat16 else rel_err(out, ref) < 1e-6
    assert torch.ops.sonicmoe.gather_sum(rows[:0], rev[:0], tok_off[:1]).shape == (0, 16)
    with pytest.raises(Exception, match="one per row"):
        torch.ops.sonicmoe.gather_sum(rows, rev[:4], tok_off)


def check_topk_op(device):
    """torch.ops.sonicmoe.topk against topk_reference on `device`: random logits at awkward sizes (E not a power of
    two, K = 1 and K = E), rows with ties (logits rounded to a coarse grid), no rows."""
    g = torch.Generator().manual_seed(21)
    for T, E, k in ((37, 60, 8), (300, 128, 8), (5, 7, 7), (19, 3, 1), (0, 16, 2)):
        logits = torch.randn(T, E, generator=g)
        logits[: T // 2] = (logits[: T // 2] * 2).round() / 2  # many ties
        logits = logits.to(device)
        ids, scores, counts = torch.ops.sonicmoe.topk(logits, k)
        r_ids, r_scores, r_counts = topk_reference(logits, k)
        assert ids.dtype == counts.dtype == torch.int32 and scores.dtype == torch.float32
        assert ids.shape == (T, k) and scores.shape == (T, k) and counts.shape == (E,)
        assert torch.equal(ids.long(), r_ids), (T, E, k)
        assert torch.equal(counts.long(), r_counts), (T, E, k)
        torch.testing.assert_close(scores, r_scores, rtol=1e-6, atol=1e-7)
    for bad_k in (0, 17):
        with pytest.raises(Exception, match="'k'"):
            torch.ops.sonicmoe.topk(torch.randn(4, 16, device=device), bad_k)
    with pytest.raises(Exception, match="dtype"):
        torch.ops.sonicmoe.topk(torch.randn(4, 16, device=device, dtype=torch.float64), 2)


def test_topk_op():
    check_topk_op("cpu")


def test_gemm_sm_margin():
    """set_gemm_sm_margin: process-wide, read back, negative refused; results do not depend on it (on the CPU it does
    nothing; on the GPU the persistent GEMMs' grids shrink, each tile computed the same)."""
    torch.manual_seed(4)
    moe = sm.MoE(8, 2, 16, 12)
    x = torch.randn(10, 16)
    ref, _ = moe(x)
    assert sm.gemm_sm_margin() == 0
    try:
        sm.set_gemm_sm_margin(16)
        assert sm.gemm_sm_margin() == 16
        out, _ = moe(x)
        assert torch.equal(out, ref)
        with pytest.raises(ValueError, match="expected >= 0"):
            sm.set_gemm_sm_margin(-1)
        with pytest.raises(TypeError):
            sm.set_gemm_sm_margin(1.5)
    finally:
        sm.set_gemm_sm_margin(0)
    assert sm.gemm_sm_margin() == 0


def test_state_dict_shards_round_trip():
    moe = sm.MoE(8, 2, 16, 12, "swiglu", add_bias=True)
    sd = moe.state_dict()
    shards = [sm.shard_moe_state_dict(sd, r, 4) for r in range(4)]
    assert shards[1]["c_fc.weight"].shape == (2, 24, 16) and shards[3]["c_proj.bias"].shape == (2, 16)
    assert torch.equal(shards[2]["c_proj.weight"], sd["c_proj.weight"][4:6])
    assert torch.equal(shards[3]["router.weight"], sd["router.weight"])
    back = sm.unshard_moe_state_dicts(shards)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="not divisible"):
        sm.shard_moe_state_dict(sd, 0, 3)
    shards[1]["router.weight"] = shards[1]["router.weight"] + 1
    with pytest.raises(ValueError, match="router.weight.*differs"):
        sm.unshard_moe_state_dicts(shards)
    # R = 1 without torch.distributed: the layer holds every expert
    ep = sm.ExpertParallelMoE.from_moe(moe)
    assert ep.num_local_experts == 8 and all(torch.equal(ep.state_dict()[k], sd[k]) for k in sd)


@pytest.mark.parametrize("routing,act,bias,consume", [("general", "swiglu", False, True),
                                                       ("general", "gelu", True, False),
                                                       ("topk", "swiglu", True, True), ("topk", "relu_sq", False, False)])
def test_split_backward_equals_fused(routing, act, bias, consume):
    """torch.ops.sonicmoe.backward_act then backward_weights (the two-part backward the EP layer overlaps with its
    dispatch's reverse exchange) give bitwise what torch.ops.sonicmoe.backward gives, with dZ written over z or not."""
    E, H, I, T, K = 6, 16, 12, 11, 2
    w = {k: (v.detach() if v is not None else None) for k, v in weights(E, H, I, act, bias, seed=5).items()}
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g)
    d_out = torch.randn(T, H, generator=g)
    router = torch.randn(E, H, generator=g) * 0.3
    if routing == "general":
        tok = torch.tensor([0, 0, 1, 2, 2, 3, 5, 6, 6, 7, 9, 10], dtype=torch.int32)
        exp = torch.tensor([1, 4, 0, 2, 3, 1, 5, 0, 1, 3, 3, 2], dtype=torch.int32)
        sc = torch.rand(tok.shape[0], generator=g)
        args = (x, None, w["w1"], w["b1"], w["w2"], w["b2"], act, 1, "general", 128, tok, exp, sc)
    else:
        args = (x, router, w["w1"], w["b1"], w["w2"], w["b2"], act, K, "topk", 128, None, None, None)
    d_aux = torch.tensor([0.3]) if routing != "general" else None  # (general routing has no aux loss: refused)
    outs = []
    for split in (False, True):
        fwd = torch.ops.sonicmoe.forward(*args)
        state = [t.clone() for t in fwd[2:]]
        head = (d_out, x, args[1], w["w1"], w["b1"], w["w2"], w["b2"], act, args[7], routing, *state)
        if split:
            for dw2_first in (False, True):
                state = [t.clone() for t in fwd[2:]]
                head = (d_out, x, args[1], w["w1"], w["b1"], w["w2"], w["b2"], act, args[7], routing, *state)
                dx, drouter, dscore, dz, a_s, dw2_1, db2_1 = torch.ops.sonicmoe.backward_act(
                    *head, d_aux, consume, True, dw2_in_part1=dw2_first)
                assert (dz.numel() == 0) == consume and (a_s.numel() == 0) == dw2_first
                assert (dw2_1.numel() > 0) == dw2_first
                dw1, db1, dw2, db2 = torch.ops.sonicmoe.backward_weights(*head, state[0] if consume else dz, a_s)
                if dw2_first:
                    assert dw2.numel() == 0 and db2.numel() == 0
                    dw2, db2 = dw2_1, db2_1
                outs.append((dx, dw1, db1, dw2, db2, drouter, dscore))
        else:
            outs.append(torch.ops.sonicmoe.backward(*head, d_aux, consume, True))
    names = ("dx", "dw1", "db1", "dw2", "db2", "drouter", "dscore")
    for i, split in enumerate(outs[1:], 1):
        for n, a, b in zip(names, outs[0], split):
            assert torch.equal(a, b), (i, n)
    assert outs[0][1].abs().max() > 0 and outs[0][0].abs().max() > 0
    if routing == "topk":
        assert outs[0][5].abs().max() > 0


def test_split_backward_errors():
    E, H, I, T = 3, 8, 4, 5
    w = {k: (v.detach() if v is not None else None) for k, v in weights(E, H, I, "swiglu", False).items()}
    x = torch.randn(T, H)
    tok = torch.arange(T, dtype=torch.int32)
    exp = torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32)
    fwd = torch.ops.sonicmoe.forward(x, None, w["w1"], None, w["w2"], None, "swiglu", 1, "general", 128, tok, exp,
                                     torch.rand(T))
    head = (torch.randn(T, H), x, None, w["w1"], None, w["w2"], None, "swiglu", 1, "general", *fwd[2:])
    _, _, _, dz, a_s, _, _ = torch.ops.sonicmoe.backward_act(*head, None, False, False)
    with pytest.raises(Exception, match="backward_weights.*keep.as"):
        torch.ops.sonicmoe.backward_weights(*head, dz, a_s[:, :2].contiguous())
    with pytest.raises(Exception, match="backward_weights.*'dz'.*dtype"):
        torch.ops.sonicmoe.backward_weights(*head, dz.double(), a_s)


# ---------------------------------------------------------------------------------------------------------------
# ExpertParallelMoE over gloo

# name: (E, K, H, I, activation, bias, tokens per rank for R ranks, skewed router)
CASES = {
    "topk2": (8, 2, 16, 12, "swiglu", False, lambda R: [5, 7, 3, 6][:R], False),
    # expert 0 favoured, experts 4..7 never chosen: uneven loads, experts without tokens; with R = 2 rank 1 receives
    # no rows and rank 0's tokens all stay on rank 0; with R = 4 ranks 2 and 3 receive nothing
    "skewed": (8, 2, 16, 12, "swiglu", True, lambda R: [9, 4, 6, 5][:R], True),
    # a rank with no tokens (T = 0) sends nothing
    "empty_rank": (8, 3, 16, 8, "gelu", True, lambda R: [6] if R == 1 else [6, 0, 4, 0][:R], False),
    "k1": (8, 1, 16, 12, "relu_sq", False, lambda R: [4, 9, 1, 5][:R], False),
    "k4": (8, 4, 16, 8, "geglu", False, lambda R: [8, 3, 5, 2][:R], False),
}


CHUNKS = (1, 2, 3)  # ExpertParallelMoE(chunks=...): unpipelined, and pipelined with uneven chunks


def _case_errors(name, rank, R, group):
    import torch.distributed as dist
    E, K, H, I, act, bias, ts, skewed = CASES[name]
    Ts = ts(R)
    torch.manual_seed(100 + len(name))  # the same full layer and data on every rank
    full = sm.MoE(E, K, H, I, act, add_bias=bias, std=0.3)
    if bias:
        with torch.no_grad():
            full.c_fc.bias.normal_(0, 0.1)
            full.c_proj.bias.normal_(0, 0.1)
    xs = [torch.randn(T, H) for T in Ts]
    if skewed:
        xs = [x.abs() for x in xs]
        with torch.no_grad():
            full.router.weight[0] += 0.5
            full.router.weight[4:] = -1.0
    d_outs = [torch.randn(T, H) for T in Ts]
    c_aux = 0.37

    # the single-process layer on the concatenated batch
    x_all = torch.cat(xs).requires_grad_(True)
    out_ref, aux_ref = full(x_all)
    ((out_ref * torch.cat(d_outs)).sum() + c_aux * aux_ref).backward()

    lo, hi = sum(Ts[:rank]), sum(Ts[:rank + 1])
    El = E // R
    sl = slice(rank * El, (rank + 1) * El)
    errs = {}
    nodes = {}

    def step(ep):
        """This rank's forward and backward through ep: (out, aux, x), x.grad and the parameters' grads set."""
        ep.zero_grad(set_to_none=True)
        x = xs[rank].clone().requires_grad_(True)
        out, aux = ep(x)
        ((out * d_outs[rank]).sum() + c_aux * aux).backward()
        return out, aux, x

    for chunks in CHUNKS:  # the pipelined exchange, this rank's tokens in `chunks` ranges (some empty when T < chunks)
        ep = sm.ExpertParallelMoE(E, K, H, I, act, add_bias=bias, std=0.3, ep_group=group, chunks=chunks,
                                  dispatch="all_to_all")
        ep.load_state_dict(sm.shard_moe_state_dict(full.state_dict(), rank, R))
        runs = []
        for _ in range(2 if chunks == 2 else 1):  # twice: bitwise the same
            out, aux, x = step(ep)
            runs.append([out.detach(), x.grad, ep.router.weight.grad.clone(), ep.c_fc.weight.grad.clone()])
        if len(runs) == 2:
            errs[f"C{chunks}.repeat"] = 0.0 if all(torch.equal(a, b) for a, b in zip(*runs)) else 1.0
        # the unsplit backward (overlap_backward=False: the op's own backward, the exchanges as separate nodes) gives
        # bitwise the same output and gradients
        ep.overlap_backward = False
        out_f, _, xf = step(ep)
        fused = [out_f.detach(), xf.grad] + [p.grad for p in ep.parameters()]
        if chunks == 1:
            unsplit_a2a = fused
        ep.overlap_backward = True
        out, aux, x = step(ep)
        split = [out.detach(), x.grad] + [p.grad for p in ep.parameters()]
        nodes[chunks] = (_graph_nodes(out_f.grad_fn), _graph_nodes(out.grad_fn))
        ep.overlap_dw2 = False  # dW2 before the exchange: the same results
        out2, _, x2 = step(ep)
        split_dw2_first = [out2.detach(), x2.grad] + [p.grad for p in ep.parameters()]
        ep.overlap_dw2 = True
        if not all(torch.equal(a, b) for a, b in zip(split_dw2_first, fused)):
            split = []  # reported as split_vs_fused below
        errs[f"C{chunks}.split_vs_fused"] = 0.0 if split and all(torch.equal(a, b) for a, b in zip(split, fused)) \
            else 1.0
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad, group=group)  # the replicated router: sum its gradient over the group
        errs.update({
            f"C{chunks}.out": rel_err(out, out_ref[lo:hi]),
            f"C{chunks}.aux": abs(aux.item() - aux_ref.item()) / max(1.0, abs(aux_ref.item())),
            f"C{chunks}.x.grad": rel_err(x.grad, x_all.grad[lo:hi]),
            f"C{chunks}.router.grad": rel_err(router_grad, full.router.weight.grad),
            f"C{chunks}.c_fc.weight.grad": rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
            f"C{chunks}.c_proj.weight.grad": rel_err(ep.c_proj.weight.grad, full.c_proj.weight.grad[sl]),
        })
        if bias:
            errs[f"C{chunks}.c_fc.bias.grad"] = rel_err(ep.c_fc.bias.grad, full.c_fc.bias.grad[sl])
            errs[f"C{chunks}.c_proj.bias.grad"] = rel_err(ep.c_proj.bias.grad, full.c_proj.bias.grad[sl])
    # the all-gather dispatch (chunks = 1, unsplit backward): against the reference, and against the all-to-all
    # dispatch's unsplit run (bitwise at R <= 2: the same sums in the same order)
    ep = sm.ExpertParallelMoE(E, K, H, I, act, add_bias=bias, std=0.3, ep_group=group, dispatch="all_gather")
    ep.load_state_dict(sm.shard_moe_state_dict(full.state_dict(), rank, R))
    out, aux, x = step(ep)
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=group)
    errs.update({
        "AG.out": rel_err(out, out_ref[lo:hi]),
        "AG.aux": abs(aux.item() - aux_ref.item()) / max(1.0, abs(aux_ref.item())),
        "AG.x.grad": rel_err(x.grad, x_all.grad[lo:hi]),
        "AG.router.grad": rel_err(router_grad, full.router.weight.grad),
        "AG.c_fc.weight.grad": rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
        "AG.c_proj.weight.grad": rel_err(ep.c_proj.weight.grad, full.c_proj.weight.grad[sl]),
    })
    if bias:
        errs["AG.c_fc.bias.grad"] = rel_err(ep.c_fc.bias.grad, full.c_fc.bias.grad[sl])
        errs["AG.c_proj.bias.grad"] = rel_err(ep.c_proj.bias.grad, full.c_proj.bias.grad[sl])
    ag = [out.detach(), x.grad] + [p.grad for p in ep.parameters()]
    errs["AG.vs_all_to_all"] = max(rel_err(a, b) if a.numel() else 0.0 for a, b in zip(ag, unsplit_a2a))
    errs["AG.bitwise_vs_all_to_all"] = 0.0 if all(torch.equal(a, b) for a, b in zip(ag, unsplit_a2a)) else 1.0
    info_nodes_ag = _graph_nodes(out.grad_fn)
    gathered = ep.full_state_dict()
    errs["full_state_dict"] = max(rel_err(gathered[k], v) for k, v in full.state_dict().items())
    # facts about the case, checked by the tests
    with torch.no_grad():
        ids = torch.topk(torch.cat(xs) @ full.router.weight.t(), K, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    info = {"counts": counts.tolist(), "shape": list(out.shape), "nodes": nodes, "nodes_ag": info_nodes_ag}
    return errs, info


def _graph_nodes(fn):
    """The names of the autograd nodes reachable from fn."""
    seen, todo, names = set(), [fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return sorted(names)


def _main_grad_errors(rank, R):
    """accumulate_main_grad=True through the overlapped backward, two steps, chunks 1 and 2: .grad stays None; each
    weight's fp32 main_grad equals, bitwise, the unsplit backward's (overlap_backward=False) and, within fp32
    tolerance, the sum of the .grad of the layer without main_grad (bitwise for chunks = 1; with 2 chunks main_grad
    adds each chunk's part separately, .grad their sum)."""
    torch.manual_seed(11)
    full = sm.MoE(8, 2, 16, 12, "swiglu", add_bias=True, std=0.3)
    xs = [torch.randn(6 + rank, 16) for _ in range(2)]
    errs = {}
    for chunks in (1, 2):
        ref = sm.ExpertParallelMoE.from_moe(full, chunks=chunks)
        mgs = [sm.ExpertParallelMoE.from_moe(full, chunks=chunks, overlap_backward=o) for o in (True, False)]
        for m in mgs:
            m.accumulate_main_grad = True
            for p in m.parameters():
                p.main_grad = torch.zeros(p.shape)
        for x in xs:
            for layer in (ref, *mgs):
                out, aux = layer(x)
                (out.square().sum() + aux).backward()
        split, fused = mgs
        errs[f"C{chunks}.grad_none"] = all(p.grad is None for m in mgs for p in m.parameters())
        errs[f"C{chunks}.split_vs_fused"] = all(torch.equal(p.main_grad, q.main_grad)
                                                for p, q in zip(split.parameters(), fused.parameters()))
        errs[f"C{chunks}.vs_grad"] = max(rel_err(p.main_grad, q.grad) for p, q in zip(split.parameters(),
                                                                                     ref.parameters()))
        if chunks == 1:
            errs["C1.vs_grad_bitwise"] = all(torch.equal(p.main_grad, q.grad)
                                             for p, q in zip(split.parameters(), ref.parameters()))
    # the all-gather dispatch: main_grad against the .grad of chunks = 1 (same sums, up to the order of the R partial
    # rows of each token)
    ref = sm.ExpertParallelMoE.from_moe(full, dispatch="all_to_all")
    ag = sm.ExpertParallelMoE.from_moe(full, dispatch="all_gather")
    ag.accumulate_main_grad = True
    for p in ag.parameters():
        p.main_grad = torch.zeros(p.shape)
    for x in xs:
        for layer in (ref, ag):
            out, aux = layer(x)
            (out.square().sum() + aux).backward()
    errs["AG.grad_none"] = all(p.grad is None for p in ag.parameters())
    errs["AG.vs_grad"] = max(rel_err(p.main_grad, q.grad) for p, q in zip(ag.parameters(), ref.parameters()))
    return errs


def _overlap_group_equal(rank, R):
    """overlap_group (a second group over the same ranks, for the overlapped backward's exchange): bitwise the same
    output and gradients as without it; a group of another size is refused."""
    import torch.distributed as dist
    torch.manual_seed(12)
    full = sm.MoE(8, 2, 16, 12, "swiglu", std=0.3)
    x0 = torch.randn(5 + 2 * rank, 16)
    second = dist.new_group(list(range(R)))
    res = []
    for grp in (None, second):
        ep = sm.ExpertParallelMoE.from_moe(full, chunks=2, overlap_backward=True, overlap_group=grp)
        x = x0.clone().requires_grad_(True)
        out, aux = ep(x)
        (out.square().sum() + aux).backward()
        res.append([out.detach(), x.grad] + [p.grad for p in ep.parameters()])
    ok = all(torch.equal(a, b) for a, b in zip(*res))
    if R > 1:
        solo = dist.new_group([0])  # every rank takes part in creating it
        try:
            sm.ExpertParallelMoE.from_moe(full, overlap_backward=True, overlap_group=solo if rank == 0 else dist.GroupMember.NON_GROUP_MEMBER)
            ok = False
        except (ValueError, RuntimeError):
            pass
    return ok


# Router variants (MoE's router keywords) and their routed experts: Qwen3 / OLMoE, DeepSeek-V3 (sigmoid, selection
# bias, 4 groups of which 2 kept, renormalised, scaled).
ROUTERS = {
    "qwen3": dict(softmax_over_topk=False, norm_topk_probs=True),
    "deepseek_v3": dict(scoring_func="sigmoid", e_score_correction_bias=True, n_group=4, topk_group=2,
                        norm_topk_probs=True, routed_scaling_factor=2.5),
}


def _whole_batch(full, Ts, H, rank, R):
    """Every rank's tokens (Ts[r] rows of H, drawn from the current seed) and the reference step of the full MoE (8
    experts) on their concatenation, loss out^2 + 0.3 aux: (xs, x_all with its .grad, out_ref, aux_ref, this rank's
    rows lo:hi, its experts' slice)."""
    xs = [torch.randn(T, H) for T in Ts]
    x_all = torch.cat(xs).requires_grad_(True)
    out_ref, aux_ref = full(x_all)
    (out_ref.square().sum() + 0.3 * aux_ref).backward()
    return (xs, x_all, out_ref, aux_ref, sum(Ts[:rank]), sum(Ts[:rank + 1]),
            slice(rank * (8 // R), (rank + 1) * (8 // R)))


def _ep_step(ep, x_rank, R):
    """One step of `ep` on this rank's tokens with _whole_batch's loss: (x with its .grad, out, aux, the router's
    gradient summed over the ranks)."""
    import torch.distributed as dist
    x = x_rank.clone().requires_grad_(True)
    out, aux = ep(x)
    (out.square().sum() + 0.3 * aux).backward()
    router_grad = ep.router.weight.grad.clone()
    if R > 1:
        dist.all_reduce(router_grad)
    return x, out, aux, router_grad


def _per_rank_runs(full, xs):
    """`full` (a MoE with a capacity) on each rank's tokens alone, loss out^2: [(out, x's gradient, num_dropped as an
    int)] per rank; the parameters' gradients add up over the runs."""
    runs = []
    for x_r in xs:
        x_r = x_r.clone().requires_grad_(True)
        out_r, _ = full(x_r)
        out_r.square().sum().backward()
        runs.append((out_r.detach(), x_r.grad, int(full.num_dropped.item())))
    return runs


def _capacity_errors(rank, R):
    """capacity_factor (per rank): ExpertParallelMoE.from_moe of a MoE with a capacity, both dispatches and the
    overlapped backward in 2 chunks (precision "fp8" too, without the overlap), against that MoE run on each rank's
    tokens alone (_per_rank_runs): output, x's gradient and num_dropped per rank; the router's gradient summed over
    the ranks and the local experts' against the MoE's summed over every rank's run; the aux loss against the MoE on
    the concatenated batch (it counts the router's choices before the drop)."""
    errs, dropped = {}, {}
    for factor in (0.5, 1.25):
        torch.manual_seed(23)
        full = sm.MoE(8, 2, 16, 12, "swiglu", std=0.3, add_bias=True, capacity_factor=factor)
        xs = [torch.randn(T, 16) for T in [7, 4, 9, 5][:R]]
        runs = _per_rank_runs(full, xs)
        with torch.no_grad():
            _, aux_all = full(torch.cat(xs))
        sl = slice(rank * (8 // R), (rank + 1) * (8 // R))
        for chunks, overlap, dispatch in ((1, False, "all_to_all"), (1, False, "all_gather"), (2, True, "auto")):
            ep = sm.ExpertParallelMoE.from_moe(full, chunks=chunks, overlap_backward=overlap, dispatch=dispatch)
            x = xs[rank].clone().requires_grad_(True)
            out, aux = ep(x)
            out.square().sum().backward()
            router_grad = ep.router.weight.grad.clone()
            if R > 1:
                import torch.distributed as dist
                dist.all_reduce(router_grad)
            tag = f"cf{factor}.C{chunks}" + (".AG" if dispatch == "all_gather" else "")
            out_ref, x_grad_ref, dropped_ref = runs[rank]
            errs.update({f"{tag}.out": rel_err(out, out_ref), f"{tag}.x.grad": rel_err(x.grad, x_grad_ref),
                         f"{tag}.aux": abs(aux.item() - aux_all.item()) / max(1.0, abs(aux_all.item())),
                         f"{tag}.router.grad": rel_err(router_grad, full.router.weight.grad)})
            for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
                mod, attr = name.split(".")
                errs[f"{tag}.{name}.grad"] = rel_err(getattr(getattr(ep, mod), attr).grad,
                                                     getattr(getattr(full, mod), attr).grad[sl])
            dropped[tag] = (int(ep.num_dropped.item()), dropped_ref)
    # precision "fp8" under a capacity: the kept pairs' rows in the FP8 layer, as MoE(precision="fp8") on each rank's
    # tokens quantises them
    torch.manual_seed(29)
    full = sm.MoE(8, 2, 128, 128, "swiglu", std=0.05, capacity_factor=0.5, precision="fp8")
    xs = [torch.randn(T, 128) for T in [9, 5, 12, 7][:R]]
    runs = _per_rank_runs(full, xs)
    sl = slice(rank * (8 // R), (rank + 1) * (8 // R))
    for dispatch in ("all_to_all", "all_gather"):
        ep = sm.ExpertParallelMoE.from_moe(full, dispatch=dispatch)
        x = xs[rank].clone().requires_grad_(True)
        out, _ = ep(x)
        out.square().sum().backward()
        out_ref, x_grad_ref, dropped_ref = runs[rank]
        tag = f"fp8.{dispatch}"
        errs.update({f"{tag}.out": rel_err(out, out_ref), f"{tag}.x.grad": rel_err(x.grad, x_grad_ref),
                     f"{tag}.c_fc.weight.grad": rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
                     f"{tag}.c_proj.weight.grad": rel_err(ep.c_proj.weight.grad, full.c_proj.weight.grad[sl])})
        dropped[tag] = (int(ep.num_dropped.item()), dropped_ref)
    return errs, dropped


def _forward_keywords(rank, R):
    """forward's kernel_backend_moe / is_inference_mode (MoE's keywords), with each dispatch: inference bitwise the
    training output with aux None and no graph; KernelBackendMoE.sonicmoe_fp8 on a bf16 module bitwise the module
    built with precision "fp8" (its cached quantised weights against the call's own)."""
    out = {}
    torch.manual_seed(41)
    full = sm.MoE(8, 2, 128, 128, "swiglu", std=0.3)
    full8 = sm.MoE(8, 2, 128, 128, "swiglu", std=0.3, precision="fp8")
    full8.load_state_dict(full.state_dict())
    x = torch.randn(6 + rank, 128)
    for dispatch in ("all_to_all", "all_gather"):
        ep = sm.ExpertParallelMoE.from_moe(full, dispatch=dispatch)
        ep8 = sm.ExpertParallelMoE.from_moe(full8, dispatch=dispatch)
        y, aux = ep(x.clone().requires_grad_(True))
        yi, auxi = ep(x.clone().requires_grad_(True), is_inference_mode=True)
        out[f"{dispatch}.inference"] = bool(torch.equal(y, yi) and auxi is None and yi.grad_fn is None)
        y8, _ = ep(x, kernel_backend_moe=sm.KernelBackendMoE.sonicmoe_fp8)
        y8_ref, _ = ep8(x)
        out[f"{dispatch}.fp8"] = bool(torch.equal(y8, y8_ref) and not torch.equal(y8, y))
    return out


def _router_errors(rank, R):
    """ExpertParallelMoE.from_moe of a MoE with each router of ROUTERS (and a non-zero selection bias), chunks 1 and
    2, overlapped backward or not: output, aux loss and every gradient against the MoE on the concatenated batch."""
    errs = {}
    for name, kw in ROUTERS.items():
        torch.manual_seed(21)
        full = sm.MoE(8, 2, 16, 12, "swiglu", std=0.3, **kw)
        if kw.get("e_score_correction_bias"):
            full.router.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
        xs, x_all, out_ref, aux_ref, lo, hi, sl = _whole_batch(full, [7, 4, 9, 5][:R], 16, rank, R)
        for chunks, overlap, dispatch in ((1, False, "all_to_all"), (1, False, "all_gather"), (2, True, "auto")):
            ep = sm.ExpertParallelMoE.from_moe(full, chunks=chunks, overlap_backward=overlap, dispatch=dispatch)
            x, out, aux, router_grad = _ep_step(ep, xs[rank], R)
            tag = f"{name}.C{chunks}" + (".AG" if dispatch == "all_gather" else "")
            errs.update({f"{tag}.out": rel_err(out, out_ref[lo:hi]),
                         f"{tag}.aux": abs(aux.item() - aux_ref.item()) / max(1.0, abs(aux_ref.item())),
                         f"{tag}.x.grad": rel_err(x.grad, x_all.grad[lo:hi]),
                         f"{tag}.router.grad": rel_err(router_grad, full.router.weight.grad),
                         f"{tag}.c_fc.weight.grad": rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
                         f"{tag}.c_proj.weight.grad": rel_err(ep.c_proj.weight.grad, full.c_proj.weight.grad[sl])})
    return errs


def _refusals(rank, R):
    """Rank R-1 hands in a bad input (a wrong width; a list; its experts in another dtype) with each dispatch: it raises its own error naming the
    argument, every other rank a RuntimeError naming it, none waits for the others (the refusing rank still joins
    the step's first collective), and the next step runs on every rank."""
    out = {}
    torch.manual_seed(0)
    for mode in ("all_to_all", "all_gather"):
        ep = sm.ExpertParallelMoE(8, 4, 16, 12, dispatch=mode)
        for what, bad in (("width", torch.randn(5, 15)), ("type", [[0.0] * 16]), ("param", None), ("keyword", None)):
            if what == "param" and rank == R - 1:  # one rank's experts in another dtype than its router
                ep.c_proj.weight.data = ep.c_proj.weight.data.double()
            kw = dict(is_inference_mode="yes") if what == "keyword" and rank == R - 1 else {}
            try:
                ep(bad if rank == R - 1 and bad is not None else torch.randn(5, 16), **kw)
                out[f"{mode}.{what}"] = "no error"
            except Exception as e:  # noqa: BLE001 - the type is what the test checks
                out[f"{mode}.{what}"] = f"{type(e).__name__}: {e}"
            if what == "param":
                ep.c_proj.weight.data = ep.c_proj.weight.data.float()
        y, _ = ep(torch.randn(3, 16))
        out[f"{mode}.next_step"] = list(y.shape)
    return out


# Tokens per rank, step by step, for the all-gather dispatch's early exchange (sized by the group's largest T of the
# step before): none at the first step, fits, a rank past it (gathered again), fits with padding, no tokens anywhere
# (gathered, unused), none after that step, fits again. EARLY_ROWS: the early exchange's rows per step (0: none);
# EARLY_MADE: the gathers of x per step (two where the early one fell short).
EARLY_STEPS = [[5, 5], [5, 5], [7, 4], [3, 6], [0, 0], [2, 2], [2, 2]]
EARLY_ROWS = [0, 5, 5, 7, 6, 0, 2]
EARLY_MADE = [1, 1, 2, 1, 1, 1, 1]


def _early_gather_steps(rank, R):
    """ExpertParallelMoE(dispatch="all_gather") over EARLY_STEPS (rank r takes column min(r, 1)) against MoE on the
    whole batch: each step's output and gradients, its early exchange's size and gathers of x; then a rank refusing
    its input while the others start the early exchange (it joins it), and a step after that."""
    import torch.distributed as dist
    torch.manual_seed(31)
    full = sm.MoE(8, 2, 16, 12, "swiglu", add_bias=True, std=0.3)
    ep = sm.ExpertParallelMoE.from_moe(full, dispatch="all_gather")
    made, early_rows = [], []
    real = sm.ep._EarlyGather

    class Counting(real):
        def __init__(self, *a):
            made[-1] += 1
            super().__init__(*a)

    sm.ep._EarlyGather = Counting
    errs = {}
    try:
        for i, step in enumerate(EARLY_STEPS):
            made.append(0)
            early_rows.append(ep._early_rows)
            Ts = [step[min(r, 1)] for r in range(R)]
            xs = [torch.randn(T, 16) for T in Ts]
            x = xs[rank].clone().requires_grad_(True)
            for p in list(full.parameters()) + list(ep.parameters()):
                p.grad = None
            out, aux = ep(x)
            if sum(Ts) == 0:
                errs[f"{i}.shape"] = list(out.shape) == [0, 16]
                continue
            (out.square().sum() + 0.3 * aux).backward()
            x_all = torch.cat(xs).requires_grad_(True)
            out_ref, aux_ref = full(x_all)
            (out_ref.square().sum() + 0.3 * aux_ref).backward()
            lo, hi = sum(Ts[:rank]), sum(Ts[:rank + 1])
            sl = slice(rank * (8 // R), (rank + 1) * (8 // R))
            router_grad = ep.router.weight.grad.clone()
            if R > 1:
                dist.all_reduce(router_grad)
            errs[f"{i}.err"] = max(rel_err(out, out_ref[lo:hi]), rel_err(x.grad, x_all.grad[lo:hi]),
                                   rel_err(router_grad, full.router.weight.grad),
                                   rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
                                   rel_err(ep.c_proj.bias.grad, full.c_proj.bias.grad[sl]))
        made.append(0)
        early_rows.append(ep._early_rows)
        try:  # the last rank refuses its input; the others start the early exchange of 2 rows
            ep(torch.randn(2, 15) if rank == R - 1 else torch.randn(2, 16))
            errs["refusal"] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is what the test checks
            errs["refusal"] = type(e).__name__
        made.append(0)
        errs["after_refusal"] = list(ep(torch.randn(2, 16))[0].shape)
    finally:
        sm.ep._EarlyGather = real
    errs["made"], errs["early_rows"] = made, early_rows
    return errs


def _fp8_errors(rank, R):
    """ExpertParallelMoE.from_moe of an MoE(precision="fp8") and of an MoE(precision="fp8_wgrad") (FP8 weight
    gradients: each expert's rows quantised in blocks of 128 in token order, which the dispatches keep) with either
    dispatch against that MoE on the whole batch (output and every gradient: the same codes, summed in another order),
    and against the bf16 layer (the FP8 layer really ran)."""
    errs = {}
    for precision in ("fp8", "fp8_wgrad"):
        torch.manual_seed(41)
        full = sm.MoE(8, 2, 128, 128, "swiglu", add_bias=True, std=0.05, precision=precision)
        xs, x_all, out_ref, _, lo, hi, sl = _whole_batch(full, [9, 5, 12, 7][:R], 128, rank, R)
        for dispatch in ("all_to_all", "all_gather"):
            key = dispatch if precision == "fp8" else f"{dispatch}.wgrad"
            ep = sm.ExpertParallelMoE.from_moe(full, dispatch=dispatch)
            errs[f"{key}.precision"] = ep.precision
            x, out, _, router_grad = _ep_step(ep, xs[rank], R)
            errs[f"{key}.err"] = max(
                rel_err(out, out_ref[lo:hi]), rel_err(x.grad, x_all.grad[lo:hi]),
                rel_err(router_grad, full.router.weight.grad),
                rel_err(ep.c_fc.weight.grad, full.c_fc.weight.grad[sl]),
                rel_err(ep.c_proj.weight.grad, full.c_proj.weight.grad[sl]),
                rel_err(ep.c_fc.bias.grad, full.c_fc.bias.grad[sl]))
            ep.precision = "bf16"
            with torch.no_grad():
                errs[f"{key}.vs_bf16"] = rel_err(out, ep(xs[rank])[0])
    return errs


def _fp8_cache_checks(rank, R):
    """ExpertParallelMoE(precision="fp8")'s weight cache against fp8_weight_cache=False, with each dispatch and 2
    chunks: two optimizer steps of two micro-batches, outputs and gradients bitwise equal, the local weights quantised
    once a step (one miss a step, the other lookups hits: one per chunk and forward)."""
    res = {}
    torch.manual_seed(43)
    full = sm.MoE(8, 2, 128, 128, "swiglu", add_bias=True, std=0.05, precision="fp8")
    xs = [[torch.randn(6 + 3 * r, 128) for r in range(R)] for _ in range(4)]  # the same draws on every rank
    for dispatch, chunks in (("all_gather", 1), ("all_to_all", 1), ("all_to_all", 2)):
        key = f"{dispatch}.{chunks}"
        on = sm.ExpertParallelMoE.from_moe(full, dispatch=dispatch, chunks=chunks)
        off = sm.ExpertParallelMoE.from_moe(full, dispatch=dispatch, chunks=chunks)
        off.fp8_weight_cache = False
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (on, off)]
        same = on.fp8_weight_cache and not off.fp8_weight_cache
        for step in range(2):
            for micro in range(2):
                runs = []
                for m in (on, off):
                    x = xs[2 * step + micro][rank].clone().requires_grad_(True)
                    out, aux = m(x)
                    (out.square().sum() + 0.3 * aux).backward()
                    runs.append((out, aux, x.grad))
                same = same and all(torch.equal(a, b) for a, b in zip(*runs))
                same = same and all(torch.equal(a.grad, b.grad) for a, b in zip(on.parameters(), off.parameters()))
            for o in opts:
                o.step()
                o.zero_grad()
        res[f"{key}.same"] = same
        res[f"{key}.lookups"] = (on._fp8_cache.misses, on._fp8_cache.hits)
    return res


def autocast_bitwise(full, full16, x, group):
    """{run: bool} over the all-to-all and all-gather dispatches and the overlapped backward in 2 chunks:
    ExpertParallelMoE.from_moe(full) (fp32 parameters) under torch.autocast(bf16) on x in fp32 bitwise
    ExpertParallelMoE.from_moe(full16) (the module converted to bf16) on x (bf16): output, aux loss, x's gradient, the
    parameters' gradients widened to fp32. On x's device type (test_ep_cuda.py runs it over NCCL)."""
    out = {}
    for name, kw in (("all_to_all", dict(dispatch="all_to_all")), ("all_gather", dict(dispatch="all_gather")),
                     ("overlap_c2", dict(dispatch="all_to_all", chunks=2, overlap_backward=True))):
        runs = []
        for m, x_in, ac in ((full, x.float(), True), (full16, x, False)):
            ep = sm.ExpertParallelMoE.from_moe(m, ep_group=group, **kw)
            xs = x_in.clone().requires_grad_(True)
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=ac):
                y, aux = ep(xs)
            (y.float().square().sum() + 0.3 * aux).backward()
            runs.append((y, aux, xs.grad.to(torch.bfloat16), [p.grad.float() for p in ep.parameters()]))
        (y, aux, dx, g), (y_r, aux_r, dx_r, g_r) = runs
        out[name] = bool(y.dtype == torch.bfloat16 and torch.equal(y, y_r) and torch.equal(aux, aux_r)
                         and torch.equal(dx, dx_r) and all(torch.equal(a, b) for a, b in zip(g, g_r)))
    return out


def _autocast_checks(rank, R):
    """ExpertParallelMoE with fp32 parameters under torch.autocast("cpu", bf16) bitwise the bf16 module
    (autocast_bitwise); accumulate_main_grad with fp32 parameters under autocast refused before any collective (every
    rank raises the same)."""
    torch.manual_seed(9)
    full = sm.MoE(8, 2, 32, 16, "swiglu", add_bias=True, std=0.2)
    full16 = sm.MoE(8, 2, 32, 16, "swiglu", add_bias=True)
    full16.load_state_dict(full.state_dict())
    full16 = full16.to(torch.bfloat16)
    x = torch.randn(11 + 3 * rank, 32).to(torch.bfloat16)
    group = torch.distributed.group.WORLD if R > 1 else None
    out = autocast_bitwise(full, full16, x, group)
    ep = sm.ExpertParallelMoE.from_moe(full, ep_group=group)
    ep.accumulate_main_grad = True
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ep(x)
        out["main_grad_refused"] = "no error"
    except ValueError as e:
        out["main_grad_refused"] = str(e)
    return out


def _compute(rank, R):
    results = {name: _case_errors(name, rank, R, None) for name in CASES}
    results["routers"] = _router_errors(rank, R)
    results["capacity"] = _capacity_errors(rank, R)
    results["keywords"] = _forward_keywords(rank, R)
    results["main_grad"] = _main_grad_errors(rank, R)
    results["fp8"] = _fp8_errors(rank, R)
    results["fp8_cache"] = _fp8_cache_checks(rank, R)
    results["overlap_group"] = _overlap_group_equal(rank, R)
    results["autocast"] = _autocast_checks(rank, R)
    if R > 1:
        results["refusals"] = _refusals(rank, R)
        results["early_gather"] = _early_gather_steps(rank, R)
    try:
        sm.ExpertParallelMoE(R * 2 + 1, 1, 8, 8)
        results["indivisible"] = "no error"
    except ValueError as e:
        results["indivisible"] = str(e)
    return results


def _worker(rank, R, store_path, result_dir):
    gloo_world.worker(rank, R, store_path, result_dir, _compute)


def _run_world(R):
    return gloo_world.run_world("test_ep", R)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_matches_moe(R, case):
    res = _run_world(R)
    assert sorted(res) == list(range(R))
    E, K, H, I, act, bias, ts, skewed = CASES[case]
    for rank in range(R):
        errs, info = res[rank][case]
        assert info["shape"] == [ts(R)[rank], H]
        per_chunks = {"out", "aux", "x.grad", "router.grad", "c_fc.weight.grad", "c_proj.weight.grad"}
        if bias:
            per_chunks |= {"c_fc.bias.grad", "c_proj.bias.grad"}
        per_chunks.add("split_vs_fused")
        names = {f"C{c}.{n}" for c in CHUNKS for n in per_chunks} | {"C2.repeat", "full_state_dict"}
        names |= {f"AG.{n}" for n in per_chunks - {"split_vs_fused"}} | {"AG.vs_all_to_all", "AG.bitwise_vs_all_to_all"}
        assert set(errs) == names
        if R > 2:  # the partial rows of more than two ranks are summed in another order
            errs.pop("AG.bitwise_vs_all_to_all")
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"R={R} rank {rank} case {case}: errors above {TOL}: {bad}"
    if R > 1:
        assert "not divisible by the expert-parallel world size" in res[0]["indivisible"]
        for fused, split in res[0][case][1]["nodes"].values():  # the overlapped backward ran where asked for
            assert "_LocalExpertsBackward" in split and "_LocalExpertsBackward" not in fused
            assert "_RowsExchangeBackward" in fused
        ag_nodes = res[0][case][1]["nodes_ag"]  # the all-gather dispatch ran where asked for
        assert "_RowsExchangeBackward" not in ag_nodes
        # its sums over the ranks split around their exchanges (_SplitSum)
        assert "_SplitExpertsBackward" in ag_nodes and "_RowsCollectiveBackward" not in ag_nodes
    counts = res[0][case][1]["counts"]
    if skewed:  # the case does what it says: uneven loads, experts 4..7 without tokens
        assert counts[4:] == [0, 0, 0, 0] and counts[0] == sum(ts(R))


@pytest.mark.parametrize("R", [2, 4])
def test_expert_parallel_main_grad(R):
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["main_grad"]
        assert r.pop("C1.vs_grad") < TOL and r.pop("C2.vs_grad") < TOL and r.pop("AG.vs_grad") < TOL, (rank, r)
        assert r == dict.fromkeys(["C1.grad_none", "C1.split_vs_fused", "C1.vs_grad_bitwise", "C2.grad_none",
                                   "C2.split_vs_fused", "AG.grad_none"], True), (rank, r)


@pytest.mark.parametrize("R", [2, 4])
def test_expert_parallel_overlap_group(R):
    res = _run_world(R)
    assert all(res[rank]["overlap_group"] is True for rank in range(R))


@pytest.mark.parametrize("R", [2, 4])
def test_a_rank_refusing_its_input_stops_every_rank(R):
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["refusals"]
        for mode in ("all_to_all", "all_gather"):
            assert r[f"{mode}.next_step"] == [3, 16], (rank, r)
            for what, err in (("width", "ValueError: sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states'"),
                              ("type", "TypeError: sonicmoe_cpp.ExpertParallelMoE: argument 'hidden_states'"),
                              ("param", "ValueError: sonicmoe_cpp.ExpertParallelMoE: parameter 'c_proj.weight'"),
                              ("keyword", "TypeError: sonicmoe_cpp.ExpertParallelMoE: argument 'is_inference_mode'")):
                got = r[f"{mode}.{what}"]
                if rank == R - 1:
                    assert got.startswith(err), (rank, mode, what, got)
                else:
                    assert got.startswith("RuntimeError") and f"rank(s) [{R - 1}]" in got, (rank, mode, what, got)


@pytest.mark.parametrize("R", [2, 4])
def test_all_gather_dispatch_early_gather(R):
    """The all-gather dispatch gathers the routing and x before the host read, at the previous step's size: right
    results whether it fits, falls short (gathered again) or there are no tokens; a rank refusing its input joins
    the early exchange."""
    res = _run_world(R)
    for rank in range(R):
        r = dict(res[rank]["early_gather"])
        assert r.pop("made") == EARLY_MADE + [1, 1], (rank, r)
        assert r.pop("early_rows") == EARLY_ROWS + [2], (rank, r)
        assert r.pop("4.shape") is True
        assert r.pop("refusal") == ("ValueError" if rank == R - 1 else "RuntimeError"), (rank, r)
        assert r.pop("after_refusal") == [2, 16]
        bad = {k: v for k, v in r.items() if not v < TOL}
        assert not bad and len(r) == len(EARLY_STEPS) - 1, (rank, r)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_under_autocast(R):
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["autocast"]
        assert r.pop("main_grad_refused").startswith("sonicmoe_cpp.ExpertParallelMoE: accumulate_main_grad=True "
                                                     "under torch.autocast"), (rank, r)
        assert r == {"all_to_all": True, "all_gather": True, "overlap_c2": True}, (rank, r)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_fp8(R):
    """precision "fp8" and "fp8_wgrad" (from MoE.from_moe): the FP8 layer on every rank's experts, equal to the MoE
    of that precision on the whole batch within fp32 tolerance, with either dispatch."""
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["fp8"]
        for d in ("all_to_all", "all_gather", "all_to_all.wgrad", "all_gather.wgrad"):
            assert r[f"{d}.precision"] == ("fp8_wgrad" if d.endswith("wgrad") else "fp8")
            assert r[f"{d}.err"] < TOL, (rank, d, r)
            assert r[f"{d}.vs_bf16"] > 1e-3, (rank, d, r)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_fp8_weight_cache(R):
    """The FP8 weight cache (MoE's, fp8_weight_cache=True by default) in ExpertParallelMoE: bitwise the results of
    per-call quantisation over micro-batches and optimizer steps, the local weights quantised once a step."""
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["fp8_cache"]
        for key, chunks in (("all_gather.1", 1), ("all_to_all.1", 1), ("all_to_all.2", 2)):
            assert r[f"{key}.same"] is True, (rank, key)
            per_forward = chunks if R > 1 else 1  # R = 1: the fused op, one lookup
            assert list(r[f"{key}.lookups"]) == [2, 4 * per_forward - 2], (rank, key, r)


def test_expert_parallel_fp8_refusals():
    with pytest.raises(ValueError, match="hidden_size"):
        sm.ExpertParallelMoE(8, 2, 96, 128, precision="fp8")
    with pytest.raises(ValueError, match="overlap_backward"):
        sm.ExpertParallelMoE(8, 2, 128, 128, precision="fp8", overlap_backward=True)
    with pytest.raises(ValueError, match="precision"):
        sm.ExpertParallelMoE(8, 2, 128, 128, precision="int4")
    assert "precision=fp8" in repr(sm.ExpertParallelMoE(8, 2, 128, 128, precision="fp8"))


def test_ties_pick_the_lower_expert_like_moe():
    """Experts with equal router rows tie on every token: the layer keeps the lower expert id; so must the EP
    routing (R = 1: no torch.distributed needed)."""
    torch.manual_seed(7)
    moe = sm.MoE(8, 3, 16, 12, "swiglu", std=0.3)
    with torch.no_grad():
        moe.router.weight[4:] = moe.router.weight[:4]  # expert 4 + e ties with expert e: K = 3 splits a pair
    ep = sm.ExpertParallelMoE.from_moe(moe)
    x0 = torch.randn(12, 16)
    top4 = torch.sort(x0 @ moe.router.weight.detach().t(), dim=-1, descending=True).values[:, :4]
    assert (top4[:, 2] == top4[:, 3]).all()  # every token has a tie at the K-th place
    d_out = torch.randn(12, 16)
    res = []
    for layer in (moe, ep):
        x = x0.clone().requires_grad_(True)
        out, aux = layer(x)
        ((out * d_out).sum() + 0.5 * aux).backward()
        res.append((out, aux, x.grad, layer.router.weight.grad, layer.c_fc.weight.grad))
    for a, b in zip(*res):
        assert rel_err(a, b) < TOL


def test_bf16_single_rank_close_to_moe():
    torch.manual_seed(8)
    moe = sm.MoE(8, 2, 16, 12, "swiglu", std=0.3).bfloat16()
    ep = sm.ExpertParallelMoE.from_moe(moe)
    assert ep.c_fc.weight.dtype == torch.bfloat16
    x = torch.randn(10, 16).bfloat16()
    out_ref, aux_ref = moe(x)
    out, aux = ep(x)
    assert out.dtype == torch.bfloat16 and aux.dtype == torch.float32
    assert rel_err(out, out_ref) < 2e-2 and abs(aux.item() - aux_ref.item()) < 1e-3


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_router_variants(R):
    res = _run_world(R)
    for rank in range(R):
        errs = res[rank]["routers"]
        assert len(errs) == len(ROUTERS) * 3 * 6
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"R={R} rank {rank}: errors above {TOL}: {bad}"


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_forward_keywords(R):
    """MoE's forward keywords on ExpertParallelMoE (_forward_keywords), and their refusals at one rank."""
    res = _run_world(R)
    for rank in range(R):
        r = res[rank]["keywords"]
        assert r == {f"{d}.{k}": True for d in ("all_to_all", "all_gather") for k in ("inference", "fp8")}, (rank, r)
    ep = sm.ExpertParallelMoE(8, 2, 16, 12)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="kernel_backend_moe"):
        ep(x, kernel_backend_moe="torch")
    with pytest.raises(ValueError, match="kernel_backend_moe"):
        ep(x, kernel_backend_moe="tpu")
    with pytest.raises(ValueError, match="kernel_backend_moe.*hidden_size a multiple of 128"):
        ep(x, kernel_backend_moe="sonicmoe_fp8")
    with pytest.raises(TypeError, match="is_inference_mode"):
        ep(x, is_inference_mode=None)


@pytest.mark.parametrize("R", [1, 2, 4])
def test_expert_parallel_capacity(R):
    """capacity_factor applied per rank (_capacity_errors): every rank's output, gradients and dropped count are the
    MoE's on that rank's tokens alone, and some pairs are dropped."""
    res = _run_world(R)
    for rank in range(R):
        errs, dropped = res[rank]["capacity"]
        assert len(errs) == 2 * 3 * 8 + 2 * 4
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"R={R} rank {rank}: errors above {TOL}: {bad}"
        assert all(a == b for a, b in dropped.values()), f"R={R} rank {rank}: num_dropped (ours, MoE's): {dropped}"
        assert any(a > 0 for a, _ in dropped.values())


def test_dispatch_argument():
    """dispatch: one of auto / all_to_all / all_gather; all_gather refuses chunks > 1 and the overlapped backward
    (naming them); auto picks all_gather only where a token reaches nearly every rank."""
    with pytest.raises(ValueError, match="argument 'dispatch' = 'ring'"):
        sm.ExpertParallelMoE(8, 2, 16, 12, dispatch="ring")
    for kw in (dict(chunks=2), dict(overlap_backward=True)):
        with pytest.raises(ValueError, match="dispatch='all_gather' takes chunks=1 and overlap_backward=False"):
            sm.ExpertParallelMoE(8, 2, 16, 12, dispatch="all_gather", **kw)
    ep = sm.ExpertParallelMoE(8, 2, 16, 12, dispatch="all_gather")
    ep.overlap_backward = True  # set after construction: refused at the next forward's check, before a collective
    with pytest.raises(ValueError, match="overlap_backward=True"):
        ep.dispatch_mode()
    from sonicmoe_cpp.ep import _uniform_fill
    assert abs(_uniform_fill(128, 8, 2) - (1 - math.comb(64, 8) / math.comb(128, 8))) < 1e-12
    assert _uniform_fill(128, 8, 2) > 0.99 and _uniform_fill(128, 8, 8) < 0.7 and _uniform_fill(8, 8, 2) == 1.0


def test_router_keywords_carry_over_and_are_checked():
    """from_moe takes the MoE's router (config, selection bias and capacity_factor); router settings the library
    refuses are refused at construction, naming the argument."""
    moe = sm.MoE(8, 2, 16, 8, scoring_func="sigmoid", n_group=4, topk_group=2, e_score_correction_bias=True,
                 routed_scaling_factor=2.5)
    moe.router.e_score_correction_bias.fill_(0.25)
    ep = sm.ExpertParallelMoE.from_moe(moe)
    assert ep.router_config == moe.router_config
    assert torch.equal(ep.router.e_score_correction_bias, moe.router.e_score_correction_bias)
    assert "scoring_func=sigmoid" in repr(ep)
    ep = sm.ExpertParallelMoE.from_moe(sm.MoE(8, 2, 16, 8, capacity_factor=1.25))
    assert ep.router_config["capacity_factor"] == 1.25 and "capacity_factor=1.25" in repr(ep)
    for bad_factor in (-1.0, math.nan, "1.5"):
        with pytest.raises((ValueError, TypeError), match="capacity_factor"):
            sm.ExpertParallelMoE(8, 2, 16, 8, capacity_factor=bad_factor)
    bad = [(dict(n_group=3), "'n_group' = 3"), (dict(n_group=4, topk_group=5, scoring_func="sigmoid"), "'topk_group'"),
           (dict(n_group=2), "group-limited selection"), (dict(n_group=8, scoring_func="sigmoid"), "groups of 1"),
           (dict(n_group=4, topk_group=1, scoring_func="sigmoid"), "top_k = 4 exceeds"),
           (dict(e_score_correction_bias=True), "e_score_correction_bias needs"),
           (dict(routed_scaling_factor=0.0), "'routed_scaling_factor'")]
    for kw, msg in bad:
        k = 4 if "top_k" in msg else 2
        with pytest.raises(ValueError, match=msg):
            sm.ExpertParallelMoE(8, k, 16, 8, **kw)

"""ExpertParallelMoE on GPUs over NCCL (one process a GPU), against the single-GPU `MoE` with the same weights on the
whole batch (every rank's tokens concatenated): output, aux loss, dx and every gradient within bf16 tolerance, and
bit-exact repeats, for each chunk count of the pipelined exchange (ExpertParallelMoE(chunks=...); the chunked output
also against the unchunked one), and 2 chunks with the GEMMs leaving 16 SMs idle (set_gemm_sm_margin); with 1 chunk,
the overlapped backward (the dispatch's reverse all-to-all under dW1/dW2) bitwise equal to the unsplit one
(overlap_backward=False, with either dispatch: all_to_all, all_gather; at R <= 2 the same sums in the same order, at
R = 4 the all-gather dispatch within tolerance), to itself with overlap_sm_margin=16 and (world size > 1) with its
exchange on a second NCCL group of max_ctas 8 (overlap_group). World size 1 runs on any GPU machine; world sizes 2
and 4 where that many GPUs are visible.
Cases: a small shape with uneven token counts and experts that receive no tokens, a rank that sends nothing, K = 1
with a rank holding fewer tokens than chunks, and readme-default at its full size per rank (T=32768 per GPU);
SONICMOE_EP_CUDA_CASES=small,k1 runs only those. Beside them: precision "fp8", accumulate_main_grad, and
capacity_factor (per rank: against MoE on each rank's tokens), fp32 parameters under torch.autocast (bitwise the
bf16 module)."""
import os

import pytest
import torch

import gloo_world

TOL = 2e-2  # bf16 layer against bf16 layer: only the order of fp32 sums and the bf16 roundings differ

# name: (E, K, H, I, activation, tokens of each rank for R=1 / 2 / 4, experts that get no token, chunk counts)
CASES = {
    "small": (16, 4, 512, 256, "swiglu", {1: [1237], 2: [1000, 1237], 4: [1000, 1237, 611, 1]}, [3, 11], (1, 2, 3)),
    "rank-sends-nothing": (8, 2, 256, 128, "gelu", {1: [777], 2: [0, 777], 4: [0, 777, 300, 0]}, [], (1, 2, 3)),
    # rank 0: fewer tokens than chunks
    "k1": (8, 1, 256, 128, "swiglu", {1: [300], 2: [2, 301], 4: [2, 301, 1, 64]}, [], (1, 3)),
    "readme-default": (128, 8, 4096, 1024, "swiglu", {1: [32768], 2: [32768] * 2, 4: [32768] * 4}, [], (1, 2)),
}
WORLD_SIZES = [1, 2, 4]  # each where that many GPUs are visible
if os.environ.get("SONICMOE_EP_CUDA_CASES"):  # a quick run: only these cases (comma-separated names)
    CASES = {k: v for k, v in CASES.items() if k in os.environ["SONICMOE_EP_CUDA_CASES"].split(",")}


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0 if a.numel() == 0 else float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tokens(T_all, H, dead, seed):
    """Every rank's tokens; a common offset 8u makes the experts in `dead` (router rows -5u, logits -40 +- 5) never chosen."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(H, generator=g)
    u /= u.norm()
    xs = [(torch.randn(T, H, generator=g) + (8.0 * u if dead else 0.0)) for T in T_all]
    return xs, u


def _compute(rank, R):
    out = {}
    for name, spec in CASES.items():
        try:
            out[name] = _case(rank, R, *spec)
        except Exception as e:  # the worker's log (the test's failure message) then names the case
            raise RuntimeError(f"test_ep_cuda: rank {rank} of {R}, case {name!r} raised") from e
        torch.cuda.empty_cache()
    out["fp8"] = _fp8_case(rank, R)
    out["main_grad"] = _main_grad_case(rank, R)
    out["capacity"] = _capacity_case(rank, R)
    out["autocast"] = _autocast_case(rank, R)
    return out


def _autocast_case(rank, R):
    """fp32 parameters under torch.autocast("cuda", bf16) over NCCL, with either dispatch and the overlapped backward
    in 2 chunks: bitwise the module converted to bf16 (test_ep.autocast_bitwise, the gloo cases' check)."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    from test_ep import autocast_bitwise
    dev = torch.device("cuda", rank)
    torch.manual_seed(9)
    full = sm.MoE(16, 4, 512, 256, "swiglu", add_bias=True, std=0.05).to(dev)
    full16 = sm.MoE(16, 4, 512, 256, "swiglu", add_bias=True).to(dev)
    full16.load_state_dict(full.state_dict())
    full16 = full16.to(torch.bfloat16)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(900 + 111 * rank, 512, generator=g).to(dev, torch.bfloat16)
    return autocast_bitwise(full, full16, x, dist.group.WORLD)


def _capacity_case(rank, R):
    """capacity_factor per rank over NCCL: ExpertParallelMoE.from_moe of a bf16 MoE(capacity_factor=0.5) with either
    dispatch against that MoE on this rank's tokens alone (output, dx, num_dropped; loss y * dy, no aux), the local
    experts' gradients against the MoE's summed over every rank's run."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    dev = torch.device("cuda", rank)
    torch.manual_seed(7)
    full = sm.MoE(8, 2, 256, 128, capacity_factor=0.5).to(dev, torch.bfloat16)
    T_all = [600, 900, 450, 750][:R]
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(T, 256, generator=g).to(dev, torch.bfloat16) for T in T_all]
    dys = [torch.randn(T, 256, generator=g).to(dev, torch.bfloat16) for T in T_all]
    runs = []
    for x_r, dy_r in zip(xs, dys):  # each rank's tokens alone; the weights' gradients add up over the runs
        x_r = x_r.clone().requires_grad_()
        y_r, _ = full(x_r)
        (y_r.float() * dy_r.float()).sum().backward()
        runs.append((y_r.detach(), x_r.grad, int(full.num_dropped.item())))
    El = 8 // R
    r = {}
    for dispatch in ("all_to_all", "all_gather"):
        ep = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, dispatch=dispatch)
        x = xs[rank].clone().requires_grad_()
        y, _ = ep(x)
        (y.float() * dys[rank].float()).sum().backward()
        y_ref, dx_ref, dropped_ref = runs[rank]
        r[f"{dispatch}.err"] = max(_rel(y, y_ref), _rel(x.grad, dx_ref),
                                   _rel(ep.c_fc.weight.grad, full.c_fc.weight.grad[rank * El:(rank + 1) * El]),
                                   _rel(ep.c_proj.weight.grad, full.c_proj.weight.grad[rank * El:(rank + 1) * El]))
        r[f"{dispatch}.dropped"] = (int(ep.num_dropped.item()), dropped_ref)
    return r


def _fp8_case(rank, R):
    """ExpertParallelMoE.from_moe of an MoE(precision="fp8") with either dispatch against that MoE on the whole batch
    (output, dx, the router's and the experts' gradients), and its distance to the bf16 layer (FP8 really ran); a
    second step on the cached quantised weights bitwise the first."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    dev = torch.device("cuda", rank)
    torch.manual_seed(5)
    full = sm.MoE(8, 2, 256, 256, precision="fp8").to(dev, torch.bfloat16)
    T_all = [500, 700, 300, 1][:R]
    g = torch.Generator().manual_seed(6)
    x_all = torch.randn(sum(T_all), 256, generator=g).to(dev, torch.bfloat16)
    dy_all = torch.randn(sum(T_all), 256, generator=g).to(dev, torch.bfloat16)
    lo, hi = sum(T_all[:rank]), sum(T_all[:rank + 1])
    xr = x_all.clone().requires_grad_()
    y_ref, aux_ref = full(xr)
    ((y_ref.float() * dy_all.float()).sum() + aux_ref).backward()
    ref = {k: v.grad for k, v in full.named_parameters()}
    r = {}
    for dispatch in ("all_to_all", "all_gather"):
        ep = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, dispatch=dispatch)
        def step():
            x = x_all[lo:hi].clone().requires_grad_()
            y, aux = ep(x)
            ((y.float() * dy_all[lo:hi].float()).sum() + aux).backward()
            return x, y

        x, y = step()
        grads = [p.grad.clone() for p in ep.parameters()]
        # a second micro-batch reads the cached quantised weights: bitwise the first one's output and gradients
        ep.zero_grad()
        x2, y2 = step()
        r[f"{dispatch}.cache_bitwise"] = float(torch.equal(y2, y) and torch.equal(x2.grad, x.grad) and all(
            torch.equal(p.grad, g) for p, g in zip(ep.parameters(), grads)) and ep._fp8_cache.hits >= 1)
        rg = ep.router.weight.grad.float()
        dist.all_reduce(rg)
        El = 8 // R
        r[f"{dispatch}.err"] = max(_rel(y, y_ref[lo:hi]), _rel(x.grad, xr.grad[lo:hi]), _rel(rg, ref["router.weight"]),
                                   _rel(ep.c_fc.weight.grad, ref["c_fc.weight"][rank * El:(rank + 1) * El]),
                                   _rel(ep.c_proj.weight.grad, ref["c_proj.weight"][rank * El:(rank + 1) * El]))
        ep.precision = "bf16"
        with torch.no_grad():
            r[f"{dispatch}.vs_bf16"] = _rel(y, ep(x_all[lo:hi])[0])
    return r


def _main_grad_case(rank, R):
    """accumulate_main_grad=True over NCCL (fp32 main_grads, W1's and W2's added by the weight-gradient GEMMs): the
    unsplit and the overlapped backward (one and two chunks) and the all-gather dispatch, two steps each; .grad stays
    None; main_grad within bf16 tolerance of the layer's own .grad sum without the option, and the overlapped
    backward's bitwise the unsplit one's at one chunk."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    dev = torch.device("cuda", rank)
    torch.manual_seed(7)
    full = sm.MoE(8, 2, 256, 128, "swiglu", add_bias=True, std=0.05).to(dev, torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(300 + 100 * rank, 256, generator=g).to(dev, torch.bfloat16) for _ in range(2)]
    r, main_grads = {}, {}

    def run(m):
        for x in xs:
            y, aux = m(x)
            ((y.float() ** 2).sum() + aux).backward()

    for label, kw in (("a2a", {}), ("a2a_overlap", {"overlap_backward": True}),
                      ("a2a_overlap_c2", {"overlap_backward": True, "chunks": 2}), ("ag", {"dispatch": "all_gather"})):
        ref = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, **kw)
        run(ref)
        m = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, **kw)
        m.accumulate_main_grad = True
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        run(m)
        r[f"{label}.grad_none_bitwise"] = all(p.grad is None for p in m.parameters())
        r[f"{label}.err"] = max(_rel(p.main_grad, q.grad.float()) for p, q in zip(m.parameters(), ref.parameters()))
        main_grads[label] = [p.main_grad for p in m.parameters()]
    r["overlap_vs_unsplit_bitwise"] = all(torch.equal(a, b) for a, b in zip(main_grads["a2a"],
                                                                           main_grads["a2a_overlap"]))
    return r


def _case(rank, R, E, K, H, I, act, T_by_R, dead, chunk_counts):
    """One case's relative errors (and flags) on this rank."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    dev = torch.device("cuda", rank)
    T_all = T_by_R[R]
    torch.manual_seed(0)
    full = sm.MoE(E, K, H, I, activation_function=act, add_bias=(act == "gelu")).to(dev, torch.bfloat16)
    xs, u = _tokens(T_all, H, dead, seed=1)
    with torch.no_grad():
        for e in dead:
            full.router.weight[e] = (-5.0 * u).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    dys = [torch.randn(T, H, generator=g) for T in T_all]
    x_all = torch.cat(xs).to(dev, torch.bfloat16)
    dy_all = torch.cat(dys).to(dev, torch.bfloat16)
    lo, hi = sum(T_all[:rank]), sum(T_all[:rank + 1])

    # the single-GPU layer on the whole batch
    xr = x_all.clone().requires_grad_()
    y_ref, aux_ref = full(xr)
    ((y_ref.float() * dy_all.float()).sum() + aux_ref).backward()
    ref = {k: v.grad for k, v in full.named_parameters()}

    # this rank's shard, on this rank's tokens, for each chunk count
    El = E // R
    r = {}
    y_c1 = None
    # (chunks, GEMM SM margin): chunks = 2 also with the GEMMs leaving 16 SMs to NCCL (set_gemm_sm_margin)
    for C, margin in [(C, 0) for C in chunk_counts] + ([(2, 16)] if 2 in chunk_counts else []):
        ep = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, chunks=C, overlap_backward=True)
        runs = []
        sm.set_gemm_sm_margin(margin)
        for _ in range(2):
            ep.zero_grad(set_to_none=True)
            x = x_all[lo:hi].clone().requires_grad_()
            y, aux = ep(x)
            ((y.float() * dy_all[lo:hi].float()).sum() + aux).backward()
            runs.append((y.detach().clone(), x.grad.clone(), {k: v.grad.clone() for k, v in ep.named_parameters()}))
        sm.set_gemm_sm_margin(0)
        (y, dx, grads) = runs[0]
        rg = grads["router.weight"].float()
        dist.all_reduce(rg)  # the router's gradient over the ranks' batches = the layer's on the whole batch
        p = f"C{C}m{margin}." if margin else f"C{C}."
        r.update({
            p + "out": _rel(y, y_ref[lo:hi]),
            p + "aux": abs(aux.item() - aux_ref.item()) / max(abs(aux_ref.item()), 1e-30),
            p + "dx": _rel(dx, xr.grad[lo:hi]),
            p + "router": _rel(rg, ref["router.weight"]),
            p + "repeat_bitwise": bool(torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
                                       and all(torch.equal(runs[0][2][k], runs[1][2][k]) for k in grads)),
        })
        if y_c1 is None:
            y_c1 = y
        else:
            r[p + "out_vs_C1"] = _rel(y, y_c1)
        for k in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
            if k in grads:
                r[p + k] = _rel(grads[k], ref[k][rank * El:(rank + 1) * El])
        for e in dead:  # the dead experts really got nothing, in both layers
            if rank * El <= e < (rank + 1) * El:
                r[f"{p}dead{e}"] = float(grads["c_fc.weight"][e - rank * El].abs().max())
        if C == 1:  # the overlapped backward (the default) against the unsplit one, and with an SM margin
            ref_run = runs[0]
            del ep, runs, grads
            r.update(_overlap_checks(full, ref_run, x_all[lo:hi], dy_all[lo:hi], R))
        else:
            del ep, runs, grads
        torch.cuda.empty_cache()
    return r


def _overlap_checks(full, ref_run, x0, dy, R):
    """chunks = 1, two steps each: the unsplit backward (overlap_backward=False; the default dispatch, and all_to_all
    and all_gather named), the overlapped one with overlap_sm_margin=16 and, at
    R > 1, with its exchange on a second NCCL group of max_ctas 8 (overlap_group) give bitwise the overlapped
    backward's output and gradients (`ref_run`); the overlapped path really ran (CUDA events recorded per backward,
    R > 1 only: R = 1 is the fused single-GPU op). At R > 2 the all-gather dispatch sums a token's R partial rows in
    NCCL's reduce_scatter, in another order than the all-to-all's sum kernel: there the runs that take it ("fused"
    where "auto" picks it) are compared within bf16 tolerance (`C1.<name>.err`), not bitwise."""
    import torch.distributed as dist
    import sonicmoe_cpp as sm
    out = {}
    variants = [("fused", dict(overlap_backward=False)), ("o16", dict(overlap_backward=True, overlap_sm_margin=16)),
                ("fused_all_to_all", dict(overlap_backward=False, dispatch="all_to_all")),
                ("fused_all_gather", dict(overlap_backward=False, dispatch="all_gather"))]
    if R > 1:  # the exchange on a second NCCL group limited to 8 CTAs, the GEMMs under it leaving 8 SMs
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = 8
        variants.append(("x8", dict(overlap_backward=True, overlap_sm_margin=8, overlap_group=dist.new_group(list(range(R)),
                                                                                      pg_options=opts))))
    for name, kw in variants:
        ep = sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD, chunks=1, **kw)
        ep.backward_events = []
        bitwise = R <= 2 or ep.dispatch_mode() != "all_gather"
        same, err = True, 0.0
        for _ in range(2):  # the second step of the all-gather dispatch gathers x early (at the first step's size)
            ep.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            y, aux = ep(x)
            ((y.float() * dy.float()).sum() + aux).backward()
            grads = {k: v.grad for k, v in ep.named_parameters()}
            same = same and bool(torch.equal(y, ref_run[0]) and torch.equal(x.grad, ref_run[1])
                                 and all(torch.equal(grads[k], ref_run[2][k]) for k in grads))
            err = max([err, _rel(y, ref_run[0]), _rel(x.grad, ref_run[1])] +
                      [_rel(grads[k], ref_run[2][k]) for k in grads])
        if bitwise:
            out[f"C1.{name}_bitwise"] = same
        else:
            out[f"C1.{name}.err"] = err
        if name == "o16":
            out["C1.overlap_events"] = len(ep.backward_events)
        del ep
    return out


def _worker(rank, R, store_path, result_dir):
    gloo_world.worker(rank, R, store_path, result_dir, _compute, backend="nccl")


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("R", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_nccl_matches_single_gpu(R, case):
    res = gloo_world.run_world("test_ep_cuda", R, timeout_s=600, backend="nccl")
    for rank, by_case in res.items():
        r = by_case[case]
        runs = {f"C{c}" for c in CASES[case][-1]} | ({"C2m16"} if 2 in CASES[case][-1] else set())
        assert {k.split(".")[0] for k in r} == runs, (rank, case, sorted(r))
        assert {"C1.o16_bitwise", "C1.fused_all_to_all_bitwise"} | ({"C1.x8_bitwise"} if R > 1 else set()) <= set(r), \
            (rank, case, sorted(r))
        for name in ("fused", "fused_all_gather"):  # bitwise, or within tolerance where they sum in another order
            assert (f"C1.{name}_bitwise" in r) != (f"C1.{name}.err" in r), (rank, case, name, sorted(r))
            assert f"C1.{name}_bitwise" in r or R > 2, (rank, case, name, sorted(r))
        for k, v in r.items():
            if k.endswith("bitwise"):
                assert v, (rank, case, k)
            elif k == "C1.overlap_events":  # two backwards, one chunk: a set of events each where the overlap runs
                assert v == (2 if R > 1 else 0), (rank, case, k, v)
            elif ".dead" in k:
                assert v == 0.0, (rank, case, k)
            else:
                assert v < TOL, (rank, case, k, v)


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_expert_parallel_nccl_fp8(R):
    """precision "fp8" over NCCL: MoE(precision="fp8")'s results on the whole batch, with either dispatch."""
    res = gloo_world.run_world("test_ep_cuda", R, timeout_s=600, backend="nccl")
    for rank, by_case in res.items():
        r = by_case["fp8"]
        for d in ("all_to_all", "all_gather"):
            assert r[f"{d}.err"] < TOL, (rank, d, r)
            assert r[f"{d}.vs_bf16"] > 5e-3, (rank, d, r)
            assert r[f"{d}.cache_bitwise"] == 1.0, (rank, d, r)


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_expert_parallel_nccl_capacity(R):
    """capacity_factor over NCCL, per rank: MoE(capacity_factor)'s results on each rank's tokens, with either
    dispatch, and the same dropped count (some pairs dropped)."""
    res = gloo_world.run_world("test_ep_cuda", R, timeout_s=600, backend="nccl")
    for rank, by_case in res.items():
        r = by_case["capacity"]
        for d in ("all_to_all", "all_gather"):
            assert r[f"{d}.err"] < TOL, (rank, d, r)
            ours, ref = r[f"{d}.dropped"]
            assert ours == ref > 0, (rank, d, r)


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_expert_parallel_nccl_main_grad(R):
    """accumulate_main_grad=True over NCCL: fp32 main_grads filled by the library's GEMMs (W1, W2) and autograd (the
    router, the biases) through every backward, .grad None, within bf16 tolerance of the plain layer's gradients."""
    res = gloo_world.run_world("test_ep_cuda", R, timeout_s=600, backend="nccl")
    for rank, by_case in res.items():
        r = by_case["main_grad"]
        assert {k for k in r if k.endswith("bitwise")} == {"a2a.grad_none_bitwise", "a2a_overlap.grad_none_bitwise",
                                                         "a2a_overlap_c2.grad_none_bitwise", "ag.grad_none_bitwise",
                                                         "overlap_vs_unsplit_bitwise"}, (rank, sorted(r))
        for k, v in r.items():
            assert (v if k.endswith("bitwise") else v < TOL), (rank, k, v)


@pytest.mark.parametrize("R", WORLD_SIZES)
def test_expert_parallel_nccl_autocast(R):
    """fp32 parameters under torch.autocast over NCCL: bitwise the bf16 module, with either dispatch and the
    overlapped backward."""
    res = gloo_world.run_world("test_ep_cuda", R, timeout_s=600, backend="nccl")
    for rank, by_case in res.items():
        r = by_case["autocast"]
        assert set(r) == {"all_to_all", "all_gather", "overlap_c2"}, (rank, sorted(r))
        assert all(r.values()), (rank, r)

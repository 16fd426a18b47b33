"""FSDP2 (torch.distributed.fsdp.fully_shard) and DistributedDataParallel over sonicmoe_cpp layers on the CPU with
gloo, world sizes 2 and 4 as subprocesses (as in test_ep.py): the wrapped layer's output and its gathered gradients
against the unwrapped layer on the concatenated batch (each rank's batch alone where the loss is per batch).

FSDP2 reduce-scatters the gradients with the mean over the data-parallel ranks (ReduceOp.AVG for fp32 / bf16
gradients, torch 2.11 `_get_gradient_divide_factors`), so a sharded gradient, gathered, is (1/R) sum_r dL_r/dW,
L_r being rank r's loss on its own batch shard.
"""

import pytest
import torch

import gloo_world

import sonicmoe_cpp as sm

TOL = 1e-5  # fp32 against fp32: only the summation order differs
E, K, H, I = 8, 2, 16, 12
C_AUX = 0.37


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# The layer's sizes and each rank's tokens (test_fsdp_cuda.py runs the same cases on GPUs with larger ones).
CPU_SHAPE = dict(dims=(E, K, H, I), tokens=(7, 5, 6, 3), dev="cpu")


def _data(R, seed, dims, tokens, dev):
    """The same full layer and data on every rank (made on the CPU from one seed, then moved to `dev`)."""
    E_, K_, H_, I_ = dims
    torch.manual_seed(seed)
    full = sm.MoE(E_, K_, H_, I_, "swiglu", add_bias=True, std=0.3)
    with torch.no_grad():
        full.c_fc.bias.normal_(0, 0.1)
        full.c_proj.bias.normal_(0, 0.1)
    Ts = list(tokens[:R])
    xs = [torch.randn(T, H_).to(dev) for T in Ts]
    ds = [torch.randn(T, H_).to(dev) for T in Ts]
    return full.to(dev), xs, ds, Ts


def _fsdp_moe(rank, R, mesh, dims, tokens, dev):
    """fully_shard(MoE): every parameter a DTensor sharded on dim 0; two micro-batches of gradient accumulation
    (the parameters resharded after each forward, gathered again for the backward), then an SGD step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    full, xs, ds, Ts = _data(R, 11, dims, tokens, dev)
    ref = sm.MoE(*dims, "swiglu", add_bias=True, std=0.3).to(dev)
    ref.load_state_dict(full.state_dict())
    model = full
    # reshard_after_forward=True (the root's default is False): the gathered parameters, which the op saved for its
    # backward, are freed after the forward and gathered again before the backward
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    info = {"dtensor": all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters()),
            "local_rows": model.c_fc.weight.to_local().shape[0]}
    lo, hi = sum(Ts[:rank]), sum(Ts[:rank + 1])
    errs = {}
    xs2 = [x.flip(0) * 0.5 for x in xs]  # a second micro-batch
    for mb, (batch, d_out) in enumerate(((xs, ds), (xs2, ds))):
        x = batch[rank].clone().requires_grad_(True)
        out, aux = model(x)
        ((out * d_out[rank]).sum() + C_AUX * aux).backward()
        # the reference: the whole batch at once for the output and x's gradient; the aux loss is per rank's batch
        # (a load-balancing loss over a micro-batch), so the reference adds the R shards' aux losses
        x_all = torch.cat(batch).requires_grad_(True)
        out_ref, _ = ref(x_all)
        bounds = [sum(Ts[:r]) for r in range(R + 1)]
        loss = (out_ref * torch.cat(d_out)).sum() + C_AUX * sum(ref(x_all[bounds[r]:bounds[r + 1]])[1]
                                                                  for r in range(R))
        (loss / R).backward()  # FSDP2 averages the gradients over the R ranks
        errs[f"out{mb}"] = rel_err(out, out_ref[lo:hi])
        errs[f"x.grad{mb}"] = rel_err(x.grad, x_all.grad[lo:hi] * R)  # x's gradient is not averaged
        errs[f"aux{mb}"] = abs(aux.item() - ref(batch[rank])[1].item())
    for n, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), n
        errs[n + ".grad"] = rel_err(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad)
    # a sharded optimizer step against the unsharded one
    for m in (model, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for n, p in model.named_parameters():
        errs[n + ".after_step"] = rel_err(p.full_tensor(), dict(ref.named_parameters())[n])
    return errs, info


def _fsdp_ep(rank, R, mesh, dims, tokens, dev):
    """fully_shard(ExpertParallelMoE, ignored_params=<the local experts>): the experts sharded by EP (each rank its
    E/R), FSDP over the rest (the router, gathered for the forward, its gradient reduce-scattered with the mean). The
    ignored expert parameters keep their plain local gradient, which is the gradient of the SUM of the ranks' losses
    (the combine all-to-all's backward brings every rank's contribution): divide it by R to match FSDP's mean."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    full, xs, ds, Ts = _data(R, 12, dims, tokens, dev)
    E_ = dims[0]
    ep = sm.ExpertParallelMoE.from_moe(full, None)
    experts = {ep.c_fc.weight, ep.c_fc.bias, ep.c_proj.weight, ep.c_proj.bias}
    fully_shard(ep, mesh=mesh, ignored_params=experts)
    info = {"router_dtensor": isinstance(ep.router.weight, DTensor),
            "experts_plain": not any(isinstance(p, DTensor) for p in experts)}
    x = xs[rank].clone().requires_grad_(True)
    out, aux = ep(x)
    ((out * ds[rank]).sum() + C_AUX * aux).backward()
    x_all = torch.cat(xs).requires_grad_(True)
    out_ref, aux_ref = full(x_all)  # EP's aux loss is the whole group's batch's
    ((out_ref * torch.cat(ds)).sum() + C_AUX * aux_ref).backward()
    lo, hi = sum(Ts[:rank]), sum(Ts[:rank + 1])
    sl = slice(rank * (E_ // R), (rank + 1) * (E_ // R))
    errs = {"out": rel_err(out, out_ref[lo:hi]), "aux": abs(aux.item() - aux_ref.item()),
            "x.grad": rel_err(x.grad, x_all.grad[lo:hi]),
            "router.weight.grad": rel_err(ep.router.weight.grad.full_tensor(), full.router.weight.grad / R)}
    for n in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
        mine, theirs = dict(ep.named_parameters())[n].grad, dict(full.named_parameters())[n].grad[sl]
        errs[n + ".grad"] = rel_err(mine, theirs)
    return errs, info


def _rank_batches_step(model, ref, batch, ds, rank, R, errs, tag):
    """One micro-batch: the wrapped `model` on this rank's batch, the reference on every rank's batch alone (each its
    own aux loss) with the loss / R (the wrappers' gradient mean); errs[out<tag>], errs[x.grad<tag>] for this rank."""
    x = batch[rank].clone().requires_grad_(True)
    out, aux = model(x)
    ((out * ds[rank]).sum() + C_AUX * aux).backward()
    for r in range(R):
        xr = batch[r].clone().requires_grad_(True)
        o, a = ref(xr)
        (((o * ds[r]).sum() + C_AUX * a) / R).backward()
        if r == rank:
            errs[f"out{tag}"] = rel_err(out, o)
            errs[f"x.grad{tag}"] = rel_err(x.grad, xr.grad * R)


def _fsdp_fp8(rank, R, mesh, dims, tokens, dev):
    """fully_shard(MoE(precision="fp8")) with its FP8 weight cache (the default): two optimizer steps of two
    micro-batches each, then a forward after the steps and one after an in-place change of the sharded weights outside
    an optimizer step,
    against an unsharded MoE(precision="fp8") with its own cache. The cache keys FSDP2's gathered weights on their
    sharded parameters: the second micro-batch of a step reuses the quantised weights, the first after a step or
    after the in-place change quantises the new ones. The reference runs each rank's batch alone (FP8 quantises the activations of a batch,
    so a batch of other tokens could move a rounding) and sums the gradients / R (FSDP's mean)."""
    from torch.distributed.fsdp import fully_shard
    fdims = (dims[0], dims[1], 128, 128)  # H and I multiples of the FP8 block
    full, xs, ds, Ts = _data(R, 13, fdims, tokens, dev)
    full.precision = "fp8"
    ref = sm.MoE(*fdims, "swiglu", add_bias=True, std=0.3, precision="fp8").to(dev)
    ref.load_state_dict(full.state_dict())
    fully_shard(full, mesh=mesh, reshard_after_forward=True)
    params_ref = dict(ref.named_parameters())
    opt, opt_ref = torch.optim.SGD(full.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    errs = {}
    for step in range(2):
        for mb, batch in enumerate((xs, [x.flip(0) * 0.5 for x in xs])):
            _rank_batches_step(full, ref, batch, ds, rank, R, errs, f"{step}{mb}")
        for n, p in full.named_parameters():
            errs[f"{n}.grad{step}"] = rel_err(p.grad.full_tensor(), params_ref[n].grad)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    for n, p in full.named_parameters():
        errs[n + ".after_steps"] = rel_err(p.full_tensor(), params_ref[n])
    out, _ = full(xs[rank])  # quantises the stepped weights
    errs["out_after_steps"] = rel_err(out, ref(xs[rank])[0])
    with torch.no_grad():  # not an optimizer step: only the sharded parameters' versions tell
        for m in (full, ref):
            for p in m.parameters():
                p.mul_(0.75)
    out, _ = full(xs[rank])
    errs["out_after_inplace"] = rel_err(out, ref(xs[rank])[0])
    return errs, {"hits": full._fp8_cache.hits, "misses": full._fp8_cache.misses}


def _ddp_moe(rank, R, mesh, dims, tokens, dev):
    """DistributedDataParallel(MoE) (its gradients averaged over the ranks by all-reduce, bucketed), two steps of
    gradient accumulation then an SGD step, against the unsharded layer on every rank's batch with the loss / R."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    full, xs, ds, Ts = _data(R, 17, dims, tokens, dev)
    ref = sm.MoE(*dims, "swiglu", add_bias=True, std=0.3).to(dev)
    ref.load_state_dict(full.state_dict())
    model = DDP(full)
    errs = {}
    for mb in range(2):
        batch = xs if mb == 0 else [x.flip(0) * 0.5 for x in xs]
        _rank_batches_step(model, ref, batch, ds, rank, R, errs, str(mb))
    params_ref = dict(ref.named_parameters())
    for n, p in full.named_parameters():
        errs[n + ".grad"] = rel_err(p.grad, params_ref[n].grad)
    for m in (full, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for n, p in full.named_parameters():
        errs[n + ".after_step"] = rel_err(p, params_ref[n])
    return errs, {}


def _fsdp_meta_init(rank, R, mesh, dims, tokens, dev):
    """The torchtitan way of building a large model: MoE built under torch.device("meta"), fully_shard, to_empty on
    the device, reset_parameters (the constructor's normal(0, std) weights, zero biases, on the shards); then a
    forward+backward against an unsharded MoE loaded with the gathered weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    std = 0.3
    with torch.device("meta"):
        model = sm.MoE(*dims, "swiglu", add_bias=True, std=std)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=dev)
    model.reset_parameters()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    info = {"dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "weights_std": {n: t.std().item() for n, t in full.items() if "bias" not in n},
            "biases_zero": all(not t.any() for n, t in full.items() if "bias" in n)}
    ref = sm.MoE(*dims, "swiglu", add_bias=True).to(dev)
    ref.load_state_dict(full)
    _, xs, ds, _ = _data(R, 19, dims, tokens, dev)
    errs = {}
    _rank_batches_step(model, ref, xs, ds, rank, R, errs, "")
    params_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        errs[n + ".grad"] = rel_err(p.grad.full_tensor(), params_ref[n].grad)
    return errs, info


CASES = {"moe": _fsdp_moe, "ep": _fsdp_ep, "fp8": _fsdp_fp8, "ddp": _ddp_moe,  # test_fsdp_cuda.py: on GPUs too
         "meta_init": _fsdp_meta_init}


def compute_cases(rank, R, mesh, shape, cases=CASES):
    """Every case's (errors, info) on this rank, or its traceback (shape: CPU_SHAPE or test_fsdp_cuda.py's)."""
    import traceback

    import torch.distributed as dist
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = fn(rank, R, mesh, **shape)
        except Exception:
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


def _compute(rank, R):
    from torch.distributed.device_mesh import init_device_mesh
    return compute_cases(rank, R, init_device_mesh("cpu", (R,)), CPU_SHAPE)


def _worker(rank, R, store_path, result_dir):
    gloo_world.worker(rank, R, store_path, result_dir, _compute)


def _run_world(R):
    return gloo_world.run_world("test_fsdp", R)


def check_case(res, R, case, tol=TOL):
    """[(errors, info)] of every rank for `case`, each error below tol."""
    assert sorted(res) == [str(r) for r in range(R)] or sorted(res) == list(range(R))
    out = []
    for rank in range(R):
        r = res[rank] if rank in res else res[str(rank)]
        got = r[case]
        assert not isinstance(got, str), f"R={R} rank {rank} case {case} raised:\n{got}"
        errs, info = got
        bad = {k: v for k, v in errs.items() if not v < tol}
        assert not bad, f"R={R} rank {rank} case {case}: errors above {tol}: {bad}"
        out.append((errs, info))
    return out


def _check(R, case):
    return check_case(_run_world(R), R, case)


@pytest.mark.parametrize("R", [2, 4])
def test_fully_shard_moe_matches_unsharded(R):
    for errs, info in _check(R, "moe"):
        assert info["dtensor"] and info["local_rows"] == E // R
        names = {n for n, _ in sm.MoE(E, K, H, I, add_bias=True).named_parameters()}
        assert {k[:-len(".grad")] for k in errs if k.endswith(".grad") and not k.startswith("x.")} == names
        assert {"out0", "out1", "x.grad0", "x.grad1", "aux0", "aux1"} <= set(errs)


@pytest.mark.parametrize("R", [2, 4])
def test_fully_shard_expert_parallel_router(R):
    for errs, info in _check(R, "ep"):
        assert info["router_dtensor"] and info["experts_plain"]
        assert set(errs) == {"out", "aux", "x.grad", "router.weight.grad", "c_fc.weight.grad", "c_fc.bias.grad",
                             "c_proj.weight.grad", "c_proj.bias.grad"}


@pytest.mark.parametrize("R", [2, 4])
def test_distributed_data_parallel_matches_the_layer(R):
    for errs, _ in _check(R, "ddp"):
        names = {n for n, _ in sm.MoE(E, K, H, I, add_bias=True).named_parameters()}
        assert {k[:-len(".grad")] for k in errs if k.endswith(".grad") and not k.startswith("x.")} == names
        assert {"out0", "out1", "x.grad0", "x.grad1"} <= set(errs)


@pytest.mark.parametrize("R", [2, 4])
def test_fully_shard_of_a_meta_built_module(R):
    for errs, info in _check(R, "meta_init"):
        assert info["dtensor"] and info["biases_zero"], info
        assert all(abs(v - 0.3) < 0.05 for v in info["weights_std"].values()), info
        assert {"out", "x.grad", "c_fc.weight.grad", "router.weight.grad"} <= set(errs)


@pytest.mark.parametrize("R", [2, 4])
def test_fully_shard_fp8_weight_cache_follows_the_optimizer(R):
    for errs, info in _check(R, "fp8"):
        assert {"out00", "out01", "out10", "out11", "c_fc.weight.grad1", "c_fc.weight.after_steps",
                "out_after_steps", "out_after_inplace"} <= set(errs)
        # six forwards: the first of each step, the one after the steps and the one after the in-place change
        # quantise; the second micro-batch of each step reuses
        assert info == {"hits": 2, "misses": 4}, info

"""Expert-parallel benchmark: per-GPU forward+backward throughput of `ExpertParallelMoE` against the single-GPU
`MoE` on the same per-GPU token count, and where the EP step's time goes.

    torchrun --nproc_per_node=2 python/bench/ep_bench.py --config readme-default [--iters 10] [--json ep.json]
    python python/bench/ep_bench.py --config readme-default          # EP = 1 only (no torchrun needed)

Every rank holds T tokens (the config's T) and E/R of the E experts, so each GPU does the single-GPU layer's work
on T tokens: TFLOP/s per GPU = 18 T K H I (GLU) / time. Per rank it measures, with CUDA events (median of --iters):
  - `single`: the single-GPU `MoE` (all E experts) on this rank's T tokens;
  - `ep`: `ExpertParallelMoE` over the world group (EP = R), forward and forward+backward;
and, from a torch.profiler trace of a few EP forward+backward steps, the GPU time in NCCL kernels (dispatch and
combine, forward and backward), in the library's kernels (the experts), and in the rest (router, top-K, index
ops), against the wall time: `exposed comm` = NCCL kernel time (nothing overlaps it today), `gaps` = wall time with
no kernel running (host work and syncs). Also checks the EP output against the single-GPU layer on the whole batch
(rank-0 prints; --check 0 to skip). Rank 0 prints one table; --json writes every rank's numbers.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from timing import cuda_time  # python/bench/timing.py: median of CUDA-event timings

ROOT = Path(__file__).resolve().parents[2]


def profile_split(step, n=3):
    """GPU time (ms per step) in NCCL kernels, in the library's kernels and in others, and the wall time, from a
    torch.profiler trace of n steps."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            step()
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b) / n
    nccl = ours = other = 0.0
    others = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        name = e.name.lower()
        if "nccl" in name:
            nccl += us
        elif "sonicmoe" in name or "cutlass" in name or "cute" in name:
            ours += us
        else:
            other += us
            others[e.name[:70]] = others.get(e.name[:70], 0.0) + us
    to_ms = 1e-3 / n
    top = sorted(others.items(), key=lambda kv: -kv[1])[:10]
    return dict(wall_ms=wall, nccl_ms=nccl * to_ms, experts_ms=ours * to_ms, other_ms=other * to_ms,
                gaps_ms=max(wall - (nccl + ours + other) * to_ms, 0.0),
                other_top=[(k, round(v * to_ms, 3)) for k, v in top])


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="readme-default")
    ap.add_argument("--file", default=str(ROOT / "bench" / "bench_configs.json"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", type=int, default=1, help="compare the EP output with the single-GPU layer")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ep_bench.py needs CUDA GPUs")
    import sonicmoe_cpp as sm

    if "RANK" in os.environ:
        rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        rank, R = 0, 1
    cfgs = {c["name"]: c for c in json.load(open(args.file))["configs"]}
    if args.config not in cfgs:
        sys.exit(f"unknown config {args.config!r}; known: {sorted(cfgs)}")
    c = cfgs[args.config]
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    if E % R:
        sys.exit(f"E={E} is not divisible by the world size {R}")
    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    flops = 18 * T * K * H * I  # forward 6 T K H I (GLU), backward twice that

    torch.manual_seed(0)  # the same full layer on every rank; each rank keeps its shard
    full = sm.MoE(E, K, H, I).to(dev, dt)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    group = dist.group.WORLD if R > 1 else None
    ep = sm.ExpertParallelMoE.from_moe(full, ep_group=group)
    barrier = (lambda: dist.barrier()) if R > 1 else None

    def fb(layer):
        def step():
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(True)
            y, _ = layer(xx)
            y.backward(dy)
        return step

    def fwd(layer):
        def step():
            with torch.no_grad():
                layer(x)
        return step

    res = dict(config=args.config, R=R, rank=rank, T=T, H=H, I=I, E=E, K=K, gpu=torch.cuda.get_device_name(dev))
    res["single_fwd_ms"] = cuda_time(fwd(full), args.iters)
    res["single_fb_ms"] = cuda_time(fb(full), args.iters)
    res["ep_fwd_ms"] = cuda_time(fwd(ep), args.iters, sync=barrier)
    res["ep_fb_ms"] = cuda_time(fb(ep), args.iters, sync=barrier)
    res["single_fb_tflops"] = flops / res["single_fb_ms"] / 1e9
    res["ep_fb_tflops"] = flops / res["ep_fb_ms"] / 1e9
    res["ep_vs_single"] = res["single_fb_ms"] / res["ep_fb_ms"]
    if barrier:
        barrier()
    res.update({f"split_{k}": v for k, v in profile_split(fb(ep)).items()})
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb(ep)()
    torch.cuda.synchronize()
    res["ep_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30

    if R > 1:  # the all-to-all alone: T rows of H to every rank (the size of a readme-default dispatch)
        buf = torch.randn(R * T, H, device=dev, dtype=dt)
        out_buf = torch.empty_like(buf)
        t_a2a = cuda_time(lambda: dist.all_to_all_single(out_buf, buf), args.iters, sync=barrier)
        res["a2a_ms"] = t_a2a
        res["a2a_remote_gbps"] = (R - 1) * T * H * 2 / t_a2a / 1e6  # bytes leaving this GPU per second
        del buf, out_buf
    if args.check:
        with torch.no_grad():
            y_ep, _ = ep(x)
            xs = [x]
            if R > 1:
                xs = [torch.empty_like(x) for _ in range(R)]
                dist.all_gather(xs, x)
            y_ref, _ = full(torch.cat(xs))
        res["rel_err_vs_single_gpu_layer"] = rel(y_ep, y_ref[rank * T:(rank + 1) * T])
        del y_ref

    all_res = [None] * R
    if R > 1:
        dist.all_gather_object(all_res, res)
    else:
        all_res = [res]
    if rank == 0:
        print(f"# ep_bench {args.config} (T={T} per GPU, H={H}, I={I}, E={E}, K={K}), EP={R}, {res['gpu']}")
        print(f"{'rank':>4} {'single f+b ms':>13} {'TF/s':>6} {'EP f+b ms':>9} {'TF/s':>6} {'EP/single':>9} "
              f"{'EP fwd ms':>9} {'wall':>6} {'nccl':>6} {'experts':>7} {'other':>6} {'gaps':>6} {'peak GiB':>8} "
              f"{'rel err':>8}")
        for r in all_res:
            print(f"{r['rank']:>4} {r['single_fb_ms']:>13.3f} {r['single_fb_tflops']:>6.1f} {r['ep_fb_ms']:>9.3f} "
                  f"{r['ep_fb_tflops']:>6.1f} {r['ep_vs_single']:>9.3f} {r['ep_fwd_ms']:>9.3f} "
                  f"{r['split_wall_ms']:>6.2f} {r['split_nccl_ms']:>6.2f} {r['split_experts_ms']:>7.2f} "
                  f"{r['split_other_ms']:>6.2f} {r['split_gaps_ms']:>6.2f} {r['ep_peak_gib']:>8.2f} "
                  f"{r.get('rel_err_vs_single_gpu_layer', float('nan')):>8.1e}")
        print("largest 'other' kernels on rank 0 (ms/step):", all_res[0]["split_other_top"])
        if R > 1:
            print("all_to_all_single of T rows to every rank, alone: " + ", ".join(
                f"rank {r['rank']} {r['a2a_ms']:.3f} ms = {r['a2a_remote_gbps']:.0f} GB/s sent to other GPUs"
                for r in all_res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(all_res, f, indent=1)
    if R > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

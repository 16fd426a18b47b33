"""Expert-parallel benchmark: per-GPU forward+backward throughput of `ExpertParallelMoE` against the single-GPU
`MoE` on the same per-GPU token count, and where the EP step's time goes, unchunked and pipelined.

    torchrun --nproc_per_node=2 python/bench/ep_bench.py --config readme-default [--chunks C] [--json ep.json]
    python python/bench/ep_bench.py --config readme-default          # EP = 1 only (no torchrun needed)

Every rank holds T tokens (the config's T) and E/R of the E experts, so each GPU does the single-GPU layer's work
on T tokens: TFLOP/s per GPU = 18 T K H I (GLU) / time. Per rank it measures, with CUDA events (median of --iters):
  - `single`: the single-GPU `MoE` (all E experts) on this rank's T tokens;
  - `ep`: `ExpertParallelMoE` over the world group (EP = R), forward and forward+backward, with chunks = 1 (no
    overlap) and chunks = C (--chunks; default 2, R > 1);
and, per chunk count, from a torch.profiler trace of a few EP forward+backward steps: the GPU time in NCCL kernels
split into `hidden` (while a compute kernel ran on another stream) and `exposed` (the rest), the time in the
library's kernels (the experts and the combine's gather_sum) and in the rest (router, top-K, index ops), and `gaps`
(wall time with no kernel running: host work and syncs). Also checks the EP output against the single-GPU layer on
the whole batch, and chunks = C against chunks = 1 (--check 0 to skip). Rank 0 prints one table; --json writes every
rank's numbers (top-level ep_* for chunks = C, and per run under "c1", "cC" and, with --sm-margin M, "cC_mM": chunks =
C with the library's GEMMs leaving M SMs idle for NCCL's kernels, `sonicmoe_cpp.set_gemm_sm_margin`).
The runs use the overlapped backward (ExpertParallelMoE(overlap_backward=True): the dispatch's reverse all-to-all under
the weight-gradient GEMMs) but "c1_fused" (overlap_backward=False, the unsplit backward) and, with
--overlap-sm-margin M, "c1_oM" (the weight-gradient GEMMs under the all-to-all leave M SMs idle) and, with
--overlap-max-ctas N, "c1_oM_xN" (that all-to-all on a second NCCL group limited to N CTAs). Each overlapped run
also reports the backward's split on the main stream from CUDA events (bwd_part1_ms, bwd_part2_ms, bwd_a2a_wait_ms).
"c1_fused" takes the layer's default dispatch ("auto"); "c1_fused_all_to_all" or "c1_fused_all_gather" runs the
other one; "c1_fused_all_gather_late" (R > 1) the all-gather dispatch without its early gather of x (x gathered after
the routing's host read); "c1_fused_all_gather_rs" (R > 1, bf16) the all-gather dispatch with its sums over the ranks
as gather_sum + reduce_scatter (`split_sums=False`) instead of split around the exchanges. The runs follow one
another and the GPUs slow down over a call at the power cap, so a later row is not an A/B against an earlier one
(PERFORMANCE.md section 7 measures the split sums interleaved instead). --only-unsplit: those runs only. --precision
fp8 (with --only-unsplit): both layers in FP8 blockwise, each quantising its weights in every call (--fp8-cache: each
keeping them across calls). --timeline DIR: each rank's kernel timeline of the unsplit runs' traces
(DIR/timeline_rank<r>_<run>.txt: every kernel and idle stretch, the host time of each step) and of the single-GPU
layer's (DIR/timeline_rank<r>_single.txt).
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from timing import cuda_time, train_step  # python/bench/timing.py: median of CUDA-event timings, a f+b step
from bench_config import add_config_args, load_config  # --config / --file


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(a, b, union):
    """Length of [a, b) inside the merged intervals `union`."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


def profile_split(step, n=3, timeline=None):
    """From a torch.profiler trace of n steps, per step (ms): GPU time in NCCL kernels, split into the part that ran
    while a compute kernel ran on another stream (hidden) and the rest (exposed); time in the library's kernels
    (the experts and the combine's gather_sum) and in others; `gaps`: wall time with no kernel running (host work and
    syncs). `timeline`: a file to write every kernel of the trace to (start and duration in ms from the first kernel,
    name), with the idle stretches between them, and the host time of each traced step."""
    import time
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        host = []
        for _ in range(n):
            h0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - h0) * 1e3)
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b) / n
    nccl, compute, kernels = [], [], []
    ours = other = 0.0
    others = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t0, t1 = e.time_range.start, e.time_range.end
        us = t1 - t0
        kernels.append((t0, t1, e.name[:48]))
        name = e.name.lower()
        if "nccl" in name:
            nccl.append((t0, t1))
            continue
        compute.append((t0, t1))
        if "sonicmoe" in name or "cutlass" in name or "cute" in name:
            ours += us
        else:
            other += us
            others[e.name[:70]] = others.get(e.name[:70], 0.0) + us
    # the largest idle stretches (no kernel on any stream), each with the kernels that end before / start after it
    idle, end, last = [], None, ""
    for t0, t1, name in sorted(kernels):
        if end is not None and t0 > end:
            idle.append((t0 - end, last, name))
        if end is None or t1 > end:
            end, last = t1, name
    idle_top = [(round(us * 1e-3, 3), a, b) for us, a, b in sorted(idle, reverse=True)[:8]]
    if timeline and kernels:
        first, end = min(k[0] for k in kernels), None
        with open(timeline, "w") as f:
            f.write(f"# host time per step (ms, the step's Python call): {[round(h, 2) for h in host]}\n")
            f.write("# start_ms dur_ms kernel  (idle: no kernel on any stream)\n")
            for t0, t1, name in sorted(kernels):
                if end is not None and t0 > end + 5:
                    f.write(f"{(end - first) * 1e-3:9.3f} {(t0 - end) * 1e-3:7.3f} idle\n")
                f.write(f"{(t0 - first) * 1e-3:9.3f} {(t1 - t0) * 1e-3:7.3f} {name}\n")
                end = t1 if end is None else max(end, t1)
    busy = _union(compute)
    nccl_us = sum(t1 - t0 for t0, t1 in nccl)
    hidden_us = sum(_overlap(t0, t1, busy) for t0, t1 in nccl)
    any_kernel = sum(y - x for x, y in _union(compute + nccl))
    to_ms = 1e-3 / n
    top = sorted(others.items(), key=lambda kv: -kv[1])[:10]
    return dict(wall_ms=wall, nccl_ms=nccl_us * to_ms, nccl_hidden_ms=hidden_us * to_ms,
                nccl_exposed_ms=(nccl_us - hidden_us) * to_ms, experts_ms=ours * to_ms, other_ms=other * to_ms,
                gaps_ms=max(wall - any_kernel * to_ms, 0.0), host_ms=sorted(host)[len(host) // 2],
                other_top=[(k, round(v * to_ms, 3)) for k, v in top],
                gaps_top=idle_top)


def _key(chunks, margin, overlap=True, overlap_margin=0, max_ctas=0, dispatch="auto", early=True, split=True):
    return (f"c{chunks}" + (f"_m{margin}" if margin else "") + ("" if overlap else "_fused")
            + (f"_o{overlap_margin}" if overlap_margin else "") + (f"_x{max_ctas}" if max_ctas else "")
            + ("" if dispatch == "auto" else "_" + dispatch) + ("" if early else "_late") + ("" if split else "_rs"))


def _no_early_gather(module, args):
    """Forward pre-hook: the all-gather dispatch without its early gather of x (the gather after the routing)."""
    module._early_rows = 0


def backward_split(layer, step, n=5):
    """Mean ms per step of the overlapped backward's parts, from the CUDA events `layer.backward_events` records on
    the main stream per chunk: part 1 (dgated, dX, d(scores)), part 2 (dW2, dW1, while the dispatch's reverse
    all-to-all runs on the side stream), and `wait` (the main stream waiting for that exchange after part 2: the
    part of it not hidden). Empty when the layer did not take the overlapped path."""
    step()
    torch.cuda.synchronize()
    layer.backward_events = []
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    evs, layer.backward_events = layer.backward_events, None
    if not evs:
        return {}
    part = lambda i: sum(e[i].elapsed_time(e[i + 1]) for e in evs) / n
    return dict(bwd_part1_ms=part(0), bwd_part2_ms=part(1), bwd_a2a_wait_ms=part(2))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", type=int, default=1, help="compare the EP output with the single-GPU layer")
    ap.add_argument("--chunks", type=int, default=0,
                    help="ExpertParallelMoE's chunk count to measure besides 1 (0: 2 when R > 1)")
    ap.add_argument("--sm-margin", type=int, default=0,
                    help="also measure chunks=C with the GEMMs leaving this many SMs to NCCL (set_gemm_sm_margin); "
                         "pair it with NCCL_MAX_CTAS in the environment")
    ap.add_argument("--overlap-sm-margin", type=int, default=0,
                    help="also measure chunks=1 with the overlapped backward's weight-gradient GEMMs (the ones under the "
                         "dispatch's reverse all-to-all) leaving this many SMs idle (ExpertParallelMoE "
                         "overlap_sm_margin)")
    ap.add_argument("--overlap-max-ctas", type=int, default=0,
                    help="also measure chunks=1 with the overlapped backward's exchange on a second NCCL group whose "
                         "config.max_ctas is this (ExpertParallelMoE overlap_group), its GEMMs leaving "
                         "--overlap-sm-margin SMs (or this many when that is 0)")
    ap.add_argument("--json", default="")
    ap.add_argument("--only-unsplit", action="store_true",
                    help="measure chunks=1 with the unsplit backward only (the layer's defaults)")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                    help="the experts' precision, of the single-GPU MoE and of ExpertParallelMoE alike")
    ap.add_argument("--fp8-cache", action="store_true",
                    help="with --precision fp8: both layers keep their quantised weights across calls "
                         "(fp8_weight_cache, the steady state of gradient accumulation); default: both quantise them "
                         "in every call")
    ap.add_argument("--timeline", default="",
                    help="a folder to write each rank's kernel timeline of the unsplit runs' traces and of the "
                         "single-GPU layer's to (timeline_rank<r>_<run>.txt, timeline_rank<r>_single.txt)")
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
    c = load_config(args)
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    if E % R:
        sys.exit(f"E={E} is not divisible by the world size {R}")
    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    flops = 18 * T * K * H * I  # forward 6 T K H I (GLU), backward twice that

    torch.manual_seed(0)  # the same full layer on every rank; each rank keeps its shard
    if args.precision == "fp8" and not args.only_unsplit:
        sys.exit("ep_bench.py: --precision fp8 takes --only-unsplit (the overlapped backward is bf16 only)")
    # fp8: both layers quantise their weights in every call, or (--fp8-cache) both keep them (ExpertParallelMoE.from_moe
    # takes the MoE's fp8_weight_cache)
    full = sm.MoE(E, K, H, I, precision=args.precision, fp8_weight_cache=args.fp8_cache).to(dev, dt)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    group = dist.group.WORLD if R > 1 else None
    C = 1 if args.only_unsplit else args.chunks or (2 if R > 1 else 1)
    eps = {n: sm.ExpertParallelMoE.from_moe(full, ep_group=group, chunks=n) for n in sorted({1, C})}
    # (chunks, SM margin, overlapped backward, overlap_sm_margin): chunks 1 and C with the overlapped backward (the
    # default), chunks 1 with the unsplit one (the layer before the overlap), the optional margins.
    # With --overlap-max-ctas N: chunks 1, the overlapped exchange on a second NCCL group limited to N CTAs.
    runs = [] if args.only_unsplit else [(n, 0, True, 0, 0) for n in eps]
    # the unsplit layer with the default dispatch ("auto") and with each dispatch named
    other = "all_to_all" if eps[1].dispatch_mode() == "all_gather" else "all_gather"
    runs += [(1, 0, False, 0, 0), (1, 0, False, 0, 0, other)]
    if R > 1:  # the all-gather dispatch with x gathered after the routing, as before the early gather
        runs += [(1, 0, False, 0, 0, "all_gather", False)]
    if R > 1 and args.precision == "bf16":  # its sums over the ranks as gather_sum + reduce_scatter (split_sums off)
        runs += [(1, 0, False, 0, 0, "all_gather", True, False)]
    runs += [(C, args.sm_margin, True, 0, 0)] if args.sm_margin > 0 else []
    runs += [(1, 0, True, args.overlap_sm_margin, 0)] if args.overlap_sm_margin > 0 else []
    groups = {}
    if args.overlap_max_ctas > 0 and R > 1:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = args.overlap_max_ctas
        groups[args.overlap_max_ctas] = dist.new_group(list(range(R)), pg_options=opts)
        runs += [(1, 0, True, args.overlap_sm_margin or args.overlap_max_ctas, args.overlap_max_ctas)]
    barrier = (lambda: dist.barrier()) if R > 1 else None

    def fb(layer):
        return train_step(layer, x, dy)

    def fwd(layer):
        def step():
            with torch.no_grad():
                layer(x)
        return step

    res = dict(config=args.config, R=R, rank=rank, T=T, H=H, I=I, E=E, K=K, chunks=C, precision=args.precision,
               fp8_cache=args.fp8_cache,
               gpu=torch.cuda.get_device_name(dev))
    res["single_fwd_ms"] = cuda_time(fwd(full), args.iters)
    res["single_fb_ms"] = cuda_time(fb(full), args.iters)
    res["single_fb_tflops"] = flops / res["single_fb_ms"] / 1e9
    if args.timeline:  # the single-GPU layer's step too, to set the EP step's kernels beside it
        profile_split(fb(full), timeline=os.path.join(args.timeline, f"timeline_rank{rank}_single.txt"))
    for run in runs:  # per run: times, the profiler split, the backward split, the peak memory
        n, m, ov, om, xc = run[:5]
        ep = eps[n]
        ep.overlap_backward, ep.overlap_sm_margin, ep.overlap_group = ov, om, groups.get(xc)
        ep.dispatch = run[5] if len(run) > 5 else "auto"
        late = ep.register_forward_pre_hook(_no_early_gather) if len(run) > 6 and not run[6] else None
        ep.split_sums = run[7] if len(run) > 7 else True
        sm.set_gemm_sm_margin(m)
        r = dict(chunks=n, sm_margin=m, overlap_backward=ov, overlap_sm_margin=om, overlap_max_ctas=xc,
                 dispatch=ep.dispatch_mode())
        r["ep_fwd_ms"] = cuda_time(fwd(ep), args.iters, sync=barrier)
        r["ep_fb_ms"] = cuda_time(fb(ep), args.iters, sync=barrier)
        r["ep_fb_tflops"] = flops / r["ep_fb_ms"] / 1e9
        r["ep_vs_single"] = res["single_fb_ms"] / r["ep_fb_ms"]
        if barrier:
            barrier()
        tl = os.path.join(args.timeline, f"timeline_rank{rank}_{_key(*run)}.txt") \
            if args.timeline and not ov and n == 1 else None
        r.update({f"split_{k}": v for k, v in profile_split(fb(ep), timeline=tl).items()})
        if barrier:
            barrier()
        r.update(backward_split(ep, fb(ep)))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fb(ep)()
        torch.cuda.synchronize()
        r["ep_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        sm.set_gemm_sm_margin(0)
        ep.overlap_backward, ep.overlap_sm_margin, ep.overlap_group, ep.dispatch, ep.split_sums = \
            not args.only_unsplit, 0, None, "auto", True
        if late is not None:
            late.remove()
        res[_key(*run)] = r
    res["runs"] = [_key(*run) for run in runs]
    # the top-level ep_* numbers are the chosen chunk count's, overlapped backward, without margins
    res.update(res[_key(C, 0, not args.only_unsplit)])
    ep = eps[C]

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
        if C != 1:
            with torch.no_grad():
                res["rel_err_chunks_vs_1"] = rel(y_ep, eps[1](x)[0])
        del y_ref

    all_res = [None] * R
    if R > 1:
        dist.all_gather_object(all_res, res)
    else:
        all_res = [res]
    if rank == 0:
        cached = " (weights cached)" if args.fp8_cache else ""
        print(f"# ep_bench {args.config} (T={T} per GPU, H={H}, I={I}, E={E}, K={K}), EP={R}, "
              f"{args.precision}{cached}, {res['gpu']}; "
              f"ms per step; nccl split into the part hidden under compute kernels and the exposed rest")
        print(f"{'rank':>4} {'run':>22} {'dispatch':>10} {'single f+b':>10} {'TF/s':>6} {'EP f+b':>8} {'TF/s':>6} {'EP/single':>9} "
              f"{'EP fwd':>7} {'wall':>6} {'nccl':>6} {'hidden':>6} {'exposed':>7} {'library':>7} {'other':>6} "
              f"{'gaps':>6} {'host':>6} {'peak GiB':>8} {'rel err':>8}")
        for r in all_res:
            for key in r["runs"]:
                c = r[key]
                print(f"{r['rank']:>4} {key:>22} {c['dispatch']:>10} {r['single_fb_ms']:>10.3f} {r['single_fb_tflops']:>6.1f} "
                      f"{c['ep_fb_ms']:>8.3f} {c['ep_fb_tflops']:>6.1f} {c['ep_vs_single']:>9.3f} "
                      f"{c['ep_fwd_ms']:>7.3f} {c['split_wall_ms']:>6.2f} {c['split_nccl_ms']:>6.2f} "
                      f"{c['split_nccl_hidden_ms']:>6.2f} {c['split_nccl_exposed_ms']:>7.2f} "
                      f"{c['split_experts_ms']:>7.2f} {c['split_other_ms']:>6.2f} {c['split_gaps_ms']:>6.2f} "
                      f"{c['split_host_ms']:>6.2f} "
                      f"{c['ep_peak_gib']:>8.2f} {r.get('rel_err_vs_single_gpu_layer', float('nan')):>8.1e}")
        print(f"largest 'other' kernels on rank 0, chunks={C} (ms/step):", all_res[0]["split_other_top"])
        for r in all_res:
            print(f"rank {r['rank']}, c1_fused: largest idle stretches of the 3-step trace (ms, kernel before, after):")
            for g in r["c1_fused"]["split_gaps_top"]:
                print("   ", g)
        print("overlapped backward, main stream (ms/step): part 1 (dgated, dX) / part 2 (dW2, dW1, under the dx "
              "all-to-all) / wait for the all-to-all after part 2")
        for r in all_res:
            for key in r["runs"]:
                c = r[key]
                if "bwd_part1_ms" in c:
                    print(f"  rank {r['rank']} {key:>12}: {c['bwd_part1_ms']:.3f} / {c['bwd_part2_ms']:.3f} / "
                          f"{c['bwd_a2a_wait_ms']:.3f}")
        if "rel_err_chunks_vs_1" in res:
            print(f"output with chunks={C} against chunks=1, rel. err.: " + ", ".join(
                f"rank {r['rank']} {r['rel_err_chunks_vs_1']:.1e}" for r in all_res))
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

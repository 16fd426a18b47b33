"""Where a forward+backward through the PyTorch binding spends its time: a torch.profiler trace of `--steps` steps of
`torch.ops.sonicmoe.forward` + backward (as `compare.py` times it) on a bench config, printed as GPU time per kernel
(ms per step, launches per step), the GPU's idle time inside the step, and the host time of the step's Python ops.

    python python/bench/profile_binding.py --config coarse-8x8 [--steps 5] [--top 25] [--precision fp8]

--precision fp8 profiles `sonicmoe_cpp.moe_topk(..., precision="fp8")` with the weights quantised once outside the
trace (what `MoE(precision="fp8")`'s weight cache gives), for the FP8 layer's per-kernel split.

--impl original profiles the original SonicMoE (compare.py's `make_original`: PyPI sonic-moe 0.1.2.post1 on the same
weights, installed by python/bench/install_original.sh) the same way, for a per-kernel comparison with ours; its first
step of a shape compiles and autotunes its kernels (minutes on a cold machine), outside the trace.

Compare the kernel total with `sonicmoe-bench --config NAME` (the same layer from C++) to split the binding's
overhead into extra GPU work (kernels the C++ path does not run) and idle GPU (host time, syncs).
"""
import argparse
import re
import sys
import time
from collections import defaultdict

import torch

from bench_config import add_config_args, load_config
from timing import cuda_time


def short(name, width=90):
    """A kernel's name for the table: the library's GEMMs by their config and epilogue template arguments (which tell
    the stages apart), other long names with their template arguments cut."""
    base = re.sub(r"^void ", "", re.sub(r"<.*", "", name)).split("::")[-1]
    if base in ("varlen_m_kernel", "varlen_k_kernel", "fp8_varlen_k_kernel"):
        cfg = re.search(r"(VarlenM\w*|VarlenK\w*|Fp8VarlenK\w*)(<[^<>]*>)?", name)
        epi = re.search(r"(Epi\w+)(<[^<>]*>)?", name)
        return f"{base}<{cfg.group(0) if cfg else '?'}, {epi.group(0) if epi else '?'}>"[:width]
    name = re.sub(r"<.*", "<...>", name) if len(name) > width else name
    return name[:width]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "coarse-8x8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--impl", choices=("ours", "original"), default="ours")
    ap.add_argument("--full-names", action="store_true",
                    help="the last step's kernels by their full, untruncated names")
    args = ap.parse_args()
    import sonicmoe_cpp as sm
    from torch.profiler import ProfilerActivity, profile

    c = load_config(args)
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    p = [(torch.randn(*s, device=dev) * 0.02).to(dt).requires_grad_(True) for s in ((E, H), (E, 2 * I, H), (E, H, I))]
    x = torch.randn(T, H, device=dev, dtype=dt)
    g = torch.randn(T, H, device=dev, dtype=dt)

    fp8 = None
    if args.precision == "fp8":
        with torch.no_grad():
            fp8 = torch.ops.sonicmoe.fp8_quantize_weights(p[1].detach(), p[2].detach(), "swiglu", True)

    run_original = None
    if args.impl == "original":
        if args.precision != "bf16":
            raise SystemExit("--impl original: bf16 only")
        from compare import make_original
        run_original, oparams, why = make_original(c, {"router": p[0], "w1": p[1], "w2": p[2]}, "swiglu")
        if run_original is None:
            raise SystemExit(f"the original SonicMoE is unavailable: {why}")
        p = oparams

    def forward(xx):
        if run_original is not None:
            return run_original(xx, None, K, "swiglu")
        if fp8 is None:
            return torch.ops.sonicmoe.forward(xx, p[0], p[1], None, p[2], None, "swiglu", K, "topk", 128, None, None,
                                              None)[0]
        return sm.moe_topk(xx, p[0], p[1], None, p[2], None, K, "swiglu", precision="fp8", fp8_weights=fp8)[0]

    def step():
        for q in p:
            q.grad = None
        forward(x.detach().requires_grad_(True)).backward(g)

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"# warm-up (3 steps, the original's compilation and autotuning included): {time.perf_counter() - t0:.1f} s",
          flush=True)
    # The step timed as compare.py times it (each call between two events, synchronised: the host's work before the
    # first kernel is exposed) and back to back (the host runs ahead of the GPU, as in a training loop without a
    # host read per step).
    def fwd():
        return forward(x.detach())

    def segments():  # the caching allocator's cudaMalloc calls so far
        return torch.cuda.memory_stats().get("segment.all.allocated", 0)

    seg0 = segments()
    synced_fwd = cuda_time(fwd, args.steps * 2, warmup=0)  # compare.py times the forward alone first
    synced = cuda_time(step, args.steps * 2, warmup=0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(args.steps * 2):
        step()
    b.record()
    b.synchronize()
    back_to_back = a.elapsed_time(b) / (args.steps * 2)
    new_segments = segments() - seg0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.steps):
            step()
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b) / args.steps
    per = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per[short(e.name)][0] += e.time_range.elapsed_us() / 1e3 / args.steps
        per[short(e.name)][1] += 1
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None  # union of kernel intervals (us)
    for s, e_ in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e_
        else:
            cur_e = max(cur_e, e_)
    if cur_e is not None:
        busy += cur_e - cur_s
    busy_ms = busy / 1e3 / args.steps
    total = sum(v[0] for v in per.values())
    print(f"# profile_binding {args.config} (T={T} H={H} I={I} E={E} K={K}) {args.impl} {args.precision}, "
          f"{torch.cuda.get_device_name()}")
    print(f"wall {wall:.3f} ms/step, GPU busy {busy_ms:.3f} ms/step (kernel sum {total:.3f}), idle "
          f"{wall - busy_ms:.3f} ms/step")
    print(f"unprofiled: forward {synced_fwd:.3f} ms synchronised each call; forward+backward {synced:.3f} ms/step "
          f"synchronised each step (medians, as compare.py), {back_to_back:.3f} ms/step back to back; "
          f"{new_segments} cudaMalloc calls by the caching allocator meanwhile")
    print(f"{'ms/step':>8} {'n/step':>6}  kernel")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{ms:>8.3f} {n / args.steps:>6.1f}  {name}")
    # The last step's kernels in launch order, with the GPU's idle time before each.
    kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    per_step = len(kern) // args.steps if args.steps else 0
    print(f"\nthe last step in launch order: start (us from its first kernel), idle before (us), ms, kernel")
    last = kern[len(kern) - per_step:] if per_step else []
    prev_end = None
    for s0, e0, name in last:
        gap = 0.0 if prev_end is None else max(s0 - prev_end, 0.0)
        shown = name if args.full_names else short(name, 110)
        print(f"{s0 - last[0][0]:>9.1f} {gap:>7.1f} {(e0 - s0) / 1e3:>7.3f}  {shown}")
        prev_end = e0 if prev_end is None else max(prev_end, e0)
    cpu = prof.key_averages()
    print("\nhost: top ops by CPU time (ms/step)")
    for e in sorted(cpu, key=lambda e: -e.cpu_time_total)[:12]:
        print(f"{e.cpu_time_total / 1e3 / args.steps:>8.3f} {e.count / args.steps:>6.1f}  {e.key[:80]}")


if __name__ == "__main__":
    sys.exit(main())

"""Where a forward+backward through the PyTorch binding spends its time: a torch.profiler trace of `--steps` steps of
`torch.ops.sonicmoe.forward` + backward (as `compare.py` times it) on a bench config, printed as GPU time per kernel
(ms per step, launches per step), the GPU's idle time inside the step, and the host time of the step's Python ops.

    python python/bench/profile_binding.py --config coarse-8x8 [--steps 5] [--top 25]

Compare the kernel total with `sonicmoe-bench --config NAME` (the same layer from C++) to split the binding's
overhead into extra GPU work (kernels the C++ path does not run) and idle GPU (host time, syncs).
"""
import argparse
import re
import sys
from collections import defaultdict

import torch

from bench_config import add_config_args, load_config


def short(name, width=90):
    name = re.sub(r"<.*", "<...>", name) if len(name) > width else name
    return name[:width]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "coarse-8x8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import sonicmoe_cpp  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    c = load_config(args)
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    p = [(torch.randn(*s, device=dev) * 0.02).to(dt).requires_grad_(True) for s in ((E, H), (E, 2 * I, H), (E, H, I))]
    x = torch.randn(T, H, device=dev, dtype=dt)
    g = torch.randn(T, H, device=dev, dtype=dt)

    def step():
        for q in p:
            q.grad = None
        xx = x.detach().requires_grad_(True)
        out = torch.ops.sonicmoe.forward(xx, p[0], p[1], None, p[2], None, "swiglu", K, "topk", 128, None, None,
                                         None)[0]
        out.backward(g)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
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
    print(f"# profile_binding {args.config} (T={T} H={H} I={I} E={E} K={K}), {torch.cuda.get_device_name()}")
    print(f"wall {wall:.3f} ms/step, GPU busy {busy_ms:.3f} ms/step (kernel sum {total:.3f}), idle "
          f"{wall - busy_ms:.3f} ms/step")
    print(f"{'ms/step':>8} {'n/step':>6}  kernel")
    for name, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{ms:>8.3f} {n / args.steps:>6.1f}  {name}")
    cpu = prof.key_averages()
    print("\nhost: top ops by CPU time (ms/step)")
    for e in sorted(cpu, key=lambda e: -e.cpu_time_total)[:12]:
        print(f"{e.cpu_time_total / 1e3 / args.steps:>8.3f} {e.count / args.steps:>6.1f}  {e.key[:80]}")


if __name__ == "__main__":
    sys.exit(main())

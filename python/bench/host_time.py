"""Host time of one call through the PyTorch binding, piece by piece, at a layer small enough that the GPU work of a
call is negligible (what is measured is the host's work before the GPU can run: what small layers wait for).

    python python/bench/host_time.py [--iters 300] [--T 256 --H 256 --I 128 --E 8 --K 2] [--profile]

Each call is timed on the host alone (perf_counter around the call, the GPU synchronised before it, so the launch
queue is empty): the module forward without and with autograd recording, `y.backward`, and the raw ops
`torch.ops.sonicmoe.forward` / `backward` (the C++ op with its argument checks, the library's host work and its
launches). Medians in microseconds. --profile adds torch.profiler's host events of a forward+backward step (the CUDA
runtime calls with their counts and times) and a cProfile of the Python side.
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, iters, setup=None):
    """Median host microseconds of fn() over iters calls, each started with the GPU idle (setup() runs before each,
    untimed, and its result is fn's argument)."""
    times = []
    for _ in range(iters):
        arg = setup() if setup else None
        _sync()
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        times.append((time.perf_counter() - t0) * 1e6)
    _sync()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--I", type=int, default=128)
    ap.add_argument("--E", type=int, default=8)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import sonicmoe_cpp as sm

    T, H, I, E, K = args.T, args.H, args.I, args.E, args.K
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU build: a check of the script itself)
    m = sm.MoE(num_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I).to(dev, torch.bfloat16)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    n = args.iters

    def step():
        y, _ = m(xg)
        y.backward(dy)

    for _ in range(20):
        step()
    rows = []
    with torch.no_grad():
        rows.append(("MoE.forward, no_grad", host_us(lambda: m(x), n)))
    rows.append(("MoE.forward, autograd recording", host_us(lambda: m(xg), n)))
    rows.append(("y.backward (after that forward)", host_us(lambda y: y.backward(dy), n, setup=lambda: m(xg)[0])))
    rows.append(("forward + backward step", host_us(step, n)))

    rw, w1, w2 = m.router.weight, m.c_fc.weight, m.c_proj.weight
    fargs = (x, rw.detach(), w1.detach(), None, w2.detach(), None, "swiglu", K, "topk", 128, None, None, None)
    fwd = torch.ops.sonicmoe.forward.default
    bwd = torch.ops.sonicmoe.backward.default
    with torch.no_grad():
        rows.append(("torch.ops.sonicmoe.forward (raw op)", host_us(lambda: fwd(*fargs), n)))
        outs = fwd(*fargs)
        state = outs[2:]
        bargs = (dy, x, rw.detach(), w1.detach(), None, w2.detach(), None, "swiglu", K, "topk", *state, None,
                 False, False)
        rows.append(("torch.ops.sonicmoe.backward (raw op, consume_z False)", host_us(lambda: bwd(*bargs), n)))
        rows.append(("torch.ops.sonicmoe.inference (raw op)",
                     host_us(lambda: torch.ops.sonicmoe.inference.default(*fargs), n)))
        z = torch.empty(1, device=dev)
        rows.append(("an empty aten op (torch.empty_like of 1 element), for scale", host_us(lambda: torch.empty_like(z), n)))
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
    print(f"# host_time T={T} H={H} I={I} E={E} K={K}, {gpu}, torch {torch.__version__}, "
          f"median of {n} calls, us")
    for name, us in rows:
        print(f"{us:>9.1f}  {name}")

    if not args.profile:
        return
    from torch.profiler import ProfilerActivity, profile
    steps = 50
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])) as prof:
        for _ in range(steps):
            step()
            _sync()
    print(f"\nhost events of a forward+backward step (torch.profiler, {steps} steps): self CPU us/step, calls/step")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:40]:
        if e.self_cpu_time_total <= 0:
            continue
        print(f"{e.self_cpu_time_total / steps:>9.1f} {e.count / steps:>6.1f}  {e.key[:90]}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
        _sync()
    pr.disable()
    print(f"\ncProfile of {steps} steps (Python side):")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())

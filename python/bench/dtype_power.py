"""fp16 against bf16 storage through `sonicmoe_cpp.MoE`, with the GPU's SM clock and power sampled per run: does the
fp16 layer lose time to its data (a longer mantissa toggling more bits in power-bound GEMMs) or to its kernels?

    python python/bench/dtype_power.py [--config readme-default] [--rounds 3] [--iters 20] [--json out.json]

Three variants of one layer on one GPU, the same fp32 draws (weights, x, dY) for each, alternated `--rounds` times
(the order rotated each round):
  - `bf16`: the draws rounded to bf16;
  - `f16`: the draws rounded to fp16 (10 mantissa bits);
  - `f16_bf16_values`: the bf16 values stored as fp16 (exact: the same numbers as `bf16`, 7 mantissa bits set).
Per run: forward+backward ms (CUDA events, median of --iters) and, from `nvidia-smi` sampled every 50 ms during it,
the mean SM clock (MHz) and power (W). If `f16_bf16_values` runs at bf16's speed and `f16` below it at a lower clock,
the difference is the data's, not the kernels'.
"""
import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import torch

from timing import cuda_time
from bench_config import add_config_args, load_config


class Sampler:
    """nvidia-smi's SM clock and power for one GPU every `ms` milliseconds, stamped with time.time()."""

    def __init__(self, gpu: int, ms: int = 50):
        self.samples = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", str(ms)], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                clk, pw = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), clk, pw))

    def window(self, t0, t1):
        """Mean (SM clock, power) of the samples in [t0, t1]; None where there are none."""
        s = [(c, p) for t, c, p in self.samples if t0 <= t <= t1]
        if not s:
            return None, None
        return statistics.mean(c for c, _ in s), statistics.mean(p for _, p in s)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, no sampling (a check of the script)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("dtype_power.py needs a CUDA GPU")
    import sonicmoe_cpp as sm

    c = load_config(args)
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    dev = torch.device("cuda", torch.cuda.current_device()) if not args.smoke else torch.device("cpu")
    if args.smoke:
        T, H, I, E, K = 64, 128, 64, 8, 2
    torch.manual_seed(0)
    base = sm.MoE(E, K, H, I).to(dev)  # fp32 draws
    x32 = torch.randn(T, H, device=dev)
    dy32 = torch.randn(T, H, device=dev)
    variants = {
        "bf16": lambda t: t.to(torch.bfloat16),
        "f16": lambda t: t.to(torch.float16),
        "f16_bf16_values": lambda t: t.to(torch.bfloat16).to(torch.float16),
    }
    layers, inputs = {}, {}
    for name, cast in variants.items():
        layers[name] = sm.MoE(E, K, H, I).to(dev, torch.float16 if name.startswith("f16") else torch.bfloat16)
        with torch.no_grad():
            for p, q in zip(layers[name].parameters(), base.parameters()):
                p.copy_(cast(q))  # the same fp32 draw, rounded (bf16 -> f16 is exact at these magnitudes)
        inputs[name] = (cast(x32), cast(dy32))
    del base, x32, dy32

    def fb(name):
        layer, (x, dy) = layers[name], inputs[name]

        def step():
            layer.zero_grad(set_to_none=True)
            y, _ = layer(x.detach().requires_grad_(True))
            y.backward(dy)
        return step

    flops = 18 * T * K * H * I
    sampler = None if args.smoke else Sampler(dev.index if dev.index is not None else 0)
    time.sleep(0.5)

    def timed(step):
        if not args.smoke:
            return cuda_time(step, args.iters)
        ts = []
        for _ in range(args.iters):
            a = time.perf_counter()
            step()
            ts.append((time.perf_counter() - a) * 1e3)
        return statistics.median(ts)
    rows = []
    names = list(variants)
    for rnd in range(args.rounds):
        for name in names[rnd % 3:] + names[:rnd % 3]:  # the order rotated each round (the first run is the coolest)
            step = fb(name)
            step()
            if not args.smoke:
                torch.cuda.synchronize()
            t0 = time.time()
            ms = timed(step)
            t1 = time.time()
            clk, pw = sampler.window(t0, t1) if sampler else (None, None)
            rows.append(dict(round=rnd, variant=name, fb_ms=ms, tflops=flops / ms / 1e9, sm_mhz=clk, power_w=pw))
    if sampler:
        sampler.stop()
    gpu = torch.cuda.get_device_name(dev) if not args.smoke else "cpu"
    print(f"# dtype_power {args.config} (T={T}, H={H}, I={I}, E={E}, K={K}), {gpu}; f+b median of {args.iters}")
    print(f"{'round':>5} {'variant':>16} {'f+b ms':>8} {'TF/s':>7} {'SM MHz':>7} {'power W':>8}")
    for r in rows:
        clk = f"{r['sm_mhz']:7.0f}" if r["sm_mhz"] else "      -"
        pw = f"{r['power_w']:8.1f}" if r["power_w"] else "       -"
        print(f"{r['round']:>5} {r['variant']:>16} {r['fb_ms']:8.3f} {r['tflops']:7.1f} {clk} {pw}")
    for name in variants:
        ms = [r["fb_ms"] for r in rows if r["variant"] == name]
        bf = [r["fb_ms"] for r in rows if r["variant"] == "bf16"]
        print(f"{name:>16}: median {statistics.median(ms):.3f} ms, x{statistics.median(bf) / statistics.median(ms):.3f} "
              f"bf16's speed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=args.config, gpu=gpu, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""fp32 main_grad accumulation (accumulate_main_grad=True, Megatron's gradient-accumulation fusion) on the GPU: one
forward+backward of `sonicmoe_cpp.MoE` per bench config, bf16 weights with fp32 `main_grad`s, three ways in one process:
  plain  - no main_grad: the weights' bf16 gradients land in .grad (reset to None before each step);
  add    - main_grad, added by autograd: the library returns bf16 dW1 / dW2, then main_grad += grad.float();
  fused  - main_grad, added by the library: the weight-gradient GEMMs add their fp32 accumulators into main_grad.
Prints the median time (ms), forward+backward TFLOP/s (the layer's GEMM FLOPs) and the peak memory of one step
above what was allocated before it (GiB), and checks that fused's main_grad after one step from zeros, rounded to
bf16, equals add's bf16 gradients bitwise.

  python python/bench/main_grad_bench.py [--configs readme-default,olmoe-like] [--iters 10]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_config import ROOT  # noqa: E402
from timing import cuda_time, peak_alloc  # noqa: E402

import sonicmoe_cpp as sm  # noqa: E402
from sonicmoe_cpp import _ops  # noqa: E402


def flops(c):  # forward 2 GEMMs (up 2I wide), backward 4: 6 GEMMs of T*K rows, 3 * 2 * (2I + I) * H per row
    return 3 * 2 * c["T"] * c["K"] * c["H"] * 3 * c["I"]


def run(c, iters):
    torch.manual_seed(0)
    m = sm.MoE(c["E"], c["K"], c["H"], c["I"], "swiglu").cuda().bfloat16()
    x = torch.randn(c["T"], c["H"], device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    params = list(m.parameters())

    def step():
        for p in params:
            p.grad = None
        xx = x.detach().requires_grad_(True)
        y, aux = m(xx)
        y.backward(g)

    def measure():
        t = cuda_time(step, iters)
        torch.cuda.synchronize()
        for p in params:
            p.grad = None
        return t, peak_alloc(step) / 2**30

    out = {"config": c["name"]}
    m.accumulate_main_grad = False
    out["plain"] = measure()
    m.accumulate_main_grad = True
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    for mode, fuse in (("add", False), ("fused", True)):
        _ops.FUSE_MAIN_GRAD = fuse
        out[mode] = measure()
    # one step from zeros both ways: fused's fp32 sums rounded are add's bf16 gradients
    got = {}
    for mode, fuse in (("add", False), ("fused", True)):
        _ops.FUSE_MAIN_GRAD = fuse
        for p in params:
            p.main_grad.zero_()
        step()
        got[mode] = [p.main_grad.clone() for p in (m.c_fc.weight, m.c_proj.weight)]
    _ops.FUSE_MAIN_GRAD = True
    out["rounded_equal"] = all(torch.equal(f.bfloat16().float(), a) for f, a in zip(got["fused"], got["add"]))
    del m, x, g, params, got
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="all")
    ap.add_argument("--file", default=str(ROOT / "bench" / "bench_configs.json"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfgs = json.load(open(args.file))["configs"]
    if args.configs != "all":
        names = args.configs.split(",")
        unknown = [n for n in names if n not in {c["name"] for c in cfgs}]
        if unknown:
            sys.exit(f"unknown config(s) {unknown}; known: {[c['name'] for c in cfgs]}")
        cfgs = [c for c in cfgs if c["name"] in names]
    print(f"device: {torch.cuda.get_device_name()}")
    print(f"{'config':18s} {'plain ms':>9s} {'add ms':>8s} {'fused ms':>9s} {'fused/add':>9s} {'fused TF/s':>10s} "
          f"{'plain GiB':>9s} {'add GiB':>8s} {'fused GiB':>9s} rounded==bf16")
    rows = []
    for c in cfgs:
        r = run(c, args.iters)
        rows.append(r)
        (tp, mp), (ta, ma), (tf, mf) = r["plain"], r["add"], r["fused"]
        print(f"{c['name']:18s} {tp:9.3f} {ta:8.3f} {tf:9.3f} {ta / tf:8.3f}x {flops(c) / tf / 1e9:10.1f} "
              f"{mp:9.2f} {ma:8.2f} {mf:9.2f} {r['rounded_equal']}", flush=True)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if not all(r["rounded_equal"] for r in rows):
        sys.exit("fused main_grad rounded differs from the bf16 gradient")


if __name__ == "__main__":
    main()

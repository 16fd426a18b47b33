#!/usr/bin/env python3
"""GEMM-level PyTorch baseline for `sonicmoe-bench-gemm` (issue 3): `torch._grouped_mm` on the MoE GEMM shapes of
bench/bench_configs.json, with the separate gather pass (`index_select`) it needs where an operand is gathered
timed with it. Rows (same names and FLOP counts as sonicmoe-bench-gemm; TK = T*K routed pairs, Z = 2I):

  up        Z  = X[gather] W1^T         M=TK N=Z K=H   (gather timed)
  down      Y  = A W2^T                 M=TK N=H K=I
  dX        dX = dZ W1                  M=TK N=H K=Z
  dgated-G  G  = dO[gather] W2          M=TK N=I K=H   (gather timed)
  dW1       dW1[e] = dZ_e^T X[gather]_e M=Z  N=H K=TK  (gather timed; groups along K)
  dW2       dW2[e] = dO[gather]_e^T A_e M=H  N=I K=TK  (gather timed; groups along K)

Routing: K distinct experts per token uniformly at random (unequal groups), pairs sorted by expert. bf16, CUDA
events, 3 warm-ups, median of --iters. With --ours FILE (the output of sonicmoe-bench-gemm from the same GPU
call), prints our native kernel's TFLOP/s and the ratio beside each row. With --ours-bin PATH (sonicmoe-bench-gemm)
it runs that binary on each row right after timing torch's (`PATH CONFIG ROW`, a short process), so both sides of
a ratio are measured seconds apart on a GPU in the same state; a long table measured minutes earlier or later
runs at another clock (docs/notes/clocks_and_spread.md).

    python python/bench/gemm_grouped_mm.py --ours bench_gemm.txt [--configs readme-default,olmoe-like]
    python python/bench/gemm_grouped_mm.py --ours-bin dist/sonicmoe-bench-gemm
"""
import argparse
import json
import subprocess
from pathlib import Path

import torch

from timing import cuda_time  # python/bench/timing.py: median of CUDA-event timings

ROOT = Path(__file__).resolve().parents[2]


def read_ours(path):
    """{(config, gemm): native TFLOP/s} from sonicmoe-bench-gemm's table."""
    return read_ours_text(Path(path).read_text()) if path else {}


def read_ours_text(text):
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 6 and parts[5] == "|":
            try:
                out[(parts[0], parts[1])] = float(parts[6])
            except ValueError:
                pass
    return out


def run_ours_row(binary, config, label):
    """Our native kernel's TFLOP/s on one row: `sonicmoe-bench-gemm CONFIG ROW` in its own process."""
    r = subprocess.run([binary, config, label], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"{binary} {config} {label} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    got = read_ours_text(r.stdout).get((config, label))
    if got is None:
        raise SystemExit(f"{binary} {config} {label} printed no '{label}' row:\n{r.stdout}")
    return got


def bench_config(c, iters, ours, check, ours_bin=""):
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    Z, TK = 2 * I, c["T"] * c["K"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1234)

    def rand(*shape):
        return (torch.rand(*shape, device=dev, generator=g, dtype=torch.float32) - 0.5).to(torch.bfloat16)

    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.flatten()
    order = torch.argsort(ids, stable=True)
    gather = (order // K).to(torch.int64)
    offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
    X, dO = rand(T, H), rand(T, H)
    W1, W2 = rand(E, Z, H), rand(E, H, I)
    A, dZ = rand(TK, I), rand(TK, Z)

    rows = [
        ("up", TK, Z, H, lambda: torch._grouped_mm(X.index_select(0, gather), W1.transpose(1, 2), offs=offs)),
        ("down", TK, H, I, lambda: torch._grouped_mm(A, W2.transpose(1, 2), offs=offs)),
        ("dX", TK, H, Z, lambda: torch._grouped_mm(dZ, W1, offs=offs)),
        ("dgated-G", TK, I, H, lambda: torch._grouped_mm(dO.index_select(0, gather), W2, offs=offs)),
        ("dW1", Z, H, TK, lambda: torch._grouped_mm(dZ.t(), X.index_select(0, gather), offs=offs)),
        ("dW2", H, I, TK, lambda: torch._grouped_mm(dO.index_select(0, gather).t(), A, offs=offs)),
    ]
    for label, M, N, Kd, fn in rows:
        if check:  # one expert against a plain matmul: the shapes and layouts mean what the label says
            out = fn().float()
            e = int(torch.argmax(torch.diff(offs, prepend=offs.new_zeros(1))))
            lo, hi = (0 if e == 0 else int(offs[e - 1])), int(offs[e])
            sel = gather[lo:hi]
            ref = {
                "up": lambda: X[sel].float() @ W1[e].float().t(),
                "down": lambda: A[lo:hi].float() @ W2[e].float().t(),
                "dX": lambda: dZ[lo:hi].float() @ W1[e].float(),
                "dgated-G": lambda: dO[sel].float() @ W2[e].float(),
                "dW1": lambda: dZ[lo:hi].float().t() @ X[sel].float(),
                "dW2": lambda: dO[sel].float().t() @ A[lo:hi].float(),
            }[label]()
            got = out[e] if label in ("dW1", "dW2") else out[lo:hi]
            rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
            assert rel < 1e-2, f"{c['name']} {label}: torch._grouped_mm differs from matmul (rel {rel:.2e})"
        ms = cuda_time(fn, iters, warmup=3)
        tflops = 2.0 * M * N * Kd / ms / 1e9
        mine = run_ours_row(ours_bin, c["name"], label) if ours_bin else ours.get((c["name"], label))
        ratio = f"{mine / tflops:8.2f}x" if mine else f"{'-':>9s}"
        print(f"{c['name']:<17s} {label:<9s} {M:>7d} {N:>5d} {Kd:>6d} | {ms:9.3f} {tflops:9.1f} | "
              f"{(f'{mine:.1f}' if mine else '-'):>9s} {ratio}", flush=True)
    del X, dO, W1, W2, A, dZ
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="all", help="comma-separated config names, or all")
    ap.add_argument("--configs-file", default=str(ROOT / "bench" / "bench_configs.json"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ours", default="", help="sonicmoe-bench-gemm output from the same GPU call")
    ap.add_argument("--ours-bin", default="", help="sonicmoe-bench-gemm: run it on each row right after torch's")
    ap.add_argument("--no-check", action="store_true", help="skip the one-expert correctness check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_grouped_mm.py needs a CUDA GPU")
    configs = json.loads(Path(args.configs_file).read_text())["configs"]
    if args.configs != "all":
        names = args.configs.split(",")
        unknown = sorted(set(names) - {c["name"] for c in configs})
        if unknown:
            raise SystemExit(f"unknown config(s): {', '.join(unknown)}")
        configs = [c for c in configs if c["name"] in names]
    ours = read_ours(args.ours)
    print(f"GPU: {torch.cuda.get_device_name()}   torch {torch.__version__}")
    print(f"{'config':<17s} {'gemm':<9s} {'M':>7s} {'N':>5s} {'K':>6s} | {'torch ms':>9s} {'TFLOP/s':>9s} | "
          f"{'ours TF/s':>9s} {'ours/torch':>9s}")
    for c in configs:
        bench_config(c, args.iters, ours, not args.no_check, args.ours_bin)


if __name__ == "__main__":
    main()

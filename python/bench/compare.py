#!/usr/bin/env python3
"""Compares MoE implementations on the shapes of bench/bench_configs.json (GPU; bf16):

  ours        sonicmoe_cpp (top-K, and the token-rounding modes a config lists)
  ours_fp8    sonicmoe_cpp in FP8 blockwise (precision "fp8", top-K), the weights quantised once and cached as
              MoE(precision="fp8") keeps them (not in the default --impls)
  grouped_mm  PyTorch: router, top-K, sort by expert, gather, torch._grouped_mm, activation, torch._grouped_mm,
              weighted scatter-add (autograd through all of it)
  loop        PyTorch: one matmul pair per expert
  cpp         the same layer from C++: `sonicmoe-bench --config NAME --routing topk --no-check` run as a
              subprocess (--bench-bin, default build/device/tools/sonicmoe-bench), once before ours and once
              after ("cpp/after"), so that the binding's overhead is measured in one call, bracketed; its own
              inputs of the same shape; fwd and bwd timed apart (f+b = their sum), peak = its backward peak
              (not in the default --impls)
  original    the original SonicMoE (PyPI sonic-moe 0.1.2.post1, sonicmoe kernel backend; swiglu/geglu), with
              our weights, when it can be imported: stage it with python/bench/stage_original.sh (network),
              then on the GPU machine eval "$(bash python/bench/install_original.sh)" (carry .orig)

For each: forward, backward and forward+backward time (median of --iters, CUDA events), TFLOP/s
(forward 6*N*H*I for GLU / 4*N*H*I otherwise, backward twice that; N = routed pairs) and peak memory
(torch.cuda.max_memory_allocated over one forward+backward, above the parameters). Outputs of the
implementations are compared with ours. Prints a table; writes a PNG of TFLOP/s per config (--plot).

    python python/bench/compare.py --configs readme-default,olmoe-like --iters 20
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from timing import cuda_time, peak_alloc  # python/bench/timing.py: median of CUDA-event timings

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ implementations
def act_fn(z, activation):
    if activation in ("swiglu", "geglu", "reglu"):
        f = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu}[activation]
        return f(z[:, 0::2]) * z[:, 1::2]
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "relu_sq": lambda v: F.relu(v) ** 2}[activation](z)


def route_topk(x, wr, k):
    logits = x @ wr.t()
    vals, ids = torch.topk(logits.float(), k, dim=-1)
    return ids, torch.softmax(vals, -1)


def moe_grouped_mm(x, p, k, activation):
    T, H = x.shape
    E = p["w1"].shape[0]
    ids, s = route_topk(x, p["router"], k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xg = x[tok]
    z = torch._grouped_mm(xg, p["w1"].transpose(1, 2), offs=offs)
    a = act_fn(z, activation)
    y = torch._grouped_mm(a, p["w2"].transpose(1, 2), offs=offs)
    y = y * s.flatten()[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, tok, y)


def moe_loop(x, p, k, activation):
    E = p["w1"].shape[0]
    ids, s = route_topk(x, p["router"], k)
    out = torch.zeros_like(x)
    for e in range(E):
        t, slot = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        y = act_fn(x[t] @ p["w1"][e].t(), activation) @ p["w2"][e].t()
        out = out.index_add(0, t, y * s[t, slot, None].to(y.dtype))
    return out


def moe_ours(x, p, k, activation, routing="topk", tile=128):
    import sonicmoe_cpp as sm
    outs = torch.ops.sonicmoe.forward(x, p["router"], p["w1"], None, p["w2"], None, activation, k, routing, tile,
                                      None, None, None)
    return outs[0]


def make_ours_fp8():
    """Ours in FP8 blockwise (precision "fp8") with the weights quantised once and cached, as MoE(precision="fp8")
    runs by default (sonicmoe_cpp.fp8_cache; the weights do not change between the timed calls)."""
    import sonicmoe_cpp as sm
    from sonicmoe_cpp.fp8_cache import Fp8WeightCache
    cache = Fp8WeightCache()

    def run(x, p, k, activation):
        q = cache.get(p["w1"], p["w2"], activation)
        return sm.moe_topk(x, p["router"], p["w1"], None, p["w2"], None, k, activation, precision="fp8",
                           fp8_weights=q)[0]
    return run


# The original's sonicmoe kernel backend runs these two activations only (sonicmoe/functional/forward.py:78 and
# backward.py:256 assert it; QuACK's gated GEMM); its MoE class takes them as sonicmoe.enums.ActivationType members.
ORIGINAL_ACTIVATIONS = ("swiglu", "geglu")


def make_original(cfg, p, activation):
    """The original package's MoE (PyPI sonic-moe 0.1.2.post1) holding exactly our weights, as (run, params, None),
    or (None, None, reason) when unavailable. On the GPU machine: eval "$(bash python/bench/install_original.sh)".

    Its parameters have our names, shapes and GLU layout (router.weight [E, H]; c_fc.weight [E, 2I, H] with the
    gate of column j in row 2j and its up in row 2j+1, the original's default concat_layout=False; c_proj.weight
    [E, H, I]), so our tensors load as they are. It is called in training mode with the sonicmoe (CuTe DSL / QuACK)
    kernel backend; is_inference_mode=False keeps the pre-activations for the backward (and computes aux_loss,
    which is not part of the timed backward, as for ours). Its parameters are its own copies: bench_impl sets
    their grads to None between iterations."""
    try:
        from sonicmoe import KernelBackendMoE
        from sonicmoe import MoE as OrigMoE
        from sonicmoe.enums import ActivationType as OrigAct
    except Exception as e:  # noqa: BLE001
        return None, None, (f"not importable ({type(e).__name__}: {e}); stage .orig with python/bench/"
                            f"stage_original.sh and install it with python/bench/install_original.sh")
    if activation not in ORIGINAL_ACTIVATIONS:
        return None, None, f"its sonicmoe kernel backend runs {'/'.join(ORIGINAL_ACTIVATIONS)} only, not {activation}"
    try:
        with torch.device("cuda"):  # initialise on the GPU (the constructor draws normal(0, std) weights)
            m = OrigMoE(num_experts=cfg["E"], num_experts_per_tok=cfg["K"], hidden_size=cfg["H"],
                        intermediate_size=cfg["I"], activation_function=OrigAct(activation), add_bias=False,
                        std=0.02)
        m = m.to(dtype=torch.bfloat16).train()
        with torch.no_grad():
            m.load_state_dict({"router.weight": p["router"].detach(), "c_fc.weight": p["w1"].detach(),
                               "c_proj.weight": p["w2"].detach()}, strict=True)
        backend = KernelBackendMoE.sonicmoe

        def run(x, p_, k, activation_):
            out, _aux_loss = m(x, kernel_backend_moe=backend, is_inference_mode=False)
            return out
        return run, list(m.parameters()), None
    except Exception as e:  # noqa: BLE001
        return None, None, f"{type(e).__name__}: {e}"


def warm_original(fn, params, x, p, k, activation, g, n):
    """n untimed forward+backward passes: the original compiles its CuTe DSL kernels and autotunes QuACK's GEMMs
    (compiling every candidate config, in subprocesses, then timing each) on the first call of each shape.
    Returns the seconds they took."""
    t0 = time.perf_counter()
    with torch.enable_grad():
        for _ in range(n):
            for q in params:
                q.grad = None
            xx = x.detach().requires_grad_(True)
            fn(xx, p, k, activation).backward(g)
    torch.cuda.synchronize()
    for q in params:
        q.grad = None
    return time.perf_counter() - t0


def original_agreement(x, p, k, activation, out_orig):
    """The original against ours, split by routing. The original routes on bf16 router logits (F.linear in the
    input dtype), ours on fp32 logits, so near-tied top-K choices differ for a few tokens and dominate the overall
    relative error. Returns (overall rel err, fraction of tokens set aside, rel err over the other tokens): a token
    is set aside when our expert set differs from top-K of the bf16 logits or when its bf16 logits tie at the
    K-th place (either choice is then valid)."""
    with torch.no_grad():
        outs = torch.ops.sonicmoe.forward(x, p["router"], p["w1"], None, p["w2"], None, activation, k, "topk", 128,
                                          None, None, None)
        ours, ours_ids = outs[0], outs[4].long()
        del outs
        logits16 = F.linear(x, p["router"]).float()
        vals, ids16 = torch.topk(logits16, min(k + 1, logits16.shape[1]), dim=-1)
        same = (ids16[:, :k].sort(-1).values == ours_ids.sort(-1).values).all(-1)
        if vals.shape[1] > k:
            same &= vals[:, k - 1] != vals[:, k]
        frac = 1.0 - same.float().mean().item()
        clean = rel_err(out_orig[same], ours[same]) if bool(same.any()) else math.nan
        return rel_err(out_orig, ours), frac, clean


def bench_impl(fn, x, p, params, k, activation, iters, g):
    def fwd():
        return fn(x, p, k, activation)

    def fwdbwd():
        for q in params:
            q.grad = None
        xx = x.detach().requires_grad_(True)
        out = fn(xx, p, k, activation)
        out.backward(g)

    with torch.enable_grad():
        t_f = cuda_time(fwd, iters)
        t_fb = cuda_time(fwdbwd, iters)
        torch.cuda.synchronize()
        for q in params:
            q.grad = None
        peak = peak_alloc(fwdbwd)
        for q in params:
            q.grad = None
        out = fwd().detach()
    return t_f, max(t_fb - t_f, 0.0), t_fb, peak, out


def run_cpp_bench(bench_bin, cfg_file, name, activation, iters):
    """sonicmoe-bench's bf16 top-K row for config `name`: (fwd ms, bwd ms, bwd peak GiB). Raises with its output when
    the run fails or prints no such row."""
    import subprocess
    cmd = [bench_bin, "--configs-file", cfg_file, "--backend", "cuda", "--config", name, "--routing", "topk",
           "--activation", activation, "--no-check", "--iters", str(iters)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in res.stdout.splitlines():
        f = line.split()
        if len(f) > 10 and f[0] == name and f[1] == "topk" and f[2] == "bf16":
            return float(f[4]), float(f[6]), float(f[10].removesuffix("MiB")) / 1024
    tail = (res.stdout + res.stderr).strip().splitlines()[-5:]
    raise RuntimeError(f"{' '.join(cmd)}: exit {res.returncode}, no bf16 topk row for {name}: {' | '.join(tail)}")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="all", help="comma-separated config names of bench_configs.json")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--file", default=str(ROOT / "bench" / "bench_configs.json"))
    ap.add_argument("--activation", default="swiglu")
    ap.add_argument("--impls", default="ours,grouped_mm,loop,original")
    ap.add_argument("--plot", default="compare.png", help="PNG output ('' to skip)")
    ap.add_argument("--json", default="", help="also write the results as JSON here")
    ap.add_argument("--bench-bin", default=str(ROOT / "build" / "device" / "tools" / "sonicmoe-bench"),
                    help="sonicmoe-bench for the cpp impl")
    ap.add_argument("--warmup-original", type=int, default=1,
                    help="untimed forward+backward passes of the original per config before its timing (its first "
                         "call per shape compiles and autotunes; cuda_time's own 2 warm-up calls also cover it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("compare.py needs a CUDA GPU")
    import sonicmoe_cpp  # noqa: F401

    configs = json.load(open(args.file))["configs"]
    if args.configs != "all":
        want = args.configs.split(",")
        unknown = set(want) - {c["name"] for c in configs}
        if unknown:
            sys.exit(f"unknown config(s) {sorted(unknown)}; known: {[c['name'] for c in configs]}")
        configs = [c for c in configs if c["name"] in want]
    impls = args.impls.split(",")
    glu = args.activation in ("swiglu", "geglu", "reglu")
    rows = []
    for cfg in configs:
        T, H, I, E, K = cfg["T"], cfg["H"], cfg["I"], cfg["E"], cfg["K"]
        torch.manual_seed(0)
        dev, dt = "cuda", torch.bfloat16
        zw = 2 * I if glu else I
        p = {"router": (torch.randn(E, H, device=dev) * 0.02).to(dt).requires_grad_(True),
             "w1": (torch.randn(E, zw, H, device=dev) * 0.02).to(dt).requires_grad_(True),
             "w2": (torch.randn(E, H, I, device=dev) * 0.02).to(dt).requires_grad_(True)}
        params = list(p.values())
        x = torch.randn(T, H, device=dev, dtype=dt)
        g = torch.randn(T, H, device=dev, dtype=dt)
        routings = cfg.get("routing", ["topk"])
        tile = cfg.get("tile", 128)
        ref_out = None
        todo = []
        if "cpp" in impls:
            todo.append(("cpp", None, None, "cpp"))
        for r in routings:
            rn = r.replace("-", "_")
            if "ours" in impls:
                todo.append((f"ours/{rn}" if rn != "topk" else "ours",
                             (lambda rn_: (lambda x_, p_, k_, a_: moe_ours(x_, p_, k_, a_, rn_, tile)))(rn), params,
                             rn))
        if "cpp" in impls:
            todo.append(("cpp/after", None, None, "cpp"))
        if "ours_fp8" in impls:
            todo.append(("ours_fp8", make_ours_fp8(), params, "topk"))
        if "grouped_mm" in impls:
            todo.append(("grouped_mm", moe_grouped_mm, params, "topk"))
        if "loop" in impls:
            todo.append(("loop", moe_loop, params, "topk"))
        if "original" in impls:
            fn, oparams, why = make_original(cfg, p, args.activation)
            if fn is not None and args.warmup_original > 0:
                try:
                    secs = warm_original(fn, oparams, x, p, K, args.activation, g, args.warmup_original)
                    print(f"[{cfg['name']}] original: {args.warmup_original} untimed forward+backward "
                          f"(first call: compile + autotune) took {secs:.1f} s", file=sys.stderr)
                except Exception as e:  # noqa: BLE001
                    fn, oparams, why = None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if fn is None:
                print(f"[{cfg['name']}] original sonicmoe unavailable: {why}", file=sys.stderr)
            else:
                todo.append(("original", fn, oparams, "topk"))
        for name, fn, prm, rn in todo:
            try:
                if rn == "cpp":
                    N = T * K
                    fl_f = (6 if glu else 4) * N * H * I
                    t_f, t_b, peak = run_cpp_bench(args.bench_bin, args.file, cfg["name"], args.activation, args.iters)
                    t_fb = t_f + t_b
                    row = dict(config=cfg["name"], impl=name, N=N, fwd_ms=t_f, bwd_ms=t_b, fwdbwd_ms=t_fb,
                               fwd_tflops=fl_f / t_f / 1e9, bwd_tflops=2 * fl_f / t_b / 1e9,
                               fwdbwd_tflops=3 * fl_f / t_fb / 1e9, peak_gib=peak, rel_err_vs_first="")
                    rows.append(row)
                    print_row(row)
                    continue
                if rn == "topk":
                    N = T * K
                else:
                    with torch.no_grad():
                        outs = torch.ops.sonicmoe.forward(x, p["router"], p["w1"], None, p["w2"], None,
                                                          args.activation, K, rn, tile, None, None, None)
                        N = int(outs[11][E].item()) if outs[11].numel() == E + 1 else outs[2].shape[0]
                        del outs
                fl_f = (6 if glu else 4) * N * H * I
                t_f, t_b, t_fb, peak, out = bench_impl(fn, x, p, prm, K, args.activation, args.iters, g)
                err = ""
                if rn == "topk":
                    if ref_out is None:
                        ref_out = out
                    else:
                        err = f"{rel_err(out, ref_out):.2e}"
                row = dict(config=cfg["name"], impl=name, N=N, fwd_ms=t_f, bwd_ms=t_b, fwdbwd_ms=t_fb,
                           fwd_tflops=fl_f / t_f / 1e9, bwd_tflops=(2 * fl_f / t_b / 1e9) if t_b > 0 else math.nan,
                           fwdbwd_tflops=3 * fl_f / t_fb / 1e9, peak_gib=peak / 2**30, rel_err_vs_first=err)
                if name == "original":
                    try:
                        e_all, frac, e_same = original_agreement(x, p, K, args.activation, out)
                        row.update(rel_err_vs_ours=e_all, routing_differs_frac=frac,
                                   rel_err_vs_ours_same_routing=e_same)
                        print(f"[{cfg['name']}] original vs ours: rel err {e_all:.2e} over all tokens; {frac:.2%} "
                              f"of tokens set aside (expert set differs: bf16 vs fp32 router logits, or a bf16 tie "
                              f"at the K-th place); rel err {e_same:.2e} over the rest", file=sys.stderr)
                    except Exception as e:  # noqa: BLE001
                        print(f"[{cfg['name']}] original vs ours: no comparison ({type(e).__name__}: {e})",
                              file=sys.stderr)
            except Exception as e:  # noqa: BLE001
                row = dict(config=cfg["name"], impl=name, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
            rows.append(row)
            print_row(row)
            torch.cuda.empty_cache()
        del p, params, x, g, ref_out
        torch.cuda.empty_cache()

    print()
    print_table(rows)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if args.plot:
        plot(rows, args.plot)


HEAD = f"{'config':<18} {'impl':<20} {'N':>8} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'fwd TF':>7} " \
       f"{'bwd TF':>7} {'f+b TF':>7} {'peak GiB':>8} {'err/ours':>8}"


def fmt(r):
    if "error" in r:
        return f"{r['config']:<18} {r['impl']:<20} ERROR {r['error']}"
    return (f"{r['config']:<18} {r['impl']:<20} {r['N']:>8} {r['fwd_ms']:>8.3f} {r['bwd_ms']:>8.3f} "
            f"{r['fwdbwd_ms']:>8.3f} {r['fwd_tflops']:>7.1f} {r['bwd_tflops']:>7.1f} {r['fwdbwd_tflops']:>7.1f} "
            f"{r['peak_gib']:>8.2f} {r['rel_err_vs_first']:>8}")


def print_row(r):
    print(fmt(r), flush=True)


def print_table(rows):
    print(HEAD)
    print("-" * len(HEAD))
    for r in rows:
        print(fmt(r))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    ok = [r for r in rows if "error" not in r]
    configs = list(dict.fromkeys(r["config"] for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(configs)), 5))
    for i, im in enumerate(impls):
        xs, ys = [], []
        for j, c in enumerate(configs):
            for r in ok:
                if r["config"] == c and r["impl"] == im:
                    xs.append(j + i * width)
                    ys.append(r["fwdbwd_tflops"])
        ax.bar(xs, ys, width, label=im)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
    ax.set_xticklabels(configs, rotation=20, ha="right")
    ax.set_ylabel("forward+backward TFLOP/s (bf16)")
    ax.set_title(f"MoE layer, {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()

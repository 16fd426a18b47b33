"""The expert-parallel cost model of docs/SCALING.md: per-GPU time of one MoE layer's forward+backward under EP = R,
from the all-to-all bytes per token, the link bandwidths and the measured compute, no GPU needed.

    python python/bench/ep_model.py [--config readme-default] [--nvlink-gbps 238] [--ib-gbps 40] \
        [--experts-ms 30.5] [--other-ms 6.3] [--single-ms 32.8]

Model (uniform random top-K routing, experts spread evenly, 8 GPUs a node):
  - a token goes once to every rank that holds at least one of its K experts (this library's dispatch, DeepEP's too):
    expected remote ranks per token n(R) = (R - 1) (1 - C(E - E/R, K) / C(E, K)) (the chance that a given rank holds
    none of the K distinct experts);
  - four exchanges of such rows per forward+backward (dispatch, combine, and their two gradients), 2H bytes a row (bf16);
  - the rows bound for GPUs of the same node move over NVLink at --nvlink-gbps, the others over InfiniBand at
    --ib-gbps (per GPU, one NIC a GPU); an exchange takes the longer of the two;
  - compute per GPU does not change with R (the same T tokens and T K pairs per GPU): experts + other (router, index
    copies) as measured at EP = 2 by ep_bench.py.
Without overlap: t = experts + other + comm. With perfect overlap of communication and expert GEMMs:
t = other + max(experts, comm). Defaults: the H100 measurements of docs/PERFORMANCE.md section 7.
The all-gather dispatch (ExpertParallelMoE(dispatch="all_gather"), no overlap) sends every token to all R - 1 other
ranks (R - 1 rows a token instead of n(R)) and has no plan, gathers or sums (--other-ms-ag); `auto` is the layer's
choice: all-gather where n(R) / (R - 1) >= 0.9.
"""
import argparse
from math import comb

from bench_config import add_config_args, load_config


def remote_ranks(E, K, R):
    """Expected number of other ranks a token is sent to."""
    if R == 1:
        return 0.0
    per = E // R
    return (R - 1) * (1.0 - comb(E - per, K) / comb(E, K))


def exchange_ms(T, H, E, K, R, nvlink_gbps, ib_gbps, gpus_per_node=8, all_gather=False):
    """One exchange (e.g. the forward dispatch) of T tokens' rows, ms; all_gather: every token to every other rank."""
    n = float(R - 1) if all_gather else remote_ranks(E, K, R)
    if n == 0.0:
        return 0.0
    on_node = min(R, gpus_per_node) - 1  # other GPUs of this node that hold experts
    frac_on = on_node / (R - 1)
    row = 2 * H
    t_nv = T * n * frac_on * row / (nvlink_gbps * 1e6)
    t_ib = T * n * (1.0 - frac_on) * row / (ib_gbps * 1e6) if R > gpus_per_node else 0.0
    return max(t_nv, t_ib)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--nvlink-gbps", type=float, default=238.0, help="all_to_all bytes leaving a GPU per second "
                    "over NVLink (ep_bench.py measured 238 on an H100 pair)")
    ap.add_argument("--ib-gbps", type=float, default=40.0, help="per GPU over InfiniBand (400 Gb/s NDR NIC a GPU, "
                    "~80%% efficiency: an assumption, not measured here)")
    ap.add_argument("--experts-ms", type=float, default=30.5, help="the experts' kernels per step (ep_bench)")
    ap.add_argument("--other-ms", type=float, default=6.3, help="router, top-K, index copies per step at EP > 1")
    ap.add_argument("--other-ms-ag", type=float, default=3.4, help="the same with the all-gather dispatch (no plan, "
                    "gathers or sums; ep_bench at EP = 2: f+b minus experts minus exposed collectives)")
    ap.add_argument("--single-ms", type=float, default=32.8, help="the single-GPU layer's forward+backward")
    ap.add_argument("--ranks", default="1,2,4,8,16,32,64")
    args = ap.parse_args()
    c = load_config(args)
    T, H, E, K = c["T"], c["H"], c["E"], c["K"]
    print(f"# EP model, {args.config}: T={T} tokens per GPU, H={H}, E={E}, K={K}; NVLink {args.nvlink_gbps:g} GB/s, "
          f"IB {args.ib_gbps:g} GB/s per GPU; experts {args.experts_ms} ms + other {args.other_ms} ms; single-GPU "
          f"layer {args.single_ms} ms")
    print(f"{'R':>3} {'remote ranks/token':>18} {'MB out/exchange':>15} {'comm ms (4x)':>12} "
          f"{'no overlap ms':>13} {'vs single':>9} {'overlap ms':>10} {'vs single':>9} {'all-gather ms':>13} "
          f"{'vs single':>9} {'auto':>10}")
    for R in (int(r) for r in args.ranks.split(",")):
        if E % R:
            continue
        n = remote_ranks(E, K, R)
        comm = 4 * exchange_ms(T, H, E, K, R, args.nvlink_gbps, args.ib_gbps)
        other = args.other_ms if R > 1 else 0.0
        seq = args.experts_ms + other + comm if R > 1 else args.single_ms  # R = 1: the single-GPU layer itself
        ovl = other + max(args.experts_ms, comm) if R > 1 else args.single_ms
        base = args.single_ms
        comm_ag = 4 * exchange_ms(T, H, E, K, R, args.nvlink_gbps, args.ib_gbps, all_gather=True)
        ag = args.experts_ms + args.other_ms_ag + comm_ag if R > 1 else args.single_ms
        auto = "all_gather" if R > 1 and n / (R - 1) >= 0.9 else "all_to_all" if R > 1 else "-"
        print(f"{R:>3} {n:>18.3f} {T * n * 2 * H / 1e6:>15.1f} {comm:>12.2f} {seq:>13.2f} {base / seq:>9.2f} "
              f"{ovl:>10.2f} {base / ovl:>9.2f} {ag:>13.2f} {base / ag:>9.2f} {auto:>10}")


if __name__ == "__main__":
    main()

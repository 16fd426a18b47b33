"""Interleaved A/B of ExpertParallelMoE's split sums (torchrun, R GPUs): the layer with `split_sums=True` (y's and dx's
sums over the ranks split around their exchanges) against `split_sums=False` (gather_sum over every token, then
reduce_scatter_tensor), the single-GPU `MoE` beside, in alternating rounds in one process, so that the GPUs' drift
over a call (power cap) falls on all three alike; ep_bench.py's rows run one after the other instead.

    python -m torch.distributed.run --nproc_per_node=2 python/bench/ep_split_ab.py --config readme-default [--rounds 8]

Per rank: each round's forward+backward time (median of --iters CUDA-event timings) for the three layers, their
medians over the rounds and EP / single; and whether the split layer's output, dx and every gradient are bitwise the
reduce_scatter layer's after two steps (the second with the early exchange).
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from bench_config import add_config_args, load_config
from timing import cuda_time, train_step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        sys.exit("ep_split_ab.py runs under torchrun on CUDA GPUs")
    import sonicmoe_cpp as sm
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    dist.init_process_group("nccl", device_id=dev)
    c = load_config(args)
    T, H, I, E, K = c["T"], c["H"], c["I"], c["E"], c["K"]
    torch.manual_seed(0)  # the same full layer on every rank; each EP layer keeps this rank's shard
    full = sm.MoE(E, K, H, I).to(dev, dt)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    dy = torch.randn(T, H, device=dev, dtype=dt, generator=g)
    layers = {"single": full, "reduce_scatter": sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD),
              "split": sm.ExpertParallelMoE.from_moe(full, ep_group=dist.group.WORLD)}
    layers["reduce_scatter"].split_sums = False

    grads = {}
    for k in ("reduce_scatter", "split"):
        m = layers[k]
        for _ in range(2):  # the second step runs the early exchange
            m.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_(True)
            y, _ = m(xx)
            y.backward(dy)
        grads[k] = [y.detach(), xx.grad] + [p.grad for p in m.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(grads["reduce_scatter"], grads["split"]))
    del grads
    times = {k: [] for k in layers}
    for _ in range(args.rounds):
        for k, m in layers.items():
            times[k].append(cuda_time(train_step(m, x, dy), args.iters, sync=dist.barrier))
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"rank {rank}: split bitwise reduce_scatter (output, dx, every gradient, two steps): {same}"]
    for k, v in times.items():
        lines.append(f"rank {rank} {k:>14} f+b ms " + " ".join(f"{t:.3f}" for t in v) + f" | median {med[k]:.3f}" +
                     ("" if k == "single" else f", EP / single {med['single'] / med[k]:.4f}"))
    out = [None] * R
    dist.all_gather_object(out, lines)
    if rank == 0:
        print(f"# ep_split_ab {args.config} (T={T} per GPU, H={H}, I={I}, E={E}, K={K}), EP={R}, "
              f"{torch.cuda.get_device_name(dev)}, {args.rounds} rounds of {args.iters} steps")
        for r in out:
            print("\n".join(r))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

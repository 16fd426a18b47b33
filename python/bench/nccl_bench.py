"""The collectives of ExpertParallelMoE alone, at a layer's size: all_gather_into_tensor and reduce_scatter_tensor
(the all-gather dispatch) and all_to_all_single (the all-to-all dispatch) of T rows of H bf16 per rank, over NCCL.

    torchrun --nproc_per_node=2 python/bench/nccl_bench.py --config readme-default [--iters 20]

Median of --iters CUDA-event timings per collective (a barrier before each), and the bytes each GPU sends to the
others per second: (R - 1) T H 2 bytes for each. NCCL's own settings come from the environment (e.g. NCCL_PROTO,
NCCL_ALGO), which is what a run under different ones compares.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from timing import cuda_time
from bench_config import add_config_args, load_config


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        sys.exit("nccl_bench.py runs under torchrun on CUDA GPUs")
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    c = load_config(args)
    T, H = c["T"], c["H"]
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    big = torch.randn(R * T, H, device=dev, dtype=torch.bfloat16)
    out_big, out = torch.empty_like(big), torch.empty_like(x)
    runs = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out_big, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, big),
        "all_to_all_single": lambda: dist.all_to_all_single(out_big, big),
    }
    sent = (R - 1) * T * H * 2
    res = {k: cuda_time(f, args.iters, sync=dist.barrier) for k, f in runs.items()}
    all_res = [None] * R
    dist.all_gather_object(all_res, res)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        print(f"# nccl_bench {args.config}: T={T} rows of H={H} bf16 per rank, R={R}, "
              f"{torch.cuda.get_device_name(dev)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, env {env or '{}'}")
        for k in runs:
            ms = [r[k] for r in all_res]
            print(f"{k:>24}: " + ", ".join(f"rank {i} {m:.3f} ms = {sent / m / 1e6:.0f} GB/s"
                                            for i, m in enumerate(ms)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

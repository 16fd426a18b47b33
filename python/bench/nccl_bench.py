"""The collectives of ExpertParallelMoE alone, at a layer's size: all_gather_into_tensor and reduce_scatter_tensor
(the all-gather dispatch) and all_to_all_single (the all-to-all dispatch) of T rows of H bf16 per rank, over NCCL.

    torchrun --nproc_per_node=2 python/bench/nccl_bench.py --config readme-default [--iters 20]

Median of --iters CUDA-event timings per collective (a barrier before each), and the bytes each GPU sends to the
others per second: (R - 1) T H 2 bytes for each. NCCL's own settings come from the environment (e.g. NCCL_PROTO,
NCCL_ALGO, NCCL_MIN_NCHANNELS), which is what a run under different ones compares.

--p2p adds the same two exchanges as NCCL point-to-point calls (batch_isend_irecv: each peer's rows or block sent and
received directly), the all-gather's own rows copied on the compute stream meanwhile, the reduce-scatter's received
blocks summed into this rank's block after; and the all-gather as a list all_to_all of R views of x (what
ExpertParallelMoE's gathers use over NCCL).

--split-aggregate N[,N...] (R = 2) adds the forward's combine of the all-gather dispatch as ExpertParallelMoE runs it
(its _SplitSum) against the library's gather_sum over every token then reduce_scatter_tensor: random partial rows of
this rank's experts (K / R pairs a token) summed per token, the other rank's tokens first in N chunks, each sent as it
is summed, this rank's summed while they travel ("own first") or after each chunk arrives ("own after recv"); each
checked bitwise against the reduce_scatter's result.

--copy-engine adds the same two collectives done with copy engines over symmetric memory
(torch.distributed._symmetric_memory): the all-gather pulls each peer's rows from its symmetric buffer into the output,
the reduce-scatter pushes each peer's block into that peer's buffer and sums what it received; a barrier kernel on
either side of the copies. --overlap N also times each collective beside N bf16 GEMMs of 8192^3 on the main stream
(the collective on a second stream, started first): the GEMMs alone, the collective alone, both together, and the
share of the collective's time that the overlap hid.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

from timing import cuda_time
from bench_config import add_config_args, load_config


def copy_engine_runs(x, big, out_big, out, rank, R, split):
    """The all-gather and the reduce-scatter by copy engines: copies between this rank's tensors and the peers'
    symmetric buffers (a device-to-device cudaMemcpyAsync each), a barrier kernel before and after; with split > 1
    also the all-gather whose pull is cut into `split` row ranges, each copied on its own stream (several copy
    engines at once)."""
    import torch.distributed._symmetric_memory as symm_mem
    T, H = x.shape
    ws = symm_mem.empty(R * T * H, dtype=x.dtype, device=x.device)  # slot r: rank r's rows (gather) or block (scatter)
    hdl = symm_mem.rendezvous(ws, dist.group.WORLD)
    slot = lambda r, owner: hdl.get_buffer(owner, (T, H), x.dtype, r * T * H)
    peers = [(r + rank) % R for r in range(1, R)]

    def all_gather():
        slot(rank, rank).copy_(x)
        hdl.barrier(channel=0)
        out_big[rank * T:(rank + 1) * T].copy_(x)
        for r in peers:  # pull rank r's rows from its buffer
            out_big[r * T:(r + 1) * T].copy_(slot(r, r))
        hdl.barrier(channel=1)

    def reduce_scatter():
        hdl.barrier(channel=0)
        for r in peers:  # push rank r's block into its buffer
            slot(rank, r).copy_(big[r * T:(r + 1) * T])
        hdl.barrier(channel=1)
        torch.sum(torch.stack([big[rank * T:(rank + 1) * T]] + [slot(r, rank) for r in peers]), 0, out=out)

    streams = [torch.cuda.Stream(x.device) for _ in range(split)]

    def all_gather_split():
        slot(rank, rank).copy_(x)
        hdl.barrier(channel=0)
        main = torch.cuda.current_stream()
        out_big[rank * T:(rank + 1) * T].copy_(x)
        for s in streams:
            s.wait_stream(main)
        for i, s in enumerate(streams):
            lo, hi = T * i // split, T * (i + 1) // split
            with torch.cuda.stream(s):
                for r in peers:
                    out_big[r * T + lo:r * T + hi].copy_(slot(r, r)[lo:hi])
        for s in streams:
            main.wait_stream(s)
        hdl.barrier(channel=1)

    runs = {"ce all_gather (pull)": all_gather, "ce reduce_scatter (push)": reduce_scatter}
    if split > 1:
        runs[f"ce all_gather (pull, {split} streams)"] = all_gather_split
    return runs


def p2p_runs(x, big, out_big, out, rank, R):
    """The all-gather and the reduce-scatter as NCCL send / receive pairs with every peer (one batch_isend_irecv):
    the gather copies its own rows on the current stream while the peers' travel; the scatter sums what it
    received into its own block."""
    T = x.shape[0]
    peers = [(rank + r) % R for r in range(1, R)]
    got = torch.empty((R - 1, T) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)

    def all_gather():
        ops = []
        for r in peers:
            ops += [dist.P2POp(dist.isend, x, r), dist.P2POp(dist.irecv, out_big[r * T:(r + 1) * T], r)]
        reqs = dist.batch_isend_irecv(ops)
        out_big[rank * T:(rank + 1) * T].copy_(x)
        for q in reqs:
            q.wait()

    def reduce_scatter():
        ops = []
        for i, r in enumerate(peers):
            ops += [dist.P2POp(dist.isend, big[r * T:(r + 1) * T], r), dist.P2POp(dist.irecv, got[i], r)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        torch.add(big[rank * T:(rank + 1) * T], got.sum(0) if R > 2 else got[0], out=out)

    outs = list(out_big.view((R,) + tuple(x.shape)).unbind(0))

    def all_gather_a2a():
        dist.all_to_all(outs, [x] * R)

    return {"p2p all_gather": all_gather, "all_to_all of R views of x (gather)": all_gather_a2a,
            "p2p reduce_scatter (+ sum)": reduce_scatter}


def split_aggregate_runs(T, H, K, R, rank, chunks, dev):
    """The forward's aggregation + reduce_scatter (the all-gather dispatch's combine) as today and split around the
    exchange: this rank's experts' partial rows Y [P, H] (P = T K rows in random order, K / R pairs for each of the
    R T gathered tokens) summed per token by the library's gather_sum. Today: all R T tokens aggregated, then
    reduce_scatter_tensor. Split (R = 2), n chunks: the peer's tokens aggregated chunk by chunk, each chunk sent as it
    is done (NCCL send / receive pairs, the peer's chunk of this rank's tokens received), this rank's tokens aggregated
    while they travel, each received chunk added after. Returns the runs and a check that both give the same bits."""
    import sonicmoe_cpp  # noqa: F401  (registers torch.ops.sonicmoe)
    gather_sum = torch.ops.sonicmoe.gather_sum
    kl = K // R
    P = R * T * kl
    y = torch.randn(P, H, device=dev, dtype=torch.bfloat16)
    rev = torch.randperm(P, device=dev).to(torch.int32)
    off = (torch.arange(R * T + 1, device=dev, dtype=torch.int32) * kl)
    peer = 1 - rank
    out = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
    got = torch.empty(T, H, device=dev, dtype=torch.bfloat16)

    def today():
        full = gather_sum(y, rev, off)
        dist.reduce_scatter_tensor(out, full)

    def exchange(part, into, a2a):
        """part to the peer, the peer's into `into`: send / receive pairs, or all_to_all_single with no rows to self."""
        if a2a:
            sizes = [0, 0]
            sizes[peer] = part.shape[0]
            return [dist.all_to_all_single(into, part, sizes, sizes, async_op=True)]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, part, peer), dist.P2POp(dist.irecv, into, peer)])

    def split(n, wait_first, a2a=False):
        bounds = [T * j // n for j in range(n + 1)]

        def run():
            reqs = []
            for j in range(n):  # the peer's tokens, chunk j: aggregated, then sent while chunk j + 1 is aggregated
                a, b = peer * T + bounds[j], peer * T + bounds[j + 1]
                part = gather_sum(y, rev, off[a:b + 1])
                reqs.append(exchange(part, got[bounds[j]:bounds[j + 1]], a2a))
            if wait_first:  # each own chunk after its received rows (the add then reads them at once)
                for j in range(n):
                    for q in reqs[j]:
                        q.wait()
                    a, b = rank * T + bounds[j], rank * T + bounds[j + 1]
                    torch.add(gather_sum(y, rev, off[a:b + 1]), got[bounds[j]:bounds[j + 1]],
                              out=out[bounds[j]:bounds[j + 1]])
            else:  # every own chunk while the chunks travel, the adds after
                mine = gather_sum(y, rev, off[rank * T:(rank + 1) * T + 1])
                for j in range(n):
                    for q in reqs[j]:
                        q.wait()
                    torch.add(mine[bounds[j]:bounds[j + 1]], got[bounds[j]:bounds[j + 1]],
                              out=out[bounds[j]:bounds[j + 1]])
        return run

    runs = {"aggregate alone (R T tokens)": lambda: gather_sum(y, rev, off),
            "aggregate + reduce_scatter": today}
    for n in chunks:
        runs[f"split, {n} chunks, own after recv"] = split(n, True)
        runs[f"split, {n} chunks, own first"] = split(n, False)
        runs[f"split, {n} chunks, own first, a2a"] = split(n, False, True)
    today()
    torch.cuda.synchronize()
    ref = out.clone()
    same = {}
    for k, f in runs.items():
        if k.startswith("split"):
            out.fill_(float("nan"))
            f()
            torch.cuda.synchronize()
            same[k] = bool(torch.equal(out, ref))
    return runs, same


def overlap_runs(runs, n, iters, dev):
    """Each collective on a side stream beside n GEMMs on the main stream; the GEMMs alone."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    side = torch.cuda.Stream(dev)

    def gemms():
        for _ in range(n):
            torch.mm(a, b, out=c)

    def together(f):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                f()
            gemms()
            torch.cuda.current_stream().wait_stream(side)
        return run

    res = {"gemms": cuda_time(gemms, iters, sync=dist.barrier)}
    for k, f in runs.items():
        res["with " + k] = cuda_time(together(f), iters, sync=dist.barrier)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--copy-engine", action="store_true", help="also the collectives by copy engines (symmetric memory)")
    ap.add_argument("--ce-split", type=int, default=4, metavar="N",
                    help="with --copy-engine, also the all-gather pulled on N streams at once (1: not)")
    ap.add_argument("--p2p", action="store_true", help="also the collectives as NCCL send / receive pairs")
    ap.add_argument("--split-aggregate", default="", metavar="N,N",
                    help="also the forward's aggregation + reduce_scatter split around the exchange in N chunks (R = 2)")
    ap.add_argument("--overlap", type=int, default=0, metavar="N", help="also time each beside N 8192^3 bf16 GEMMs")
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
    if args.p2p:
        runs.update(p2p_runs(x, big, out_big, out, rank, R))
    if args.copy_engine:
        runs.update(copy_engine_runs(x, big, out_big, out, rank, R, args.ce_split))
    same = {}
    if args.split_aggregate:
        if R != 2:
            sys.exit("nccl_bench.py: --split-aggregate needs 2 ranks")
        split, same = split_aggregate_runs(T, H, c["K"], R, rank, [int(n) for n in args.split_aggregate.split(",")],
                                           dev)
        runs.update(split)
    sent = (R - 1) * T * H * 2
    res = {k: cuda_time(f, args.iters, sync=dist.barrier) for k, f in runs.items()}
    res["same"] = same
    if args.overlap:
        res.update(overlap_runs(runs, args.overlap, args.iters, dev))
    all_res = [None] * R
    dist.all_gather_object(all_res, res)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        print(f"# nccl_bench {args.config}: T={T} rows of H={H} bf16 per rank, R={R}, "
              f"{torch.cuda.get_device_name(dev)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, env {env or '{}'}")
        for k in runs:
            ms = [r[k] for r in all_res]
            print(f"{k:>28}: " + ", ".join(f"rank {i} {m:.3f} ms = {sent / m / 1e6:.0f} GB/s"
                                            for i, m in enumerate(ms)))
        for k in same:
            print(f"{k}: bitwise the reduce_scatter's on every rank: {all(r['same'][k] for r in all_res)}")
        if args.overlap:
            g = [r["gemms"] for r in all_res]
            print(f"# beside {args.overlap} GEMMs of 8192^3 bf16 (alone: " + ", ".join(f"rank {i} {m:.3f} ms" for i, m
                                                                                   in enumerate(g)) + ")")
            for k in runs:
                both = [r["with " + k] for r in all_res]
                hid = [(gi + r[k] - b) / r[k] for gi, r, b in zip(g, all_res, both)]
                print(f"{k:>28}: together " + ", ".join(f"rank {i} {b:.3f} ms (hid {h:.0%})"
                                                        for i, (b, h) in enumerate(zip(both, hid))))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""CUDA-event timing shared by the benchmark scripts (compare.py, ep_bench.py, gemm_grouped_mm.py)."""
import statistics

import torch


def cuda_time(fn, iters, warmup=2, sync=None):
    """Median milliseconds of `iters` calls of fn, each between two CUDA events, after `warmup` untimed calls.
    `sync` (e.g. a process-group barrier) runs before each timed call, outside the events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync:
            sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def peak_alloc(fn):
    """Peak bytes allocated while fn runs, above what was allocated when it started (the caching allocator's count)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base

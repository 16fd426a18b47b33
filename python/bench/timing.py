"""CUDA-event timing shared by the benchmark scripts (compare.py, ep_bench.py, ep_split_ab.py, gemm_grouped_mm.py, ...),
and the forward+backward step the expert-parallel ones time."""
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


def train_step(layer, x, dy):
    """A function running one forward+backward of `layer` (a module returning (output, aux_loss)) on a fresh leaf copy
    of x with output gradient dy, after clearing the layer's parameter gradients."""
    def step():
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        y, _ = layer(xx)
        y.backward(dy)
    return step


def peak_alloc(fn):
    """Peak bytes allocated while fn runs, above what was allocated when it started (the caching allocator's count)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base

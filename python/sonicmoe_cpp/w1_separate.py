"""W1 as separate gate and up tensors (w1_layout "separate", torchtitan's w1 / w3): the address rule the layer reads
them by, and the copy the binding falls back to when two tensors break it.

The library reads the pair in place as one [2, E, I, H] view whose part stride is up - gate (sonicmoe::
w1_separate_view; docs/DESIGN.md section 2, "Other W1 layouts"): up must lie above gate, on a CUDA device by a
multiple of 16 bytes below 2^40 (TMA's stride rule). Two halves of one allocation (MoE(w1_layout="separate") keeps its
gate and up parameters so: `pair_storage`) qualify; independently allocated tensors only by chance. For a pair that
does not, `packed` copies both into one padded buffer whose halves qualify, warns once, and keeps the copy while
neither tensor changes: the entry is keyed on each tensor's (data_ptr, _version, shape, stride, dtype, device) and the
count of torch.optim steps (as sonicmoe_cpp.fp8_cache), so micro-batches of one optimizer step copy once. Gradients
flow back to the caller's tensors unchanged. While a CUDA graph is captured and under torch.inference_mode the copy is
made per call (differentiable torch ops, no cache); under torch.compile the pair goes to the op as it is.
"""
import warnings
import weakref

import torch

from . import fp8_cache as _fp8_cache

_TMA_STRIDE_LIMIT = 1 << 40


def addresses_ok(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """sonicmoe::w1_separate_addresses_ok: up above gate; on CUDA by a multiple of 16 bytes below 2^40."""
    d = up.data_ptr() - gate.data_ptr()
    if d <= 0:
        return False
    return not gate.is_cuda or (d % 16 == 0 and d < _TMA_STRIDE_LIMIT)


def _part_stride(n: int, element_size: int) -> int:
    """Elements from the gate half's start to the up half's: n rounded up to whole 16 bytes."""
    per = max(1, 16 // element_size)
    return -(-n // per) * per


def pair_storage(shape, dtype=None, device=None) -> torch.Tensor:
    """A [2, *shape] tensor whose two halves satisfy addresses_ok (the second half starts a whole number of 16 bytes
    after the first: padded when numel(shape) elements do not fill them). Returns the [2, *shape] view when no padding
    is needed, else a strided view over a padded buffer; index [0] / [1] for the halves (each contiguous)."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    n = 1
    for s in shape:
        n *= int(s)
    part = _part_stride(n, torch.empty((), dtype=dtype).element_size())
    flat = torch.empty(part + n, dtype=dtype, device=device)
    inner = torch.empty(tuple(shape), dtype=dtype, device="meta").stride() if shape else ()
    return flat.as_strided((2, *shape), (part, *inner))


_WARNED = [False]
_CACHE = {}  # id(gate tensor) -> (key, storages, (gate, up) copies); dropped with the tensor (weakref.finalize)


def _warn_once(gate, up):
    if not _WARNED[0]:
        _WARNED[0] = True
        warnings.warn(
            f"sonicmoe_cpp: w1_layout 'separate': the up tensor (at {up.data_ptr():#x}) does not lie above the gate "
            f"(at {gate.data_ptr():#x}) by a multiple of 16 bytes, so the layer cannot read the pair in place; it is "
            "copied into one [2, E, I, H] buffer (kept while the weights are unchanged). Keep gate and up as the two "
            "halves of one allocation (MoE(w1_layout='separate') does) to avoid the copy.", stacklevel=3)


def joined(gate: torch.Tensor, up: torch.Tensor):
    """(gate, up) copied into the two halves of one new buffer that satisfies addresses_ok, by differentiable torch
    ops (a copy per call; no cache, no warning)."""
    flat_g, flat_u = gate.reshape(-1), up.reshape(-1)
    n = flat_g.numel()
    pad = flat_g.new_zeros((_part_stride(n, gate.element_size()) - n,))
    flat = torch.cat((flat_g, pad, flat_u))
    return flat[:n].view(gate.shape), flat[n + pad.numel():].view(up.shape)


class _PackedPair(torch.autograd.Function):
    """(gate, up) -> the halves of a cached copy; the gradients pass through to gate and up unchanged."""

    @staticmethod
    def forward(ctx, gate, up, buf):
        return buf[0], buf[1]

    @staticmethod
    def backward(ctx, g_gate, g_up):
        return g_gate, g_up, None


def packed(gate: torch.Tensor, up: torch.Tensor):
    """(gate, up) as the two halves of one buffer that satisfies addresses_ok (see the module docstring); the pair
    itself when it already does. Under torch.compile the pair is passed as it is (a traced graph has no addresses):
    the op then raises, naming both tensors, for a pair it cannot read in place."""
    if torch.compiler.is_compiling() or addresses_ok(gate, up):
        return gate, up
    _warn_once(gate, up)
    if not _fp8_cache.usable(gate, gate, up):  # CUDA-graph capture, inference mode: per call, differentiable
        return joined(gate, up)
    _fp8_cache._install_optimizer_hook()
    key = (_fp8_cache._key_of(gate), _fp8_cache._key_of(up), _fp8_cache._OPTIMIZER_STEPS[0])
    entry = _CACHE.get(id(gate))
    if entry is None or entry[0] != key:
        if entry is None:
            weakref.finalize(gate, _CACHE.pop, id(gate), None)
        _CACHE.pop(id(gate), None)  # the old copy goes first: the peak holds one
        with torch.no_grad():
            buf = joined(gate.detach(), up.detach())
        entry = (key, (gate.untyped_storage(), up.untyped_storage()), buf)
        _CACHE[id(gate)] = entry
    buf = entry[2]
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _PackedPair.apply(gate, up, buf)
    return buf[0], buf[1]


def clear_cache():
    """Drops every cached copy."""
    _CACHE.clear()

"""The FP8 weight cache of MoE(precision="fp8") and ExpertParallelMoE: W1 and W2 quantised 128x128 (codes and scales,
with the transposed copy the backward reads, W1^T; nothing reads W2^T, which is not made) kept across calls, so that
micro-batches of one optimizer step quantise the weights once.

An entry is keyed on each weight's (data_ptr, _version, shape, stride, dtype, device), the activation, and a count of
torch.optim optimizer steps (a global post-step hook, installed on the first lookup of any cache): an in-place update of a
weight (an optimizer step, `with torch.no_grad(): w.add_(...)`, load_state_dict's copy_) bumps its _version, a new
tensor has another data_ptr or the entry's storage is still held (below), and a torch.optim step changes the count
even where the optimizer wrote through `.data` (which has its own version counter). Writes that none of these see -
through `param.data` outside a torch.optim step, or a kernel writing the weight's memory without telling autograd -
need MoE.invalidate_fp8_weight_cache().

The entry holds a reference to the weights' storages, so that while it lives no other tensor can take their
addresses (a replaced `param.data` cannot alias the key); they are let go on the next miss or clear().

Under FSDP2 (`fully_shard`) the weights a forward sees are the parameters FSDP gathered for it: new tensors, or new
versions, at every gather, so keyed on them the cache would quantise at every forward. A weight that is FSDP2's
gathered parameter is keyed instead on its sharded parameter (the DTensor and its local shard: data_ptr, _version),
which changes exactly when the weight does (an optimizer step, an in-place update, load_state_dict); the gather
itself writes the same values again. FSDP2's parameter is found through its private state (torch 2.11); where that
is not there, the gathered tensor is the key, as for any other weight.

Not used (the call quantises its weights itself, as without the cache) under torch.compile (the graph would bake the
lookup in), while a CUDA graph is being captured (a replay would read the captured quantised weights, stale after the
next optimizer step), under torch.inference_mode, and for inference tensors.
"""
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_OPTIMIZER_STEPS = [0]
_HOOK = []


def _count_step(optimizer, args, kwargs):
    _OPTIMIZER_STEPS[0] += 1


def _install_optimizer_hook():
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_count_step))


def _key_of(t):
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


def _fsdp_params(module_state_mapping):
    """FSDP2's FSDPParam objects alive in this process, from its private module -> state mapping (torch 2.11)."""
    found = []
    for ref in list(module_state_mapping.values()):
        group = getattr(ref(), "_fsdp_param_group", None)
        found.extend(getattr(group, "fsdp_params", None) or [])
    return found


class _FsdpSource:
    """Finds the FSDP2 sharded parameter behind a gathered weight (None when the weight is not one). Remembers the
    FSDPParam it found (each call checks it still gathered this very tensor) and, when it found none, the number of
    FSDP2 states it searched (it searches again only when fully_shard has been applied since)."""

    def __init__(self):
        self._found = None
        self._searched = None

    def __call__(self, t):
        fp = self._found
        if fp is not None and getattr(fp, "_unsharded_param", None) is t:
            return fp.sharded_param
        try:
            from torch.distributed._composable_state import _module_state_mapping
        except ImportError:
            return None
        n = len(_module_state_mapping)
        if n == 0 or (fp is None and self._searched == n):
            return None
        self._searched = n
        self._found = next((p for p in _fsdp_params(_module_state_mapping)
                            if getattr(p, "_unsharded_param", None) is t), None)
        return self._found.sharded_param if self._found is not None else None


def _source_key(t, source):
    """The cache key of weight t: its own (_key_of), or, for FSDP2's gathered parameter, its sharded parameter's
    (the DTensor's version and its local shard's address and version) with t's shape, dtype and device."""
    if source is None:
        return _key_of(t)
    local = getattr(source, "_local_tensor", source)
    return ("fsdp", id(source), source._version, local.data_ptr(), local._version, tuple(t.shape), t.dtype,
            t.device)


def usable(x, *weights) -> bool:
    """Whether the cache may serve a call with input x and these weights (see the module docstring)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return False
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return not any(w.is_inference() for w in weights)


def quantize(w1, w2, activation, transposed=True):
    """fp8_quantize_weights of the weights the layer computes with: fp32 weights on CUDA run in bf16 (sonicmoe_cpp._run),
    so their bf16 copies are quantised."""
    with torch.no_grad():
        w1, w2 = w1.detach(), w2.detach()
        if w1.is_cuda and w1.dtype == torch.float32:
            w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
        return torch.ops.sonicmoe.fp8_quantize_weights(w1.contiguous(), w2.contiguous(), activation, transposed)


class Fp8WeightCache:
    """One layer's quantised W1 and W2 (torch.ops.sonicmoe.fp8_quantize_weights' 8 tensors) and their key.
    hits / misses count the lookups."""

    def __init__(self):
        self._key = None
        self._storages = None
        self._weights = None
        self._sources = (_FsdpSource(), _FsdpSource())
        self.hits = 0
        self.misses = 0

    def get(self, w1, w2, activation):
        """The quantised weights of (w1, w2), from the cache when their key is unchanged, else quantised now."""
        _install_optimizer_hook()
        src = (self._sources[0](w1), self._sources[1](w2))
        key = (_source_key(w1, src[0]), _source_key(w2, src[1]), activation, _OPTIMIZER_STEPS[0])
        if key == self._key:
            self.hits += 1
            return self._weights
        self.clear()  # the old entry goes first: the peak holds one copy
        self._weights = quantize(w1, w2, activation)
        # (the storages of what the key names: FSDP2's sharded parameters keep theirs anyway)
        self._storages = tuple(s if s is not None else w.untyped_storage() for w, s in zip((w1, w2), src))
        self._key = key
        self.misses += 1
        return self._weights

    def clear(self):
        self._key = self._storages = self._weights = None

    def nbytes(self) -> int:
        """Bytes held by the quantised weights (0 when empty)."""
        return sum(t.numel() * t.element_size() for t in self._weights) if self._weights else 0

    def tensors(self):
        """The cached tensors (a list of 8, see FP8_WEIGHT_NAMES in sonicmoe_cpp._ops), or None when empty."""
        return self._weights


class Fp8CachedModule:
    """The module side of the cache, shared by MoE and ExpertParallelMoE (mixed in before nn.Module): the `precision`
    and `fp8_weight_cache` properties (setting either empties the cache), invalidate_fp8_weight_cache(), the cache
    emptied when the module moves (.to, .cuda, .bfloat16: the weights become new tensors), and _fp8_weights(x, w1,
    w2), the quantised weights a call under precision "fp8" gets (None: the call quantises them itself)."""

    _fp8_cache = None
    _precision = "bf16"
    _where = "sonicmoe_cpp.MoE"  # the class's name in messages

    @property
    def precision(self) -> str:
        """"bf16", "fp8" or "fp8_wgrad"; setting it empties the FP8 weight cache."""
        return self._precision

    @precision.setter
    def precision(self, value):
        from ._ops import normalize_precision
        self._precision = normalize_precision(value, f"{self._where}: argument 'precision'")
        self.invalidate_fp8_weight_cache()

    @property
    def fp8_weight_cache(self) -> bool:
        """Whether precision "fp8" keeps the quantised weights across calls (see the class docstring)."""
        return self._fp8_cache is not None

    @fp8_weight_cache.setter
    def fp8_weight_cache(self, on):
        from . import _bool_arg
        on = _bool_arg("fp8_weight_cache", on, self._where)
        self._fp8_cache = Fp8WeightCache() if on else None

    def invalidate_fp8_weight_cache(self):
        """Drops the quantised weights (the next FP8 call quantises again)."""
        if self._fp8_cache is not None:
            self._fp8_cache.clear()

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_fp8_weight_cache()  # .to / .cuda / .bfloat16 ...: the weights are new tensors
        return super()._apply(fn, *args, **kwargs)

    def __setstate__(self, state):
        # a module pickled when `precision` was a plain attribute
        if "precision" in state and "_precision" not in state:
            state["_precision"] = state.pop("precision")
        super().__setstate__(state)

    def _fp8_weights(self, x, w1, w2, activation, compute_dtype=None):
        """The cached quantised (w1, w2) for a call with input x under the module's precision, or None where that is
        bf16, the cache is off or does not apply (usable()). compute_dtype: the dtype the call computes the weights
        in when it casts them (torch.autocast), else None."""
        from ._ops import FP8_PRECISIONS
        if self._precision not in FP8_PRECISIONS or self._fp8_cache is None or not usable(x, w1, w2):
            return None
        if w1.dtype == torch.float16:  # the FP8 layer refuses f16 (the op's message says so): nothing to quantise
            return None
        if compute_dtype not in (None, w1.dtype) and not x.is_cuda:
            return None  # the call computes from cast copies; on the CPU the cache quantises the weights as they are
        return self._fp8_cache.get(w1, w2, activation)

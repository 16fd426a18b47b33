"""KernelBackendMoE.torch: the layer written in plain PyTorch ops (as the original's `torch` backend is), for
checking the kernels from outside the library. Same computation as `MoE` with its router keywords (top-K routing):

  logits = x W_r^T in fp32; the router's K picks and weights (ties to the lower expert id); per expert e and its
  rows, Z = x W1[e]^T + b1[e] in x's dtype (fp32 accumulation), A = act(Z) computed in fp32 and rounded to x's
  dtype, Y = A W2[e]^T + b2[e]; out[t] = sum over t's picks of weight * Y, summed in fp32; aux loss = the switch
  loss E * sum_e mean_t(softmax(logits))_e * f_e / sum f (f: the picks per expert).

Autograd gives every gradient. It is a reference: a loop over experts, one host read of the per-expert counts.
Token rounding, a capacity factor and FP8 are the kernels' alone (a ValueError names them here).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

_GLU_GATES = {"swiglu": F.silu, "geglu": F.gelu, "reglu": F.relu,
              "geglu_tanh": lambda v: F.gelu(v, approximate="tanh")}
_PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu, "silu": F.silu,
          "relu_sq": lambda v: F.relu(v).square()}


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    """act(Z) in fp32 for a layer's Z [rows, z_width]; GLU activations read gate / up interleaved (columns 2j / 2j+1)."""
    z = z.float()
    if name in _GLU_GATES:
        return _GLU_GATES[name](z[:, 0::2]) * z[:, 1::2]
    return _PLAIN[name](z)


def _descending(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, ties to the lower index (a stable descending sort)."""
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, k: int, cfg: dict, bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, weights [T, k] fp32) of the router `cfg` (MoE.router_config) on fp32 logits [T, E]."""
    T, E = logits.shape
    scale = float(cfg.get("routed_scaling_factor", 1.0))
    sigmoid = cfg.get("scoring_func", "softmax") == "sigmoid"
    if not sigmoid and cfg.get("softmax_over_topk", True):  # select by logit, softmax over the K picks
        ids = _descending(logits.detach(), k)
        return ids, torch.softmax(logits.gather(1, ids), dim=-1) * scale
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    key = scores.detach() + (bias.to(scores.dtype) if bias is not None else 0.0)
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if n_group > 1:  # groups ranked by the sum of their two best keys; experts outside the best topk_group masked
        grouped = key.view(T, n_group, E // n_group)
        best = _descending(grouped.topk(2, dim=-1).values.sum(-1), topk_group)  # [T, topk_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=key.device).scatter_(1, best, True)
        key = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = _descending(key, k)
    w = scores.gather(1, ids)
    if cfg.get("norm_topk_probs", False):
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    return ids, w * scale


def aux_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    T, E = logits.shape
    f = torch.zeros(E, dtype=torch.float32, device=logits.device).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float32, device=logits.device))
    p = torch.softmax(logits, dim=-1).sum(0) / max(T, 1)
    return E * (p * (f / f.sum().clamp_min(1.0))).sum()


def zero_anchor(*tensors) -> torch.Tensor:
    """A float32 zero connected to every floating-point tensor given (None and other values skipped): added to an
    empty result, autograd then returns zero gradients for those inputs rather than None. Sums of empty slices, so a
    NaN or inf value cannot make it non-zero."""
    return sum(t.reshape(-1)[:0].sum().float() for t in tensors
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
            w2: torch.Tensor, b2: Optional[torch.Tensor], act: str) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), in x's dtype (the sum in fp32)."""
    T, K = ids.shape
    E = w1.shape[0]
    pairs = torch.sort(ids.reshape(-1), stable=True).indices  # pairs grouped by expert, in token order
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    ys, rows = [], []
    for e, sel in enumerate(torch.split(pairs, counts)):
        if sel.numel() == 0:
            continue
        tok = sel // K
        z = x[tok] @ w1[e].t()
        if b1 is not None:
            z = z + b1[e]
        y = activation(z, act).to(x.dtype) @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        ys.append(y.float() * weights.reshape(-1)[sel, None])
        rows.append(tok)
    out = x.new_zeros(x.shape, dtype=torch.float32)
    if ys:
        out = out.index_add(0, torch.cat(rows), torch.cat(ys))
    else:  # no pairs (no tokens): still connected to the inputs (zero gradients), as the kernels' output is
        out = out + zero_anchor(x, weights, w1, b1, w2, b2)
    return out.to(x.dtype)


def moe_torch(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
              w2: torch.Tensor, b2: Optional[torch.Tensor], act: str, k: int, cfg: dict,
              bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H], aux_loss) of the layer in PyTorch ops; x [T, H], weights in MoE's layouts."""
    logits = x.float() @ router_weight.float().t()
    ids, weights = route(logits, k, cfg, bias)
    return experts(x, ids, weights, w1, b1, w2, b2, act), aux_loss(logits, ids)

"""A plain PyTorch (float64) MoE written for the tests: top-K, general routing and token rounding, following
docs/ALGORITHM.md. Autograd of these functions gives the reference gradients."""
import torch
import torch.nn.functional as F

GLU = ("swiglu", "geglu", "reglu", "geglu_tanh")


def act(z, name):
    if name in GLU:
        gate, up = z[:, 0::2], z[:, 1::2]
        f = {"swiglu": F.silu, "geglu": lambda v: F.gelu(v), "reglu": F.relu,
             "geglu_tanh": lambda v: F.gelu(v, approximate="tanh")}[name]
        return f(gate) * up
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "relu":
        return F.relu(z)
    if name == "silu":
        return F.silu(z)
    if name == "relu_sq":
        return F.relu(z) ** 2
    raise ValueError(name)


def experts(x, tok, exp, score, w1, b1, w2, b2, activation):
    """out[t] = sum over pairs (t, e, s) of s * (act(x[t] W1[e]^T + b1[e]) W2[e]^T + b2[e])."""
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        sel = (exp == e).nonzero().flatten()
        if sel.numel() == 0:
            continue
        rows = tok[sel]
        z = x[rows] @ w1[e].t()
        if b1 is not None:
            z = z + b1[e]
        y = act(z, activation) @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        out = out.index_add(0, rows, y * score[sel, None])
    return out


def aux_loss(logits, counts):
    T, E = logits.shape
    q = torch.softmax(logits, -1)
    f = counts.to(logits.dtype)
    if f.sum() == 0:
        return logits.sum() * 0
    return E * ((q.sum(0) / T) * (f / f.sum())).sum()


def topk_routing(logits, k):
    T, E = logits.shape
    vals, ids = torch.topk(logits, k, dim=-1)
    s = torch.softmax(vals, -1)
    tok = torch.arange(T).repeat_interleave(k)
    return tok, ids.flatten(), s.flatten(), torch.bincount(ids.flatten(), minlength=E)


def topk_reference(logits, k):
    """The layer's top-K selection (ties to the lower expert id, which torch.topk does not promise): a stable
    descending sort; ids [T, k] int64, softmax over the k chosen logits, top-k rows per expert (int64 [E])."""
    vals, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    ids = order[:, :k]
    counts = torch.bincount(ids.reshape(-1), minlength=logits.shape[1])
    return ids, torch.softmax(vals[:, :k], dim=-1), counts


def rounding_routing(logits, k, tile, mode):
    T, E = logits.shape
    q = torch.softmax(logits, -1)
    vals, ids = torch.topk(logits, k, dim=-1)
    renorm = torch.softmax(vals, -1)  # = top-K of q renormalised
    qd = q.detach()
    chosen = torch.zeros(T, E, dtype=torch.bool)
    chosen[torch.arange(T)[:, None], ids] = True
    rn = torch.zeros(T, E, dtype=q.dtype)
    rn[torch.arange(T)[:, None], ids] = renorm.detach()
    keep = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        f = int(chosen[:, e].sum())
        down, up = f // tile * tile, -(-f // tile) * tile
        n = {"round_down": down, "round_up": up, "round_nearest": up if 2 * (f % tile) >= tile else down}[mode]
        n = min(n, T)
        # rank: chosen first (by renormalised score), then others (by q); ties to the lower token id
        key = [(0 if chosen[t, e] else 1, -(rn[t, e] if chosen[t, e] else qd[t, e]).item(), t) for t in range(T)]
        order = [t for _, _, t in sorted(key)]
        for t in order[:n]:
            keep[t, e] = True
    toks, exps, scores = [], [], []
    for t in range(T):
        for e in range(E):
            if keep[t, e]:
                toks.append(t)
                exps.append(e)
                if chosen[t, e]:
                    slot = (ids[t] == e).nonzero().item()
                    scores.append(renorm[t, slot])
                else:
                    scores.append(q[t, e])
    tok = torch.tensor(toks, dtype=torch.long)
    exp = torch.tensor(exps, dtype=torch.long)
    score = torch.stack(scores) if scores else q.new_zeros(0)
    counts = torch.bincount(exp, minlength=E)
    return tok, exp, score, counts


def moe_reference(x, router, w1, b1, w2, b2, activation, k, routing="topk", tile=128):
    logits = x @ router.t()
    if routing == "topk":
        tok, exp, score, counts = topk_routing(logits, k)
    else:
        tok, exp, score, counts = rounding_routing(logits, k, tile, routing)
    out = experts(x, tok, exp, score, w1, b1, w2, b2, activation)
    return out, aux_loss(logits, counts)

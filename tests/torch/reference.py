"""An MoE layer in plain PyTorch, written for the tests from Megatron-Core's semantics
(docs/dispatch-semantics.md; nothing of moefold's code): the router (softmax before or after the
top-k, sigmoid with renormalisation, the scaling factor, the expert bias in the selection only),
sub-sequence capacity dropping (by probability or by position, per rank), the experts by indexing
(no permutation), the weighted sum, the shared expert and its gate, the micro-batch aux loss and
the z-loss (partials over the tp-cp group). Autograd gives its gradients.

Every rank of a mapping is computed in one process: `moe_world` takes each rank's tokens and the
full (unsharded) weights, so the same function is the reference of one process and of a world."""
import math

import torch
import torch.nn.functional as Fn


def activate(h, act, gated):
    if gated:
        g, u = h.chunk(2, dim=-1)
        return (Fn.silu(g) if act == "swiglu" else Fn.gelu(g)) * u
    return {"gelu": Fn.gelu, "silu": Fn.silu, "relu": torch.relu,
            "squared_relu": lambda v: torch.relu(v) ** 2}[act](h)


def group_limited(sel, k, num_groups, group_topk):
    """Megatron-Core's group-limited selection: each group scores with its best k / group_topk
    values, the best group_topk groups stay, the rest are masked out before the top-k."""
    N, E = sel.shape
    g = sel.view(N, num_groups, E // num_groups).topk(k // group_topk, dim=-1).values.sum(-1)
    keep = torch.zeros(N, num_groups, dtype=torch.bool).scatter_(
        1, torch.topk(g, group_topk, dim=-1).indices, True)
    keep = keep.unsqueeze(-1).expand(N, num_groups, E // num_groups).reshape(N, E)
    return sel.masked_fill(~keep, float("-inf"))


def route(logits, k, score, pre_softmax, scaling, bias, groups=None):
    """probs [N, E] (0 where not selected) and the selection mask [N, E]. groups: (num_groups,
    group_topk) for group-limited routing (sigmoid scores)."""
    N, E = logits.shape
    if score == "softmax":
        if pre_softmax:
            s = torch.softmax(logits, dim=-1)
            top = torch.topk(s, k, dim=-1).indices
            p = s.gather(1, top)
        else:
            top = torch.topk(logits, k, dim=-1).indices
            p = torch.softmax(logits.gather(1, top), dim=-1)
    else:
        s = torch.sigmoid(logits) if score == "sigmoid" else torch.sqrt(Fn.softplus(logits))
        sel = s + bias if bias is not None else s
        if groups is not None:
            sel = group_limited(sel, k, *groups)
        top = torch.topk(sel, k, dim=-1).indices
        p = s.gather(1, top)
        if k > 1:
            p = p / (p.sum(-1, keepdim=True) + 1e-20)
    if scaling is not None:
        p = p * scaling
    mask = torch.zeros(N, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.zeros(N, E, dtype=logits.dtype).scatter(1, top, p)
    return probs, mask


def keep_mask(probs, mask, k, capacity_factor, policy):
    """Sub-sequence dropping over this rank's N tokens: each expert keeps C = ceil(N k / E cf) of
    its routed tokens, the highest probabilities (ties: the earlier token) or the earliest."""
    N, E = mask.shape
    if capacity_factor is None:
        return mask
    C = math.ceil(N * k / E * capacity_factor)
    keep = torch.zeros_like(mask)
    for e in range(E):
        rows = [t for t in range(N) if mask[t, e]]
        if policy == "probs":
            rows.sort(key=lambda t: (-float(probs[t, e]), t))
        for t in rows[:C]:
            keep[t, e] = True
    return keep


def switch(P, f, T, k, E, c):
    """The Switch/GShard partial: c E / (k T^2) sum_e (sum_t P[t, e]) f[e]."""
    return c * E / (k * T * T) * (P.sum(0) * f).sum()


def moe_world(xs, W, FC1, FC2, *, k, act="swiglu", score="softmax", pre_softmax=False,
              scaling=None, bias=None, groups=None, capacity_factor=None, policy="probs",
              shared=None, aux=0.0, z=0.0, seq_aux=0.0, global_aux=0.0, batch=1,
              tp_cp_groups=None):
    """Per rank r: out_r [N_r, H] for xs[r] [N_r, H], and its loss partials {'aux', 'seq_aux',
    'global_aux' (a global batch's first micro-batch), 'z'}.
    W [E, H]; FC1 [E, (2)F, H] (gate rows, then up rows); FC2 [E, H, F]; shared: (S1 [(2)Fs,
    H], S2 [H, Fs], gate [1, H] or None) or None. tp_cp_groups: the ranks whose counts the aux
    loss sums (None: each rank alone)."""
    gated = act in ("swiglu", "geglu")
    E = W.shape[0]
    world = len(xs)
    stat_groups = tp_cp_groups or [[r] for r in range(world)]
    logits, aux_maps, aux_scores, outs = [], [], [], []
    for x in xs:
        lg = x @ W.t()
        logits.append(lg)
        s = torch.softmax(lg, -1) if score == "softmax" else (
            torch.sigmoid(lg) if score == "sigmoid" else torch.sqrt(Fn.softplus(lg)))
        if score != "softmax":
            s = s / s.sum(-1, keepdim=True)
        aux_scores.append(s)
        m = torch.zeros(lg.shape, dtype=torch.bool).scatter_(1, torch.topk(s, k, -1).indices, True)
        aux_maps.append(m)
        probs, mask = route(lg, k, score, pre_softmax, scaling, bias, groups)
        keep = keep_mask(probs.detach(), mask, k, capacity_factor, policy)
        kept = probs * keep
        out = torch.zeros_like(x)
        for e in range(E):
            rows = keep[:, e].nonzero().flatten()
            if rows.numel() == 0:
                continue
            a = activate(x[rows] @ FC1[e].t(), act, gated)
            out = out.index_add(0, rows, (a * kept[rows, e:e + 1]) @ FC2[e].t())
        if shared is not None:
            S1, S2, G = shared
            y = activate(x @ S1.t(), act, gated) @ S2.t()
            if G is not None:
                y = y * torch.sigmoid(x @ G.reshape(1, -1).t())
            out = out + y
        outs.append(out)
    losses = []
    for r in range(world):
        grp = next(g for g in stat_groups if r in g)
        part = {}
        if aux > 0:
            f = sum(aux_maps[q].sum(0).to(xs[r].dtype) for q in grp)
            T = sum(xs[q].shape[0] for q in grp)
            part["aux"] = switch(aux_scores[r], f, T, k, E, aux)
        if global_aux > 0:  # the first micro-batch: the running counts are this one's (one rank)
            f = sum(aux_maps[q].sum(0).to(xs[r].dtype) for q in range(world))
            T = sum(xs[q].shape[0] for q in range(world))
            part["global_aux"] = switch(aux_scores[r], f, T, k, E, global_aux)
        if seq_aux > 0:  # per sequence b (tokens s*B + b), the mean over the B sequences
            S = xs[r].shape[0] // batch
            total = 0
            for b in range(batch):
                rows = torch.arange(S) * batch + b
                f = sum(aux_maps[q][rows].sum(0).to(xs[r].dtype) for q in grp)
                total = total + switch(aux_scores[r][rows], f, S * len(grp), k, E, seq_aux)
            part["seq_aux"] = total / batch
        if z > 0:
            part["z"] = z / len(grp) * (torch.logsumexp(logits[r], -1) ** 2).mean()
        losses.append(part)
    return outs, losses


def fc1_shard(full, ffn, shards, r, gated):
    fs = ffn // shards
    if gated:
        return torch.cat([full[r * fs:(r + 1) * fs], full[ffn + r * fs:ffn + (r + 1) * fs]])
    return full[r * fs:(r + 1) * fs]


def fc2_shard(full, ffn, shards, r):
    fs = ffn // shards
    return full[:, r * fs:(r + 1) * fs]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))

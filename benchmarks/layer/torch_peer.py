#!/usr/bin/env python3
"""The layer's peer: one MoE layer in PyTorch the way torchtitan writes it (fp32 router logits,
softmax top-k, argsort permutation, SwiGLU experts on torch._grouped_mm, weighted un-permutation
with index_add), bf16, no TF32, forward and forward + backward, each the median of 10
CUDA-event-timed steps after 3 warm-ups, on the shapes and routing of bench-layer
(benchmarks/layer/layer_bench.cu): the same tokens (4 in each chosen expert's column, a small
pattern elsewhere), the same router weight (the identity on the first E columns), so the router
picks the same experts. FLOPs: 6 T k H F forward, 3x that for forward + backward.

With bench-layer's JSON lines (--ours) it prints one JSON line per shape and routing and a table:
moefold's forward + backward rate over the peer's and over the six dense GEMMs, against the goals
(>= 1.15x the peer on Qwen2-57B-A14B and DeepSeek-V3-like, >= 1.0x on Mixtral-8x22B; >= 0.8 of the
dense rate). Exit 77 without CUDA or torch._grouped_mm (the check counts it as not run).

  python3 benchmarks/layer/torch_peer.py --ours bench-layer.log"""
import argparse
import json
import sys

GOAL_PEER = {"mixtral-8x22b": 1.0, "qwen2-57b-a14b": 1.15, "dsv3-like-32local": 1.15}
GOAL_DENSE = 0.8


def pair_counts(T, k, E, skewed):
    """Routed pairs per expert, as bench-layer's pair_counts."""
    total = T * k
    c = [total // E] * E
    if skewed:
        mean = total / E
        low, quarter = max(1, int(0.05 * mean)), max(1, E // 4)
        c[0] = min(T, int(4 * mean))
        for e in range(E - quarter, E):
            c[e] = low
        rest = total - c[0] - low * quarter
        even = E - 1 - quarter
        for e in range(1, even + 1):
            c[e] = rest // even + (1 if e <= rest % even else 0)
    else:
        for e in range(total % E):
            c[e] += 1
    return c


def routing_of(T, k, counts):
    """Token t's experts, as bench-layer's routing_of: slot i of the expert-sorted pairs goes to
    token i mod T."""
    idx = [[] for _ in range(T)]
    slot = 0
    for e, n in enumerate(counts):
        for _ in range(n):
            idx[slot % T].append(e)
            slot += 1
    return idx


def median_seconds(torch, f):
    for _ in range(3):
        f()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return sorted(times)[len(times) // 2]


def layer(torch, F, x, wr, w1, w2, k):
    E = w1.shape[0]
    logits = x.float() @ wr.float().t()
    p, idx = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    p = p / p.sum(-1, keepdim=True)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    tok = order // k
    xs = x.index_select(0, tok)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    ys = torch._grouped_mm((F.silu(g) * u).contiguous(), w2.transpose(-2, -1), offs=offs)
    w = p.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tok, ys * w)


def measure(torch, F, row):
    T, H, Fd, E, k = row["T"], row["H"], row["F"], row["E"], row["k"]
    dev = "cuda"
    counts = pair_counts(T, k, E, row["routing"] == "skewed")
    idx = torch.tensor(routing_of(T, k, counts), device=dev)
    t = torch.arange(T, device=dev).unsqueeze(1)
    h = torch.arange(H, device=dev).unsqueeze(0)
    x = torch.where(h < E, torch.zeros((), device=dev), 0.01 * ((t + h) % 7).float())
    x.scatter_(1, idx, 4.0)
    x = x.to(torch.bfloat16).requires_grad_()
    wr = torch.zeros(E, H, device=dev, dtype=torch.bfloat16)
    wr[torch.arange(E), torch.arange(E)] = 1.0
    wr.requires_grad_()
    w1 = torch.full((E, 2 * Fd, H), 0.01, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.full((E, H, Fd), 0.01, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.full((T, H), 0.01, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        fwd = median_seconds(torch, lambda: layer(torch, F, x, wr, w1, w2, k))

    def fb():
        layer(torch, F, x, wr, w1, w2, k).backward(gy)

    fwdbwd = median_seconds(torch, fb)
    flops = 6.0 * T * k * H * Fd
    return {"bench": "layer-peer", "shape": row["shape"], "routing": row["routing"],
            "impl": "torch._grouped_mm", "torch": torch.__version__,
            "fwd_ms": fwd * 1e3, "fwdbwd_ms": fwdbwd * 1e3,
            "fwd_tflops": flops / fwd / 1e12, "fwdbwd_tflops": 3 * flops / fwdbwd / 1e12}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="bench-layer's output (JSON lines)")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("no torch: skipped")
        return 77
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("no CUDA device or no torch._grouped_mm: skipped")
        return 77
    torch.backends.cuda.matmul.allow_tf32 = False
    ours = []
    for line in open(args.ours):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("bench") == "layer" and r.get("impl") == "moefold" and r["shape"] != "small":
                ours.append(r)
    if not ours:
        print("torch_peer.py: no moefold layer rows in", args.ours, file=sys.stderr)
        return 1
    table = []
    for r in ours:
        peer = measure(torch, F, r)
        vs_peer = r["fwdbwd_tflops"] / peer["fwdbwd_tflops"]
        vs_dense = r["fwdbwd_tflops"] / r["dense_fwdbwd_tflops"]
        peer.update({"moefold_fwdbwd_tflops": r["fwdbwd_tflops"], "moefold_vs_peer": vs_peer,
                     "moefold_vs_dense": vs_dense,
                     "peer_goal": GOAL_PEER.get(r["shape"]), "dense_goal": GOAL_DENSE})
        print(json.dumps(peer), flush=True)
        table.append((r, peer, vs_peer, vs_dense))
        torch.cuda.empty_cache()
    print("\n| shape | routing | moefold fwd+bwd | peer fwd+bwd | dense (6 GEMMs) | vs peer (goal) "
          "| vs dense (goal 0.8) |\n|---|---|---|---|---|---|---|")
    for r, peer, vp, vd in table:
        print(f"| {r['shape']} | {r['routing']} | {r['fwdbwd_tflops']:.0f} | "
              f"{peer['fwdbwd_tflops']:.0f} | {r['dense_fwdbwd_tflops']:.0f} | "
              f"{vp:.2f} ({GOAL_PEER.get(r['shape'], 1.0):.2f}) | {vd:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

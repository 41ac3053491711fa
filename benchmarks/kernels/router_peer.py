#!/usr/bin/env python3
"""The router's peer: the same routing as moefold's router kernels (scores to top-k, renormalised
and scaled; the logits GEMM excluded), written the usual way in PyTorch, timed the same way
(median of 20 CUDA-event-timed calls after 3 warm-ups) on the same sizes. With the JSON lines of
bench-kernels (benchmarks/kernels/kernels_bench.cu) it prints, per variant, both times and
moefold's speed-up (peer time / moefold time). Exit 77 without CUDA.

  python3 benchmarks/kernels/router_peer.py [--ours bench-kernels.jsonl] [--tokens 16384]"""
import argparse
import json
import sys

# name: (experts, topk, score, softmax before top-k, expert bias, groups, group_topk, scale)
VARIANTS = {
    "softmax_topk_e128_k8": (128, 8, "softmax", True, False, 0, 0, None),
    "topk_softmax_e64_k6": (64, 6, "softmax", False, False, 0, 0, None),
    "sigmoid_bias_groups_e256_k8": (256, 8, "sigmoid", False, True, 8, 4, 2.5),
    "softmax_topk_e512_k8": (512, 8, "softmax", True, False, 0, 0, None),
}


def route(torch, logits, bias, v):
    """Megatron-Core's topk routing (softmax pre/post, sigmoid with bias and group limits)."""
    experts, k, score, pre, use_bias, groups, group_topk, scale = v
    if score == "softmax" and pre:
        scores = torch.softmax(logits, dim=-1)
        probs, idx = torch.topk(scores, k, dim=-1)
    elif score == "softmax":
        top, idx = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        sel = scores + bias if use_bias else scores
        if groups:
            n = sel.shape[0]
            g = sel.view(n, groups, -1).topk(k // group_topk, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(g).scatter_(1, torch.topk(g, group_topk, dim=-1)[1], 1)
            mask = keep.unsqueeze(-1).expand(n, groups, experts // groups).reshape(n, -1)
            sel = sel.masked_fill(~mask.bool(), float("-inf"))
        _, idx = torch.topk(sel, k, dim=-1)
        probs = torch.gather(scores, 1, idx)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scale is not None:
        probs = probs * scale
    return idx, probs


def median_seconds(torch, f):
    for _ in range(3):
        f()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="bench-kernels output (JSON lines)")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("router_peer.py: no torch", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("router_peer.py: no CUDA device", file=sys.stderr)
        return 77
    ours = {}
    if args.ours:
        for line in open(args.ours):
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("bench") == "router":
                    ours[r["variant"]] = r
    torch.manual_seed(1)
    for name, v in VARIANTS.items():
        logits = torch.randn(args.tokens, v[0], device="cuda")
        bias = 0.01 * torch.randn(v[0], device="cuda")
        t = median_seconds(torch, lambda: route(torch, logits, bias, v))
        out = {"bench": "router_peer", "variant": name, "tokens": args.tokens,
               "torch": torch.__version__, "peer_seconds": t}
        if name in ours and ours[name]["tokens"] == args.tokens:
            out["moefold_seconds"] = ours[name]["seconds"]
            out["speedup"] = t / ours[name]["seconds"]
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

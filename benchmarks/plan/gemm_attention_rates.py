#!/usr/bin/env python3
"""Measured rates for moefold-plan --calibration (docs/planner.md, "Calibration"), two ways.

Dense bf16 GEMMs at the shapes of the presets' projections and MLPs, and causal attention
(PyTorch SDPA, GQA 48/8 heads, head dim 128) forward + backward by sequence length, each timed
  - queued: `reps` calls back to back between two CUDA events (the GPU's rate: the host enqueues
    ahead of the GPU, as in a training step that is not launch-bound), and
  - alone: one call between two events on an idle GPU, median of `reps` (what a probe that
    synchronises after every call measures: the host's launch time of the call is inside).
Writes FILE (a calibration file with the queued rates, `gpu` naming the measured GPU) and prints
one JSON line per measurement with both rates and their difference as host time per call.

  python3 benchmarks/plan/gemm_attention_rates.py OUT.json [--commit C] [--reps 20]
Exit 77 without torch or a CUDA device."""
import argparse
import datetime
import json
import sys

# Datasheet rates of the GPUs moefold-plan knows (dense bf16 TFLOP/s, HBM TB/s).
GPUS = {"H100": (989, 3.35), "H200": (989, 4.8)}
SHAPES = [(4096, 4096), (6144, 6144), (8192, 8192), (6144, 32768), (16384, 6144), (8192, 57344),
          (28672, 8192), (3584, 5120), (2560, 3584), (7168, 4096), (2048, 7168), (6144, 1536),
          (6144, 768)]  # (K, N)
ROWS = (2048, 4096, 8192, 16384)
SEQS = (2048, 4096, 8192, 16384, 32768)


def timed(torch, f, reps, alone=True):
    """(queued seconds per call, alone seconds per call or None when not asked for)."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        f()
    b.record()
    b.synchronize()
    queued = a.elapsed_time(b) * 1e-3 / reps
    if not alone:
        return queued, None
    each = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a.record()
        f()
        b.record()
        b.synchronize()
        each.append(a.elapsed_time(b) * 1e-3)
    return queued, sorted(each)[len(each) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--commit", default="")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.reps < 1:
        sys.exit("gemm_attention_rates.py: --reps must be at least 1")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("gemm_attention_rates.py: no torch", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("gemm_attention_rates.py: no CUDA device", file=sys.stderr)
        return 77
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    known = [k for k in GPUS if k in name]
    cal = {"source": f"benchmarks/plan/gemm_attention_rates.py on {name}, torch {torch.__version__}"
                     f", queued rates ({args.reps} calls between two CUDA events)",
           "date": datetime.date.today().isoformat(), "commit": args.commit, "gemm": [], "attn": []}
    if known:
        peak, hbm = GPUS[known[0]]
        cal["gpu"] = {"name": name, "peak_bf16_tflops": peak, "memory_tbs": hbm}
    for m in ROWS:
        for k, n in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            q, one = timed(torch, lambda: x @ w, args.reps)
            flops = 2.0 * m * k * n
            tflops = round(flops / q / 1e12, 1)
            cal["gemm"].append({"M": m, "K": k, "N": n, "tflops": tflops})
            print(json.dumps({"gemm": [m, k, n], "queued_tflops": tflops,
                              "alone_tflops": round(flops / one / 1e12, 1),
                              "host_us_per_call": round((one - q) * 1e6, 1)}), flush=True)
            del x, w
    for s in SEQS:
        b, h, hkv, d = max(1, 16384 // s), 48, 8, 128
        q_ = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k_ = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v_ = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        kk = k_.repeat_interleave(h // hkv, 1).requires_grad_()
        vv = v_.repeat_interleave(h // hkv, 1).requires_grad_()
        g = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        fwd_flops = 4.0 * b * h * s * s * d / 2  # causal: half the score matrix

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q_, kk, vv, is_causal=True)

        def fwd_bwd():
            F.scaled_dot_product_attention(q_, kk, vv, is_causal=True).backward(g)

        qf, _ = timed(torch, fwd, max(2, args.reps // 4), alone=False)
        qfb, onefb = timed(torch, fwd_bwd, max(2, args.reps // 4))
        # fwd+bwd counted as 3.5x the forward's FLOPs, as the planner counts it.
        rec = {"S": s, "B": b, "heads": h, "head_dim": d, "causal": True,
               "fwd_tflops": round(fwd_flops / qf / 1e12, 1),
               "fwdbwd_tflops": round(3.5 * fwd_flops / qfb / 1e12, 1)}
        cal["attn"].append(rec)
        print(json.dumps({"attn": s, **rec, "alone_fwdbwd_tflops":
                          round(3.5 * fwd_flops / onefb / 1e12, 1)}), flush=True)
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

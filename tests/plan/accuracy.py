#!/usr/bin/env python3
"""The planner's accuracy table: every published MoE training measurement with a stated mapping
that the planner can describe, predicted with moefold-plan and compared.

  accuracy.py TOOL DATA_DIR              prints the markdown table (pasted into docs/planner.md)
  accuracy.py TOOL DATA_DIR --check DOC  checks that DOC contains exactly the rows printed now

Sources and caveats of each point are in docs/planner.md. No point here was used to calibrate
the model (its efficiencies come from single-GPU measurements and datasheets), so every error is
out of sample."""
import json
import subprocess
import sys

tool, data = sys.argv[1], sys.argv[2]
check = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--check" else None

PEAK = {"h100-sxm": 989.0, "gb200-nvl72-64.json": 2500.0}

# (label, source, model, cluster, gpus, gbs, mapping, published TFLOP/s per GPU or None,
#  published MFU or None)
POINTS = [
    ("Mixtral-8x7B", "[MLM]", "mixtral-8x7b", "h100-sxm", 64, 256,
     dict(tp=1, cp=1, ep=8, etp=1, pp=4, vpp=8, mbs=1), 468.0, None),
    ("DeepSeek-V3 (fp8)", "[MB 25.09]", "deepseek-v3-fp8.json", "h100-sxm", 1024, 8192,
     dict(tp=2, cp=1, ep=64, etp=1, pp=8, vpp=4, mbs=1), 338.0, None),
    ("Qwen3-235B-A22B (fp8)", "[MB 25.11]", "qwen3-235b-a22b-fp8.json", "h100-sxm", 256, 2048,
     dict(tp=2, cp=1, ep=32, etp=1, pp=8, vpp=4, mbs=1), 233.0, None),
    ("Qwen3-235B-A22B (fp8)", "[MB 26.02]", "qwen3-235b-a22b-fp8.json", "h100-sxm", 256, 8192,
     dict(tp=2, cp=1, ep=32, etp=1, pp=8, vpp=4, mbs=1), 242.0, None),
    ("Qwen3-30B-A3B (fp8)", "[MB 25.11]", "qwen3-30b-a3b-fp8.json", "h100-sxm", 16, 512,
     dict(tp=1, cp=1, ep=8, etp=1, pp=2, vpp=24, mbs=2), 121.0, None),
    ("Qwen3-30B-A3B (fp8)", "[MB 26.02]", "qwen3-30b-a3b-fp8.json", "h100-sxm", 16, 1024,
     dict(tp=1, cp=1, ep=8, etp=1, pp=2, vpp=12, mbs=1), 118.0, None),
    ("DeepSeek-V3 no MTP (bf16)", "[MB 25.11]", "deepseek-v3-bf16-no-mtp.json", "gb200-nvl72-64.json", 256,
     4096, dict(tp=1, cp=1, ep=64, etp=1, pp=4, vpp=4, mbs=1), 782.0, None),
    ("DeepSeek-V3 no MTP (fp8)", "[MB 25.11]", "deepseek-v3-fp8-no-mtp.json", "gb200-nvl72-64.json", 256,
     4096, dict(tp=1, cp=1, ep=32, etp=1, pp=8, vpp=4, mbs=1), 1003.0, None),
    ("Qwen3-235B-A22B (bf16)", "[MB 25.11]", "qwen3-235b-a22b", "gb200-nvl72-64.json", 256, 8192,
     dict(tp=1, cp=1, ep=32, etp=1, pp=8, vpp=3, mbs=1), 728.0, None),
]

# The paper's comparison (arXiv 2504.14960, H100, seq 4096, global batch 256): published MFU of
# the best folded and the best unfolded Megatron-Core mapping. Their exact mappings were not
# retrievable here, so the planner's best mapping of each kind is compared.
PAPER = [
    ("Mixtral-8x22B", "mixtral-8x22b", 128, 0.493, 0.463),
    ("Qwen2-57B-A14B", "qwen2-57b-a14b", 64, 0.390, 0.353),
    ("Mixtral-8x22B-G8T8", "mixtral-8x22b-g8t8", 128, 0.288, 0.171),
]


def model_arg(m):
    return f"{data}/{m}" if m.endswith(".json") else m


def run(*args):
    r = subprocess.run([tool, *map(str, args), "--format", "json"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"moefold-plan {' '.join(map(str, args))}: {r.stderr}")
    return json.loads(r.stdout)


def mapping_text(m):
    return (f"TP{m['tp']} CP{m['cp']} EP{m['ep']} ETP{m['etp']} PP{m['pp']} VPP{m['vpp']} "
            f"MBS{m['mbs']}")


def unfolded(e):
    """Megatron-Core before folding: experts use the attention TP, EP inside DP, no CP with EP."""
    m = e["mapping"]
    return m["etp"] == m["tp"] and m["dp"] % m["ep"] == 0 and (m["ep"] == 1 or m["cp"] == 1)


rows = []
errors = []
groups = {}
for label, src, model, cluster, gpus, gbs, mp, tflops, _ in POINTS:
    args = ["--model", model_arg(model), "--cluster", model_arg(cluster), "--gpus", gpus, "--gbs", gbs]
    for k in ("tp", "cp", "ep", "etp", "pp", "vpp", "mbs"):
        args += [f"--{k}", mp[k]]
    e = run(*args)
    pred = e["breakdown"]["tflops_per_gpu"]
    err = (pred - tflops) / tflops
    errors.append(err)
    group = "Megatron-LM README" if src == "[MLM]" else (
        "Megatron-Bridge, H100" if cluster == "h100-sxm" else "Megatron-Bridge, GB200")
    groups.setdefault(group, []).append(err)
    peak = PEAK[cluster]
    fit = "" if e["feasible"] else " (OOM)"
    rows.append(f"| {label} {src} | {gpus} x {cluster.replace('.json', '')} | {mapping_text(mp)}, GBS {gbs} | "
                f"{tflops:.0f} ({100 * tflops / peak:.1f}%) | {pred:.0f} ({100 * pred / peak:.1f}%){fit} "
                f"| {100 * err:+.0f}% | {e['breakdown']['recompute']} |")

paper_rows = []
for label, model, gpus, pub_folded, pub_unfolded in PAPER:
    base = ["--model", model, "--cluster", "h100-sxm", "--gpus", gpus]
    best = run(*base, "--top", 1)["ranked"][0]
    best_unf = None
    for tp in (1, 2, 4, 8):
        r = subprocess.run([tool, *map(str, base), "--tp", str(tp), "--etp", str(tp), "--top", "1000",
                            "--format", "json"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            continue
        for e in json.loads(r.stdout)["ranked"]:
            if e["feasible"] and unfolded(e):
                if best_unf is None or e["step_time_s"] < best_unf["step_time_s"]:
                    best_unf = e
                break
    for kind, pub, e in (("folded", pub_folded, best), ("unfolded", pub_unfolded, best_unf)):
        err = (e["mfu"] - pub) / pub
        errors.append(err)
        groups.setdefault("MoE Parallel Folding paper", []).append(err)
        paper_rows.append(f"| {label} [P] | {gpus} x h100-sxm | best {kind}: "
                          f"{mapping_text(e['mapping'])} | {100 * pub:.1f}% | {100 * e['mfu']:.1f}% | "
                          f"{100 * err:+.0f}% |")
    paper_rows.append(f"| | | folding gain | {100 * (pub_folded / pub_unfolded - 1):+.0f}% | "
                      f"{100 * (best['mfu'] / best_unf['mfu'] - 1):+.0f}% | |")

mean_abs = sum(abs(x) for x in errors) / len(errors)
out = ["| measurement | GPUs | mapping (as published) | published TFLOP/s/GPU (MFU) | "
       "predicted (MFU) | error | recompute chosen |",
       "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
       "| measurement | GPUs | mapping | published MFU | predicted MFU | error |",
       "| --- | --- | --- | --- | --- | --- |", *paper_rows, "",
       f"Mean absolute error over the {len(errors)} points (none used for calibration): "
       f"{100 * mean_abs:.0f}%. By source: " + "; ".join(
           f"{g} {100 * sum(abs(x) for x in v) / len(v):.0f}% ({len(v)} points)"
           for g, v in groups.items()) + "."]
text = "\n".join(out)
if check:
    doc = open(check).read()
    missing = [line for line in out if line and line not in doc]
    for line in missing:
        print("docs/planner.md lacks or differs on:", line)
    print(f"[doctest] test cases: 1 | {0 if missing else 1} passed | {1 if missing else 0} failed | 0 skipped")
    sys.exit(1 if missing else 0)
print(text)

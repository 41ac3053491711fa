#!/usr/bin/env python3
"""How much the planner's answer moves between its built-in curves and measured rates: for each
model preset on H100 clusters, the best mapping and its MFU with the built-in curves and with a
calibration file, where the built-in best ranks under the calibration, and how many of the top
10 both keep.

  calibration_table.py TOOL CALIBRATION              prints the markdown table (docs/planner.md)
  calibration_table.py TOOL CALIBRATION --check DOC  checks that DOC holds exactly these rows"""
import json
import subprocess
import sys

tool, cal = sys.argv[1], sys.argv[2]
check = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--check" else None
ROWS = [("mixtral-8x7b", 64), ("mixtral-8x22b", 128), ("mixtral-8x22b-g8t8", 128),
        ("qwen2-57b-a14b", 64), ("llama3-8x70b", 256), ("qwen3-235b-a22b", 256),
        ("deepseek-v3", 1024)]


def text(m):
    return f"TP{m['tp']} CP{m['cp']} EP{m['ep']} ETP{m['etp']} PP{m['pp']} VPP{m['vpp']} MBS{m['mbs']}"


def ranked(model, gpus, extra):
    r = subprocess.run([tool, "--model", model, "--cluster", "h100-sxm", "--gpus", str(gpus),
                        "--top", "200", "--format", "json", *extra], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"{model}: {r.stderr}")
    return json.loads(r.stdout)["ranked"]


out = ["| model | GPUs | best, built-in curves (MFU) | best, calibrated (MFU) | "
       "built-in best, calibrated: rank (MFU) | top-10 kept |",
       "| --- | --- | --- | --- | --- | --- |"]
for model, gpus in ROWS:
    a = ranked(model, gpus, [])
    b = ranked(model, gpus, ["--calibration", cal])
    keys = [text(r["mapping"]) for r in b]
    best = text(a[0]["mapping"])
    rank = keys.index(best) + 1 if best in keys else None
    there = f"{rank} ({100 * b[rank - 1]['mfu']:.1f}%)" if rank else "below 200"
    kept = len({text(r["mapping"]) for r in a[:10]} & set(keys[:10]))
    out.append(f"| {model} | {gpus} x h100-sxm | {best} ({100 * a[0]['mfu']:.1f}%) | "
               f"{text(b[0]['mapping'])} ({100 * b[0]['mfu']:.1f}%) | {there} | {kept}/10 |")
if check:
    doc = open(check).read()
    missing = [line for line in out if line not in doc]
    for line in missing:
        print("docs/planner.md lacks or differs on:", line)
    print(f"[doctest] test cases: 1 | {0 if missing else 1} passed | {1 if missing else 0} failed | 0 skipped")
    sys.exit(1 if missing else 0)
print("\n".join(out))

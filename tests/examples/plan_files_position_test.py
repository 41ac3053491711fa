#!/usr/bin/env python3
"""moefold-plan's model and cluster files, run as a user runs the tool: every way a file's text is
malformed is one "error:" line with the line and column where it is, a member name given twice
(where the second one begins) and nesting too deep (its first bracket too deep) included, exit 2
and nothing on stdout.
Usage: plan_files_position_test.py MOEFOLD_PLAN"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

tool = sys.argv[1]
cases = []
work = pathlib.Path(tempfile.mkdtemp(prefix="moefold-plan-files-"))

model = '{\n  "name": "m",\n  "layers": 2,\n  "hidden": 8,\n  "heads": 2,\n  "vocab": 10,\n'
cluster = ('{\n  "peak_bf16_flops": 1e15,\n  "memory_gib": 80,\n  "memory_bw": 3e12,\n'
           '  "intra_bw": 4e11,\n  "inter_bw": 5e10,\n')
files = {
    # kind, text, what the error line must say
    "model member given twice": (
        "model", model + '  "ffn": 8,\n    "layers": 3\n}\n',
        'malformed JSON at line 8, column 5: duplicate member name "layers" '
        "(rule: each member at most once per object)"),
    "model member given twice, escaped quote in its name": (
        "model", '{"a\\"b": 1, "a\\"b": 2}',
        'malformed JSON at line 1, column 13: duplicate member name "a\\"b"'),
    "cluster member given twice, inner object": (
        "cluster", cluster + '  "name": {"x": 1,\n\t"x": 2}\n}\n',
        'malformed JSON at line 8, column 2: duplicate member name "x"'),
    "cluster member given twice at the top": (
        "cluster", cluster + '  "memory_gib": 96}',
        'malformed JSON at line 7, column 3: duplicate member name "memory_gib"'),
    "nesting too deep": (
        "model", '{"a":\n' + "[" * 64 + "]" * 64 + "}",
        "malformed JSON at line 2, column 64: nesting deeper than 64 levels"),
    "syntax error (nlohmann/json's own position)": (
        "model", model + '  "ffn": 8,\n}\n',
        "malformed JSON at line 8, column 1: syntax error"),
}


def check(name, ok, detail=""):
    cases.append(ok)
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + ("" if ok else f": {detail}"))


for i, (name, (kind, text, says)) in enumerate(files.items()):
    path = work / f"{kind}-{i}.json"
    path.write_text(text)
    model_arg = str(path) if kind == "model" else "mixtral-8x7b"
    cluster_arg = str(path) if kind == "cluster" else "h100-sxm"
    r = subprocess.run([tool, "--model", model_arg, "--cluster", cluster_arg, "--gpus", "8"],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    want = f"error: {kind} file '{path}': {says}"
    check(f"{name}: exit 2, one error line at the position", r.returncode == 2 and r.stdout == ""
          and len(lines) == 1 and lines[0].startswith(want), (r.returncode, r.stderr, want))

if all(cases):
    shutil.rmtree(work, ignore_errors=True)
failed = cases.count(False)
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

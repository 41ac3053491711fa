#!/usr/bin/env python3
"""Tests of the moefold-plan command-line tool, run as a user runs it.

Arguments: the tool, the folder of test data, and the build's b_sanitize value (the 2-second
search bound is checked only in an uninstrumented build). Prints a doctest-style summary line so
that the CI count sees each case."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

tool, data = sys.argv[1], sys.argv[2]
sanitized = len(sys.argv) > 3 and sys.argv[3] not in ("", "none")
cases = []
MAPPING_KEYS = ["tp", "cp", "ep", "etp", "pp", "vpp", "dp", "edp", "mbs"]
TOP_KEYS = ["mapping", "feasible", "reason", "mfu", "step_time_s", "memory_gib", "breakdown"]


def case(fn):
    cases.append(fn)
    return fn


def run(*args):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=120)


def check_entry(e):
    assert list(e.keys()) == TOP_KEYS, e.keys()
    assert list(e["mapping"].keys()) == MAPPING_KEYS, e["mapping"].keys()
    assert all(isinstance(e["mapping"][k], int) and e["mapping"][k] >= 1 for k in MAPPING_KEYS)
    assert isinstance(e["feasible"], bool) and isinstance(e["reason"], str) and e["reason"]
    assert 0 < e["mfu"] < 1 and e["step_time_s"] > 0 and e["memory_gib"] > 0
    parts = e["breakdown"]["time_s"]
    assert abs(sum(parts.values()) - e["step_time_s"]) <= 1e-3 * e["step_time_s"] + 1e-4, parts
    mem = e["breakdown"]["memory_gib"]
    assert abs(sum(mem.values()) - e["memory_gib"]) < 0.05, mem


@case
def one_mapping_json_has_the_issue_shape():
    r = run("--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 128, "--tp", 2, "--cp", 1,
            "--ep", 8, "--etp", 1, "--pp", 8, "--vpp", 7, "--mbs", 1, "--format", "json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    e = json.loads(r.stdout)
    assert e.pop("stack") == {"dispatcher": "alltoall", "fp8_dispatch": False, "ep_overlap": False,
                              "cuda_graphs": False}
    check_entry(e)
    assert e["mapping"] == {"tp": 2, "cp": 1, "ep": 8, "etp": 1, "pp": 8, "vpp": 7, "dp": 8, "edp": 2,
                            "mbs": 1}
    # The error band brackets the prediction: published = predicted / (1 + error) at the 90th
    # and 10th percentiles of the signed error, read here from validation.hpp.
    header = open(os.path.join(os.path.dirname(__file__), "..", "..", "include", "moefold", "plan",
                               "validation.hpp")).read()
    band = {k: float(re.search(rf"\.{k} = (-?[0-9.]+)", header).group(1)) for k in ("low", "high")}
    lo, hi = e["breakdown"]["mfu_band"]
    assert lo < e["mfu"] < hi, (lo, e["mfu"], hi)
    # (all three printed to 4 decimals)
    assert abs(lo - e["mfu"] / (1 + band["high"])) < 2e-4 and abs(hi - e["mfu"] / (1 + band["low"])) < 2e-4, \
        (lo, hi, e["mfu"], band)
    lo, hi = e["breakdown"]["tflops_band"]
    assert lo < e["breakdown"]["tflops_per_gpu"] < hi
    assert e["feasible"] is True
    assert e["breakdown"]["placement"]["ep"] == {"size": 8, "nodes": 1}
    assert e["breakdown"]["placement"]["dp_cp"]["nodes"] > 1
    # MFU and step time agree with the FLOPs of a step: 6.4 PFLOP-ish model FLOPs per step.
    assert abs(e["breakdown"]["tflops_per_gpu"] - 989 * e["mfu"]) < 1.0


@case
def search_json_is_ranked():
    r = run("--model", "qwen2-57b-a14b", "--cluster", "h100-sxm", "--gpus", 64, "--top", 4, "--format",
            "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert list(out.keys()) == ["stack", "ranked"] and len(out["ranked"]) == 4
    for e in out["ranked"]:
        check_entry(e)
        assert e["feasible"]
    times = [e["step_time_s"] for e in out["ranked"]]
    assert times == sorted(times), times


@case
def the_training_stack_is_stated_and_priced():
    base = ["--model", "deepseek-v3", "--cluster", "h100-sxm", "--gpus", 1024, "--gbs", 8192, "--tp", 2,
            "--cp", 1, "--ep", 64, "--etp", 1, "--pp", 8, "--vpp", 4, "--mbs", 1, "--format", "json"]
    steps = {}
    for flags in ((), ("--dispatcher", "deepep"), ("--dispatcher", "deepep", "--fp8-dispatch"),
                  ("--dispatcher", "deepep", "--fp8-dispatch", "--ep-overlap")):
        r = run(*base, *flags)
        assert r.returncode == 0, r.stderr
        e = json.loads(r.stdout)
        assert e["stack"]["dispatcher"] == (flags[1] if flags else "alltoall")
        assert e["stack"]["fp8_dispatch"] == ("--fp8-dispatch" in flags)
        assert e["stack"]["ep_overlap"] == ("--ep-overlap" in flags)
        steps[flags] = (e["step_time_s"], e["breakdown"]["time_s"]["ep_a2a"])
    times = [t for t, _ in steps.values()]
    a2a = [x for _, x in steps.values()]
    # EP 64 over 8 nodes: each step of the recipe makes the exposed all-to-all smaller.
    assert times == sorted(times, reverse=True) and a2a == sorted(a2a, reverse=True), steps
    r = run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 8, "--dispatcher", "nccl")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--dispatcher" in r.stderr, r.stderr
    r = run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 8, "--top", 1, "--dispatcher",
            "hybridep", "--ep-overlap")
    assert r.returncode == 0 and "EP dispatch: HybridEP, EP overlap" in r.stdout, r.stdout
    assert "error band:" in r.stdout
    # Eager Megatron-Core is host-bound for Qwen3-30B-A3B-sized layers on 16 GPUs (the fp8
    # recipe runs without CUDA graphs); --cuda-graphs lifts the floor.
    qwen = ["--model", f"{data}/qwen3-30b-a3b-fp8.json", "--cluster", "h100-sxm", "--gpus", 16, "--gbs",
            1024, "--tp", 1, "--cp", 1, "--ep", 16, "--etp", 1, "--pp", 1, "--vpp", 1, "--mbs", 1,
            "--dispatcher", "hybridep", "--format", "json"]
    eager, graphs = (json.loads(run(*qwen, *flags).stdout) for flags in ((), ("--cuda-graphs",)))
    assert eager["stack"]["cuda_graphs"] is False and graphs["stack"]["cuda_graphs"] is True
    assert eager["breakdown"]["time_s"]["host"] > 0 and graphs["breakdown"]["time_s"]["host"] == 0
    assert graphs["step_time_s"] < eager["step_time_s"], (graphs["step_time_s"], eager["step_time_s"])
    r = run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 8, "--top", 1, "--cuda-graphs")
    assert r.returncode == 0 and "EP dispatch: NCCL all-to-all, CUDA graphs" in r.stdout, r.stdout


@case
def fixed_sizes_are_held_in_a_search():
    r = run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 64, "--tp", 2, "--pp", 4,
            "--top", 3, "--format", "json")
    assert r.returncode == 0, r.stderr
    for e in json.loads(r.stdout)["ranked"]:
        assert e["mapping"]["tp"] == 2 and e["mapping"]["pp"] == 4


@case
def text_table_gives_a_reason_for_each_entry():
    r = run("--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 128, "--top", 5)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("moefold-plan: mixtral-8x22b"), lines[0]
    assert any("legal folded mappings" in l for l in lines)
    header = next(i for i, l in enumerate(lines) if l.startswith("rank"))
    rows = [l for l in lines[header + 1:] if l[:4].strip().isdigit()]
    whys = [l for l in lines[header + 1:] if l.strip().startswith("why:")]
    assert len(rows) == 5 and len(whys) == 5, r.stdout
    assert "faster than the next" in whys[0], whys[0]


@case
def text_for_one_mapping():
    r = run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 64, "--tp", 1, "--cp", 1,
            "--ep", 8, "--etp", 1, "--pp", 4, "--vpp", 8, "--mbs", 1)
    assert r.returncode == 0, r.stderr
    assert "mapping: tp1 cp1 ep8 etp1 pp4 vpp8 mbs1 (dp16 edp2)" in r.stdout, r.stdout
    assert "step time by cause" in r.stdout and "ep_a2a" in r.stdout


@case
def infeasible_mapping_says_why():
    r = run("--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 8, "--tp", 8, "--cp", 1,
            "--ep", 1, "--etp", 8, "--pp", 1, "--vpp", 1, "--mbs", 1, "--format", "json")
    assert r.returncode == 0, r.stderr
    e = json.loads(r.stdout)
    assert e["feasible"] is False and e["reason"].startswith("out of memory"), e["reason"]


@case
def svg_is_well_formed_with_bars_and_breakdowns():
    r = run("--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 128, "--top", 6, "--format",
            "svg")
    assert r.returncode == 0, r.stderr
    root = ET.fromstring(r.stdout)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [e for e in root.iter(ns + "rect") if e.get("class") == "candidate"]
    parts = [e for e in root.iter(ns + "rect") if e.get("class") == "part"]
    assert len(bars) == 200, len(bars)
    assert len(parts) == 6 * 14, len(parts)  # 14 time components each
    # Fitting candidates come first, best first: their bars never grow.
    heights = [float(b.get("height")) for b in bars if b.get("fill") == "#4e79a7"]
    assert heights and all(a >= b for a, b in zip(heights, heights[1:])), heights[:10]


@case
def json_files_give_the_same_plan_as_the_presets():
    args = ["--gpus", 64, "--tp", 1, "--cp", 1, "--ep", 8, "--etp", 1, "--pp", 4, "--vpp", 8, "--mbs", 1,
            "--format", "json"]
    a = json.loads(run("--model", "mixtral-8x7b", "--cluster", "h100-sxm", *args).stdout)
    b = run("--model", os.path.join(data, "mixtral-8x7b.json"), "--cluster",
            os.path.join(data, "h100-sxm.json"), *args)
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout) == a


@case
def search_over_1024_gpus_is_fast():
    # The tool reports the search's own wall time (process start-up and page-in excluded).
    start = time.monotonic()
    r = run("--model", "deepseek-v3", "--cluster", "h100-sxm", "--gpus", 1024, "--top", 3)
    wall = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if "legal folded mappings" in l)
    searched = float(line.rsplit("(", 1)[1].split()[0])
    legal = int(line.split("searched ")[1].split()[0])
    assert legal > 100000, line
    if not sanitized:
        assert searched < 2.0, line
    print(f"    deepseek-v3 on 1024 GPUs: {legal} mappings, search {searched:.2f} s, process {wall:.2f} s")


@case
def help_goes_to_stdout():
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: moefold-plan") and r.stderr == ""
    assert "mixtral-8x22b-g8t8" in r.stdout and "gb200-nvl72" in r.stdout


@case
def bad_input_exits_2_with_one_error_line():
    tmp = tempfile.mkdtemp()

    def write(name, text):
        p = os.path.join(tmp, name)
        with open(p, "w") as f:
            f.write(text)
        return p

    malformed = write("bad.json", '{"layers": 32, "hidden": 4096,, }')
    unknown_key = write("unknown.json", '{"layers": 2, "hidden": 8, "heads": 2, "vocab": 10, "ffn": 8, "x": 1}')
    bad_cluster = write("cluster.json", '{"peak_bf16_flops": 1e15}')
    base = ["--cluster", "h100-sxm", "--gpus", 64]
    bad = [
        ["--model", "mixtral-9x9b", *base],                     # unknown preset
        ["--model", "mixtral-8x7b", "--cluster", "a100", "--gpus", 8],
        ["--model", malformed, *base],                           # malformed JSON
        ["--model", unknown_key, *base],
        ["--model", "mixtral-8x7b", "--cluster", bad_cluster, "--gpus", 8],
        ["--model", tmp, *base],                                 # a directory
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 0],   # zero GPUs
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", -8],
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", "8x"],
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", "99999999999"],
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", 2147483647],  # too many
        ["--model", "mixtral-8x7b", "--cluster", "h100-sxm"],                # no --gpus
        ["--cluster", "h100-sxm", "--gpus", 8],                              # no --model
        ["--model", "mixtral-8x7b", *base, "--tp", 3],                       # impossible sizes
        ["--model", "mixtral-8x7b", *base, "--tp", 0],
        ["--model", "mixtral-8x7b", *base, "--ep", 16],
        ["--model", "mixtral-8x7b", *base, "--tp", 1, "--cp", 1, "--ep", 8, "--etp", 1, "--pp", 4,
         "--vpp", 9, "--mbs", 1],
        ["--model", "mixtral-8x7b", *base, "--gbs", 0],
        ["--model", "mixtral-8x7b", *base, "--seq", "-1"],
        ["--model", "mixtral-8x7b", *base, "--top", 0],
        ["--model", "mixtral-8x7b", *base, "--format", "html"],
        ["--model", "mixtral-8x7b", *base, "--frobnicate", 1],
        ["--model", "mixtral-8x7b", *base, "--tp", 2, "--tp", 2],
        ["--model", "mixtral-8x7b", *base, "--tp"],
    ]
    for args in bad:
        r = run(*args)
        assert r.returncode == 2, (args, r.returncode, r.stdout[:200], r.stderr)
        assert r.stdout == "", (args, r.stdout[:200])
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)


passed = failed = 0
for fn in cases:
    try:
        fn()
        passed += 1
        print(f"[ok]   {fn.__name__}")
    except Exception as e:  # noqa: BLE001 - report every failing case
        failed += 1
        print(f"[FAIL] {fn.__name__}: {e!r}")
print(f"[doctest] test cases: {len(cases)} | {passed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

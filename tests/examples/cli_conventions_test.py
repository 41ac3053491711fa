#!/usr/bin/env python3
"""The conventions every tool shares (examples/cli_args.hpp, on CLI11): --help lists every flag of
the usage lines with its default (or REQUIRED; plain switches have none) on stdout with exit 0;
--version prints the package version; unknown, repeated and value-less flags and values that are
not numbers exit 2 with one "error:" line and nothing on stdout; inputs that would make a tool run
or allocate without bound are refused at once with the limit stated.
Usage: cli_conventions_test.py VERSION MOEFOLD_MESH MOEFOLD_PLAN TRAIN_MOE_CPU MOEFOLD_UPCYCLE
       DENSE_SAFETENSORS"""
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

version, mesh, plan, train, upcycle, dense = sys.argv[1:7]
# moefold-upcycle writes into a folder that must be new or empty: each run gets a fresh name.
scratch = pathlib.Path(tempfile.mkdtemp(prefix="moefold-cli-"))
tools = {
    "moefold-mesh": (mesh, ["--world", "8"], "--tp"),
    "moefold-plan": (plan, ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", "8"], "--tp"),
    "train_moe_cpu": (train, ["--steps", "1", "--quiet"], "--tp"),
    "moefold-upcycle": (upcycle, ["--dense", dense, "--out", str(scratch / "out"), "--activation",
                                  "relu", "--experts", "2", "--topk", "2", "--world", "1"],
                        "--experts"),
}
cases = []


def check(name, ok, detail=""):
    cases.append(ok)
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + ("" if ok else f": {detail}"))


def run(exe, *args, timeout=60):
    shutil.rmtree(scratch / "out", ignore_errors=True)
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def one_error(r):
    lines = r.stderr.splitlines()
    return r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")


for name, (exe, good, int_flag) in tools.items():
    h = run(exe, "--help")
    check(f"{name} --help: exit 0, usage first, on stdout", h.returncode == 0 and h.stderr == "" and
          h.stdout.startswith(f"usage: {name}"), h.stdout[:200] + h.stderr)
    usage = h.stdout.split("\n\n")[0]
    flags = sorted(set(re.findall(r"--[a-z][a-z-]*", usage)))
    listed = {}
    for line in h.stdout.splitlines():
        m = re.match(r"^  (?:-\w,)?(--[a-z][a-z-]*)( \S+)?", line)
        if m:
            listed[m.group(1)] = (m.group(2) or "").strip()
    missing = [f for f in flags if f not in listed]
    check(f"{name} --help lists every flag of its usage ({len(flags)})", flags and not missing, missing)
    no_default = [f for f, t in listed.items() if t and "=" not in t and
                  not re.search(rf"^  {re.escape(f)} \S+ REQUIRED", h.stdout, re.M)]
    check(f"{name} --help gives each flag that takes a value its default", not no_default, no_default)
    v = run(exe, "--version")
    check(f"{name} --version prints the package version", v.returncode == 0 and
          v.stdout == f"{name} (moefold) {version}\n", v.stdout + v.stderr)
    ok = run(exe, *good)
    check(f"{name} runs with {' '.join(good)}", ok.returncode == 0, ok.stderr)
    bad = {
        "unknown flag": [*good, "--frobnicate", "1"],
        "repeated flag": [*good, int_flag, "1", int_flag, "1"],
        "flag without its value": [*good, int_flag],
        "not a number": [*good, int_flag, "2x"],
        "number too large for int": [*good, int_flag, "99999999999"],
        "--flag=value form checked too": [*good, f"{int_flag}=abc"],
        "positional argument": [*good, "extra"],
    }
    for what, args in bad.items():
        r = run(exe, *args)
        check(f"{name}: {what} exits 2 with one error line", one_error(r), (r.returncode, r.stdout[:100], r.stderr))

# Unbounded inputs are refused at once, with the limit named.
for name, exe, args, limit in [
        ("moefold-mesh --world 2147483647", mesh, ["--world", "2147483647"], "1048576"),
        ("moefold-mesh --world 2147483647 --tp 2147483647 --pp 2", mesh,
         ["--world", "2147483647", "--tp", "2147483647", "--pp", "2"], "1048576"),
        ("moefold-plan --gpus 2147483647", plan,
         ["--model", "mixtral-8x7b", "--cluster", "h100-sxm", "--gpus", "2147483647"], "65536"),
        ("train_moe_cpu --world 100000", train, ["--world", "100000"], "1024"),
        ("train_moe_cpu --experts 100000", train, ["--experts", "100000"], "1048576"),
        ("train_moe_cpu --hidden 2147483647 --ffn 2147483647", train,
         ["--hidden", "2147483647", "--ffn", "2147483647"], "1048576"),
        ("train_moe_cpu --tokens 2147483640", train, ["--tokens", "2147483640"], "1048576"),
        ("train_moe_cpu --shared-ffn 2147483647", train, ["--shared-ffn", "2147483647"], "1048576"),
        ("train_moe_cpu --steps 2147483647", train, ["--steps", "2147483647"], "100000"),
        ("train_moe_cpu --topk 0", train, ["--topk", "0"], "between 1 and --experts"),
        ("moefold-upcycle --world 2147483647", upcycle,
         ["--dense", dense, "--out", str(scratch / "out"), "--experts", "2", "--topk", "2",
          "--world", "2147483647"], "65536"),
        ("moefold-upcycle --experts 2147483647", upcycle,
         ["--dense", dense, "--out", str(scratch / "out"), "--experts", "2147483647", "--topk",
          "2", "--world", "1"], "65536"),
        ("moefold-plan --model /dev/zero", plan,
         ["--model", "/dev/zero", "--cluster", "h100-sxm", "--gpus", "8"], "1048576 bytes")]:
    t = time.monotonic()
    r = run(exe, *args, timeout=30)
    dt = time.monotonic() - t
    check(f"{name} is refused in {dt:.2f} s, stating the limit {limit}",
          one_error(r) and limit in r.stderr and dt < 5, (r.returncode, r.stderr))

# Output that lists every rank takes time linear in the world: the SVG of 65,536 GPUs (each cell
# coloured by its group, found once per rank, not searched for) within seconds.
t = time.monotonic()
r = subprocess.run([mesh, "--world", "65536", "--format", "svg"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, text=True, timeout=120)
dt = time.monotonic() - t
check(f"moefold-mesh --world 65536 --format svg in {dt:.2f} s", r.returncode == 0 and dt < 10,
      (r.returncode, r.stderr))

shutil.rmtree(scratch, ignore_errors=True)
failed = cases.count(False)
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

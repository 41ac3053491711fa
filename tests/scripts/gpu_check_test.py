#!/usr/bin/env python3
"""scripts/gpu-check.sh without a GPU (its dry run), as CI runs it:
1. a GPU test program that skips (exit 77) while a GPU is present (faked) fails the run;
2. a passing one passes, its doctest counts read from its output;
3. (with a CUDA build) every GPU program of the build is collected by gpu-bin.py and starts;
in each case the output folder holds summary.json (valid against
docs/gpu-check-summary.schema.json) and logs.tar.gz, nothing else, well under 1 MiB.

Usage: gpu_check_test.py SOURCE_ROOT [BUILD_DIR_WITH_CUDA]"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jsonschema

root = pathlib.Path(sys.argv[1])
build = sys.argv[2] if len(sys.argv) > 2 else None
schema = json.loads((root / "docs" / "gpu-check-summary.schema.json").read_text())
cases, failures = 0, []


def check(cond, what):
    global cases
    cases += 1
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def run(tmp, bin_dir, fake_gpu, budget=None):
    out = tmp / "out"
    env = dict(os.environ, OUT=str(out), MOEFOLD_GPU_CHECK_FAKE_GPU="1" if fake_gpu else "0")
    if budget is not None:
        env["MOEFOLD_GPU_CHECK_BUDGET"] = str(budget)
    r = subprocess.run(["bash", str(root / "scripts" / "gpu-check.sh"), "--dry-run", "--bin-dir",
                        str(bin_dir)], capture_output=True, text=True, env=env, timeout=600)
    names = sorted(p.name for p in out.iterdir())
    check(names == ["logs.tar.gz", "summary.json"], f"output files {names}")
    size = sum(p.stat().st_size for p in out.iterdir())
    check(size < 1 << 20, f"output {size} bytes")
    summary = json.loads((out / "summary.json").read_text())
    try:
        jsonschema.validate(summary, schema)
        check(True, "schema")
    except jsonschema.ValidationError as e:
        check(False, f"summary.json does not match the schema: {e.message}")
    return r, summary


def fake_bin(tmp, script):
    b = tmp / "bin"
    b.mkdir()
    prog = b / "test-fake"
    prog.write_text("#!/bin/sh\n" + script)
    prog.chmod(0o755)
    (b / "manifest.txt").write_text("simt-gpu\ttest-fake\n")
    return b


with tempfile.TemporaryDirectory() as d:
    tmp = pathlib.Path(d)
    r, s = run(tmp, fake_bin(tmp, 'echo "no CUDA device: skipped"; exit 77\n'), fake_gpu=True)
    check(r.returncode != 0, "a skip with a GPU present must fail the run")
    check(s["result"] == "fail" and any("skipped while a GPU is present" in x for x in s["reasons"]),
          f"the reason names the skip: {s['reasons']}")

with tempfile.TemporaryDirectory() as d:
    tmp = pathlib.Path(d)
    r, s = run(tmp, fake_bin(tmp, 'echo "[doctest] test cases: 3 | 3 passed | 0 failed | 0 skipped"\n'),
               fake_gpu=True)
    check(r.returncode == 0, f"a passing program passes the run ({r.stdout[-500:]})")
    check(s["tests"] == {"passed": 3, "failed": 0, "skipped": 0}, f"counts {s['tests']}")

with tempfile.TemporaryDirectory() as d:
    # A program that outlasts the check's budget is stopped in time to write the summary: the
    # budget of 28 s leaves the step 8 s (20 s are kept for the summary).
    tmp = pathlib.Path(d)
    r, s = run(tmp, fake_bin(tmp, '[ "$1" = --help ] && exit 0\nsleep 60\n'), fake_gpu=True, budget=28)
    check(r.returncode != 0, "a program over the budget fails the run")
    smoke = [x for x in s["steps"] if x["name"] == "smoke"]
    check(len(smoke) == 1 and smoke[0]["status"] == "timeout" and smoke[0]["seconds"] <= 12,
          f"the smoke step is cut to the budget: {smoke}")
    check(any("timed out" in x for x in s["reasons"]) or any("smoke" in x for x in s["reasons"]),
          f"the reason names it: {s['reasons']}")

with tempfile.TemporaryDirectory() as d:
    # A program that cannot start only for want of an MPI library (a machine without MPI; the
    # library is named so that no installed MPI provides it) is
    # recorded as unavailable, not rebuilt and not counted; the run still passes.
    tmp = pathlib.Path(d)
    b = fake_bin(tmp, 'echo "[doctest] test cases: 2 | 2 passed | 0 failed | 0 skipped"\n')
    (tmp / "mpi.c").write_text("int MPI_Init(int* c, char*** v) { return 0; }\n")
    (tmp / "main.c").write_text("int MPI_Init(int*, char***);\n"
                                "int main(int c, char** v) { return MPI_Init(&c, &v); }\n")
    lib = "libmpi_moefold_absent.so.1"
    cc = subprocess.run(f"cc -shared -fPIC -o {lib} mpi.c && cc main.c -o {b}/test-mpi -L. "
                        f"-l:{lib} && rm {lib}", shell=True, cwd=tmp, capture_output=True,
                        text=True)
    check(cc.returncode == 0, f"the program without its MPI library is built: {cc.stderr}")
    with open(b / "manifest.txt", "a") as m:
        m.write("comm-gpu-nccl-mpi\ttest-mpi\n")
    r, s = run(tmp, b, fake_gpu=True)
    st = {x["name"]: x["status"] for x in s["steps"]}
    check(r.returncode == 0 and s["result"] == "pass", f"the run passes: {s['reasons']}")
    check(st.get("test-comm-gpu-nccl-mpi") == "unavailable", f"recorded as unavailable: {st}")
    check(s["tests"] == {"passed": 2, "failed": 0, "skipped": 0}, f"not counted: {s['tests']}")

if build:
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        c = subprocess.run([sys.executable, str(root / "scripts" / "gpu-bin.py"), build,
                            str(tmp / "bin")], capture_output=True, text=True)
        check(c.returncode == 0, f"gpu-bin.py collects every GPU program: {c.stdout}{c.stderr}")
        if c.returncode == 0:
            r, s = run(tmp, tmp / "bin", fake_gpu=False)
            check(r.returncode == 0, f"the built programs start and skip without a GPU: {s['reasons']}")
            check(s["tests"]["skipped"] >= 3, f"every GPU program ran (and skipped): {s['tests']}")

print(f"[doctest] test cases: {cases} | {cases - len(failures)} passed | {len(failures)} failed | "
      f"0 skipped")
sys.exit(1 if failures else 0)

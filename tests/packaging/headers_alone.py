#!/usr/bin/env python3
"""Every public header compiles on its own (-Wall -Wextra -Wpedantic -Werror).

Plain headers (outside cuda/, mpi/ and torch/ folders) need nothing but the C++20 standard
library. Headers in mpi/ folders also get the MPI include flags (--mpi-flags), headers in cuda/
folders the CUDA toolkit's headers (--cuda-include) and the MPI flags, and headers in torch/
folders torch's include flags (--torch-flags); without those options they are counted as
skipped.
The portable kernel headers (kernels/**/*.hpp, which g++ must include too) are compiled as well,
included as <moefold/kernels/...> through the source tree's link include/moefold/kernels (.cuh
files need nvcc and are not compiled here).
--known 'REGEX=why' counts a header whose diagnostics match REGEX as skipped, printing why: a
known defect reported elsewhere, so that it stays visible without hiding any other failure.

Usage: headers_alone.py INCLUDE_DIR [--cuda-include DIR] [--mpi-flags FLAGS] [--torch-flags FLAGS]
                        [--known R=why]...
                        -- COMPILER [ARGS...]"""
import concurrent.futures
import os
import pathlib
import re
import shlex
import subprocess
import sys

argv = sys.argv[1:]
include = pathlib.Path(argv.pop(0))
cuda_include, mpi_flags, torch_flags, known = None, None, None, []
while argv and argv[0] != "--":
    opt, value = argv.pop(0), argv.pop(0)
    if opt == "--cuda-include":
        cuda_include = value
    elif opt == "--mpi-flags":
        # System headers: their own warnings are not ours to fix.
        mpi_flags = [("-isystem" + f[2:]) if f.startswith("-I") else f for f in shlex.split(value)]
    elif opt == "--torch-flags":
        torch_flags = [("-isystem" + f[2:]) if f.startswith("-I") else f for f in shlex.split(value)]
    elif opt == "--known":
        rx, _, why = value.partition("=")
        known.append((re.compile(rx), why))
    else:
        sys.exit(f"headers_alone.py: unknown option {opt}")
compiler = argv[1:]
if not compiler:
    sys.exit("headers_alone.py: no compiler given after --")


def flags_for(rel):
    parts = set(rel.parts)
    extra = []
    if "cuda" in parts:
        if cuda_include is None or mpi_flags is None:
            return None
        extra += ["-isystem", cuda_include] + mpi_flags
    elif "mpi" in parts:
        if mpi_flags is None:
            return None
        extra += mpi_flags
    elif "torch" in parts:
        if torch_flags is None:
            return None
        extra += torch_flags
    return extra


def compile_alone(entry):
    rel, extra = entry[0], flags_for(entry[0])
    if extra is None:
        return rel, "skip", "needs --cuda-include/--mpi-flags/--torch-flags"
    r = subprocess.run(compiler + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic",
                                   "-Werror", "-I", str(include)] + extra + ["-x", "c++", "-"],
                       input=f"#include <{rel.as_posix()}>\n", capture_output=True, text=True)
    if r.returncode == 0:
        return rel, "ok", ""
    for rx, why in known:
        if rx.search(r.stderr):
            return rel, "known", why
    return rel, "FAIL", r.stderr[-2000:]


headers = [(h.relative_to(include),) for h in sorted(include.rglob("*.hpp"))]
# rglob does not follow the link include/moefold/kernels: the kernel headers are listed from its
# target and included through it.
src = (include / "moefold" / "kernels").resolve()
headers += [(pathlib.Path("moefold/kernels") / h.relative_to(src),)
            for h in sorted(src.rglob("*.hpp"))]
counts = {"ok": 0, "FAIL": 0, "skip": 0, "known": 0}
with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
    for rel, status, detail in pool.map(compile_alone, headers):
        counts[status] += 1
        print(f"[{status}] {rel}" + (f": {detail}" if status in ("skip", "known") else ""))
        if status == "FAIL":
            print(detail)
skipped = counts["skip"] + counts["known"]
print(f"[doctest] test cases: {len(headers)} | {counts['ok']} passed | {counts['FAIL']} failed | "
      f"{skipped} skipped")
sys.exit(1 if counts["FAIL"] or not counts["ok"] else 0)

#!/usr/bin/env python3
"""Every plain header compiles on its own with the C++ compiler alone: the rule that .hpp outside
cuda/ folders (CUDA runtime, cuBLAS, NCCL) and mpi/ folders (MPI) needs nothing but the C++20
standard library."""
import pathlib
import subprocess
import sys

include = pathlib.Path(sys.argv[1])
compiler = sys.argv[2:]
headers = sorted(p for p in include.rglob("*.hpp") if not {"cuda", "mpi"} & set(p.relative_to(include).parts))
failed = 0
for h in headers:
    rel = h.relative_to(include)
    r = subprocess.run(compiler + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic",
                                   "-Werror", "-I", str(include), "-x", "c++", "-"],
                       input=f"#include <{rel.as_posix()}>\n", capture_output=True, text=True)
    status = "ok" if r.returncode == 0 else "FAIL"
    print(f"[{status}] {rel}")
    if r.returncode:
        print(r.stderr[-2000:])
        failed += 1
print(f"[doctest] test cases: {len(headers)} | {len(headers) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed or not headers else 0)

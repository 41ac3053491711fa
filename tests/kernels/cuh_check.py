#!/usr/bin/env python3
"""Static checks of the nvcc-only headers, without a GPU:
- every .cuh (include/ and kernels/) compiles alone in a .cu file (but CUTLASS's, which the
  CUTLASS units compile);
- two .cu files that both include every .cuh and every portable kernel header (kernels/**/*.hpp)
  compile and link into one program: a non-template __global__ or a non-inline function defined
  in a header would be a duplicate symbol.

Usage: cuh_check.py --nvcc NVCC --include-root INCLUDE --kernels KERNELS_DIR
                    --workdir DIR [-- EXTRA_NVCC_ARGS...]"""
import argparse
import pathlib
import subprocess
import sys

argv = sys.argv[1:]
extra = []
if "--" in argv:
    i = argv.index("--")
    argv, extra = argv[:i], argv[i + 1:]
ap = argparse.ArgumentParser()
ap.add_argument("--nvcc", required=True)
ap.add_argument("--include-root", required=True)
ap.add_argument("--kernels", required=True)
ap.add_argument("--workdir", required=True)
a = ap.parse_args(argv)
work = pathlib.Path(a.workdir)
work.mkdir(parents=True, exist_ok=True)
inc, kern = pathlib.Path(a.include_root), pathlib.Path(a.kernels)
flags = ["-std=c++20", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         "-I", str(inc), "-Xcompiler", "-Wall,-Wextra"] + extra

# The CUTLASS kernels' header needs CUTLASS and -DNDEBUG: the three units of moefold_cutlass_sm90
# compile it (where CUTLASS is found) and link together into that library and the programs that
# use it, which is this check for it.
cuh = [h.relative_to(inc).as_posix() for h in sorted(inc.rglob("*.cuh"))
       if h.name != "cutlass_sm90_kernel.cuh"]
cuh += ["moefold/kernels/" + h.relative_to(kern).as_posix() for h in sorted(kern.rglob("*.cuh"))]
hpp = ["moefold/kernels/" + h.relative_to(kern).as_posix() for h in sorted(kern.rglob("*.hpp"))]

failures, cases = [], 0
for h in cuh:
    cases += 1
    src = work / ("alone_" + h.replace("/", "_") + ".cu")
    src.write_text(f"#include <{h}>\n")
    r = subprocess.run([a.nvcc] + flags + ["-c", str(src), "-o", str(src.with_suffix(".o"))],
                       capture_output=True, text=True)
    print(f"[{'ok' if r.returncode == 0 else 'FAIL'}] {h} alone")
    if r.returncode != 0:
        failures.append(h)
        print(r.stderr[-3000:])

cases += 1
includes = "".join(f"#include <{h}>\n" for h in cuh + hpp)
objs = []
for name, body in (("tu_a", "int main() { return 0; }\n"), ("tu_b", "")):
    src = work / (name + ".cu")
    src.write_text(includes + body)
    obj = work / (name + ".o")
    r = subprocess.run([a.nvcc] + flags + ["-c", str(src), "-o", str(obj)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        failures.append(f"{name}.cu")
        print(r.stderr[-3000:])
    objs.append(str(obj))
if len(failures) == 0:
    r = subprocess.run([a.nvcc, "-gencode", "arch=compute_90a,code=sm_90a"] + objs +
                       ["-o", str(work / "two_tus"), "-lnccl", "-lcublas"], capture_output=True, text=True)
    print(f"[{'ok' if r.returncode == 0 else 'FAIL'}] two .cu files with every kernel header link")
    if r.returncode != 0:
        failures.append("link")
        print(r.stderr[-3000:])
print(f"[doctest] test cases: {cases} | {cases - len(failures)} passed | {len(failures)} failed | "
      f"0 skipped")
sys.exit(1 if failures else 0)

#!/usr/bin/env python3
"""Collects the GPU test programs of a meson build (the tests of suite `gpu`) and the GPU
benchmarks into one folder with a manifest, for scripts/gpu-check.sh: built on a machine without
a GPU, carried to one (the device tool's `carry`), run there.

Every program must link the CUDA runtime statically (checked with readelf).

Usage: gpu-bin.py BUILD_DIR OUT_DIR        (writes OUT_DIR/manifest.txt: "name<TAB>program")
       gpu-bin.py BUILD_DIR --targets      (prints the ninja targets of those programs)"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

build = pathlib.Path(sys.argv[1]).resolve()
tests = json.loads(subprocess.run(["meson", "introspect", str(build), "--tests"], check=True,
                                  capture_output=True, text=True).stdout)
progs = []
for t in tests:
    if any(s.endswith(":gpu") for s in t["suite"]):
        progs.append((t["name"], pathlib.Path(t["cmd"][0])))
n_tests = len(progs)
progs.append(("bench-comm-a2av-loopback", build / "benchmarks" / "comm" / "bench-comm-a2av-loopback"))
progs.append(("bench-kernels", build / "benchmarks" / "kernels" / "bench-kernels"))
progs.append(("bench-layer", build / "benchmarks" / "layer" / "bench-layer"))
progs.append(("bench-gemm", build / "benchmarks" / "layer" / "bench-gemm"))
if n_tests == 0:
    sys.exit(f"gpu-bin.py: {build} has no tests of suite gpu (configured without CUDA?)")

if sys.argv[2] == "--targets":
    print(" ".join(os.path.relpath(p, build) for _, p in progs))
    sys.exit(0)
out = pathlib.Path(sys.argv[2])
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)


def shared_cudart(program):
    """The shared CUDA runtime the program needs (a NEEDED entry libcudart.so*), or None. The
    programs run on a GPU machine whose libcudart may be another version, so the build links
    cudart_static (meson.build); this keeps it so."""
    d = subprocess.run(["readelf", "-d", str(program)], capture_output=True, text=True)
    if d.returncode != 0:
        sys.exit(f"gpu-bin.py: readelf -d {program} failed: {d.stderr.strip()}")
    for line in d.stdout.splitlines():
        if "(NEEDED)" in line and "libcudart.so" in line:
            return line.split("[")[-1].rstrip("]")
    return None


lines = []
for name, p in progs:
    if not p.is_file():
        sys.exit(f"gpu-bin.py: {name}: {p} is not built")
    if (lib := shared_cudart(p)) is not None:
        sys.exit(f"gpu-bin.py: {name} needs {lib}: GPU programs must link the CUDA runtime "
                 "statically (cudart_static), to start on a machine with another libcudart")
    shutil.copy2(p, out / p.name)
    # The host debug information is most of a program's size, and the device tool carries at most
    # 64 MiB; symbols stay (for backtraces), the device code is untouched.
    subprocess.run(["strip", "--strip-debug", str(out / p.name)], check=True)
    lines.append(f"{name}\t{p.name}")
(out / "manifest.txt").write_text("\n".join(lines) + "\n")
print(f"gpu-bin.py: {len(lines)} programs in {out}")

#!/usr/bin/env python3
"""Compiles one CUTLASS unit (include/moefold/exec/cuda/cutlass_sm90_units/) with nvcc and writes
its output, with ptxas's resource report (-Xptxas -v), its wall time and the peak memory of its
largest process, to a log: tests/exec/cutlass_sm90_check.py checks the log (no spills, no
serialized wgmma) and docs/gemm.md records the time and memory. The output is echoed when nvcc
fails or warns.

Usage: nvcc_unit.py LOG -- NVCC ARGS..."""
import resource
import subprocess
import sys
import time

log, sep, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
if sep != "--" or not cmd:
    sys.exit("usage: nvcc_unit.py LOG -- NVCC ARGS...")
start = time.monotonic()
p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
wall = time.monotonic() - start
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # ru_maxrss is KiB
with open(log, "w") as f:
    f.write(p.stdout)
    f.write(f"nvcc_unit: wall {wall:.0f} s, peak memory {peak_mib:.0f} MiB, exit {p.returncode}\n")
if p.returncode != 0 or "warning" in p.stdout.lower():
    sys.stdout.write(p.stdout)
sys.exit(p.returncode)

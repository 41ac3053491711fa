#!/usr/bin/env python3
"""Static checks of cutlass_sm90's kernels (exec/cuda/cutlass_sm90_units/*.cu), without a GPU:
for each unit, from the log scripts/nvcc_unit.py wrote (ptxas -v) and its object's SASS (cuobjdump,
from the PyPI wheel scripts/setup.sh installs):
- ptxas reports no spill and no stack frame for any function, and no warning that it serialized
  the wgmma pipeline (C7510, what a unit built without -DNDEBUG gets);
- each CUTLASS kernel (found by symbol: cutlass::device_kernel<GemmUniversal<...>>) issues Hopper's
  tensor-core instructions on bf16 into fp32 (HGMMA.*.F32.BF16) and loads through TMA (UTMALDG).
Prints each kernel's registers, nvcc's wall time and peak memory (docs/gemm.md records them).

Usage: cutlass_sm90_check.py UNIT.o UNIT.log [UNIT.o UNIT.log]..."""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             os.path.expanduser(f"~/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages")}
    for root in roots:
        for c in glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump")):
            return c
    return None


args = sys.argv[1:]
if not args or len(args) % 2:
    sys.exit("usage: cutlass_sm90_check.py UNIT.o UNIT.log [UNIT.o UNIT.log]...")
cuobjdump = find_cuobjdump()
if not cuobjdump:
    print("cutlass_sm90_check: cuobjdump not found (scripts/setup.sh installs it)")
    print("[doctest] test cases: 1 | 0 passed | 1 failed | 0 skipped")
    sys.exit(1)
env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))

failures = []
checked = 0
for obj, log in zip(args[0::2], args[1::2]):
    unit = os.path.basename(obj)
    text = open(log).read()
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not spills:
        failures.append(f"{unit}: no ptxas resource report in its log")
    for frame, stores, loads in spills:
        if int(frame) or int(stores) or int(loads):
            failures.append(f"{unit}: {frame} bytes stack frame, {stores}/{loads} bytes spilled")
    if "C7510" in text or re.search(r"serializ", text, re.I):
        failures.append(f"{unit}: ptxas serialized the wgmma pipeline (C7510)")
    regs = re.findall(r"Used (\d+) registers", text)
    cost = re.search(r"nvcc_unit: wall (\d+) s, peak memory (\d+) MiB", text)
    sass = subprocess.run([cuobjdump, "-sass", obj], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True).stdout
    # One block per function: its symbol, then its instructions.
    blocks = re.split(r"\n\s*Function : ", sass)[1:]
    kernels = [b for b in blocks if "GemmUniversal" in b.split("\n", 1)[0]]
    if not kernels:
        failures.append(f"{unit}: no CUTLASS GemmUniversal kernel in its SASS")
    for b in kernels:
        checked += 1
        hgmma = set(re.findall(r"HGMMA\.\S*F32\.BF16", b))
        tma = len(re.findall(r"UTMALDG", b))
        if not hgmma:
            failures.append(f"{unit}: the kernel issues no HGMMA.*.F32.BF16")
        if not tma:
            failures.append(f"{unit}: the kernel has no TMA load (UTMALDG)")
        print(f"{unit}: {', '.join(sorted(hgmma))}, {tma} UTMALDG, "
              f"{regs[0] if regs else '?'} registers, nvcc "
              f"{cost.group(1) + ' s, ' + cost.group(2) + ' MiB' if cost else '?'}")
for f in failures:
    print("FAIL:", f)
ok = not failures and checked == len(args) // 2
print(f"[doctest] test cases: 1 | {1 if ok else 0} passed | {0 if ok else 1} failed | 0 skipped")
sys.exit(0 if ok else 1)

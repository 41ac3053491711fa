#!/usr/bin/env python3
"""Static checks of the kernels' GPU code, without a GPU: compiles sass_probe.cu to sm_90a with
nvcc, reads ptxas's resource report and the SASS (cuobjdump, from the PyPI wheels
nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm that scripts/setup.sh installs), and checks
- every row kernel (permute, un-permute, chunk copy; fp32 and bf16) loads and stores global memory
  with 128-bit instructions (LDG.E.128 / STG.E.128), found by kernel symbol;
- no kernel spills to local memory or has a stack frame;
then prints each kernel's registers, block size and occupancy on an H100 (CUDA's calculator,
cuda_occupancy.h, through occupancy.cpp) as the table docs/kernels.md records.

Usage: sass_check.py --nvcc NVCC --cxx CXX --cuda-include DIR --include DIR [--include DIR]...
                     --probe sass_probe.cu --occupancy occupancy.cpp --workdir DIR"""
import argparse
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

ap = argparse.ArgumentParser()
ap.add_argument("--nvcc", required=True)
ap.add_argument("--cxx", required=True)
ap.add_argument("--cuda-include", required=True)
ap.add_argument("--include", action="append", default=[])
ap.add_argument("--probe", required=True)
ap.add_argument("--occupancy", required=True)
ap.add_argument("--workdir", required=True)
a = ap.parse_args()
work = pathlib.Path(a.workdir)
work.mkdir(parents=True, exist_ok=True)


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    roots.add(os.path.expanduser(f"~/.local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"))
    for root in roots:
        for c in glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump")):
            return c
    return None


cuobjdump = find_cuobjdump()
if not cuobjdump:
    print("sass_check: cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; "
          "scripts/setup.sh does)")
    print("[doctest] test cases: 1 | 0 passed | 1 failed | 0 skipped")
    sys.exit(1)
env = dict(os.environ, PATH=os.path.dirname(cuobjdump) + os.pathsep + os.environ.get("PATH", ""))

cubin = work / "sass_probe.cubin"
cmd = [a.nvcc, "-std=c++20", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
       "-cubin", "-Xptxas", "-v", "-o", str(cubin), a.probe]
for inc in a.include:
    cmd += ["-I", inc]
r = subprocess.run(cmd, capture_output=True, text=True)
if r.returncode != 0:
    print(r.stdout + r.stderr)
    print("[doctest] test cases: 1 | 0 passed | 1 failed | 0 skipped")
    sys.exit(1)

# ptxas -v: "Compiling entry function 'SYM'", then "N bytes stack frame, N bytes spill stores, N
# bytes spill loads" and "Used N registers, ...".
res, cur = {}, None
for line in r.stderr.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        cur = m.group(1)
        res[cur] = {}
        continue
    if cur is None:
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
        res[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", line)
    if m:
        res[cur]["regs"] = int(m.group(1))
    m = re.search(r"(\d+) bytes smem", line)
    if m:
        res[cur]["smem"] = int(m.group(1))

sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
elf = subprocess.run([cuobjdump, "-elf", str(cubin)], capture_output=True, text=True, env=env)
if sass.returncode != 0 or elf.returncode != 0:
    print(sass.stderr + elf.stderr)
    print("[doctest] test cases: 1 | 0 passed | 1 failed | 0 skipped")
    sys.exit(1)
ops = {}
cur = None
for line in sass.stdout.splitlines():
    m = re.search(r"Function : (\w+)", line)
    if m:
        cur = m.group(1)
        ops[cur] = set()
    elif cur and (m := re.search(r"\b(LDG|STG)\.E(\.\w+)*", line)):
        ops[cur].add(m.group(0))
threads, cur, want = {}, None, False
for line in elf.stdout.splitlines():
    m = re.match(r"\.nv\.info\.(\w+)", line.strip())
    if m:
        cur = m.group(1)
    elif "EIATTR_MAX_THREADS" in line:
        want = True
    elif want and "Value:" in line:
        threads[cur] = int(line.split()[1], 16)
        want = False


def demangle(sym):
    d = subprocess.run(["c++filt", sym], capture_output=True, text=True).stdout.strip()
    d = re.sub(r"^void moefold::v0_1::detail::simt_entry<(.*)>\(.*\)$", r"\1", d).strip()
    return d.replace("moefold::kernels::", "").replace("moefold::v0_1::", "")


cases, failures = 0, []
row_kernel = re.compile(r"(gather_rows_kernel|gather_sum_rows_kernel|copy_chunks_kernel)")
occ_in = []
for sym, info in sorted(res.items()):
    name = demangle(sym)
    cases += 1
    if info.get("spill_st", 1) or info.get("spill_ld", 1) or info.get("stack", 1):
        failures.append(f"{name}: stack frame {info.get('stack')} B, spills {info.get('spill_st')} / "
                        f"{info.get('spill_ld')} B")
    if row_kernel.search(sym):
        cases += 1
        have = ops.get(sym, set())
        if not any(o.startswith("LDG.E.128") for o in have) or \
           not any(o.startswith("STG.E.128") for o in have):
            failures.append(f"{name}: no 128-bit global load and store (found {sorted(have)})")
    if sym not in threads:
        failures.append(f"{name}: no __launch_bounds__ (EIATTR_MAX_THREADS) in the cubin")
        continue
    occ_in.append(f"{sym} {threads[sym]} {info.get('regs', 0)} {info.get('smem', 0)}")

occ_bin = work / "occupancy"
c = subprocess.run([a.cxx, "-std=c++17", "-O1", "-isystem", a.cuda_include, a.occupancy, "-o",
                    str(occ_bin)], capture_output=True, text=True)
occ = {}
if c.returncode != 0:
    failures.append("occupancy.cpp did not compile:\n" + c.stderr[-1500:])
else:
    o = subprocess.run([str(occ_bin)], input="\n".join(occ_in) + "\n", capture_output=True, text=True)
    if o.returncode != 0:
        failures.append("occupancy: " + o.stderr)
    for line in o.stdout.splitlines():
        sym, blocks, pct = line.split()
        occ[sym] = (int(blocks), float(pct))

print("| kernel | threads | registers | spills | 128-bit LDG/STG | blocks/SM | occupancy (H100) |")
print("|---|---|---|---|---|---|---|")
for sym, info in sorted(res.items(), key=lambda kv: demangle(kv[0])):
    have = ops.get(sym, set())
    vec = ("yes" if any(x.startswith("LDG.E.128") for x in have) and
           any(x.startswith("STG.E.128") for x in have) else "no")
    b, p = occ.get(sym, (0, 0.0))
    print(f"| `{demangle(sym)}` | {threads.get(sym, '?')} | {info.get('regs')} | "
          f"{info.get('spill_st', 0) + info.get('spill_ld', 0)} B | {vec} | {b} | {p:.0f}% |")
for f in failures:
    print("FAIL:", f)
print(f"[doctest] test cases: {cases} | {cases - len(failures)} passed | {len(failures)} failed | "
      f"0 skipped")
sys.exit(1 if failures else 0)

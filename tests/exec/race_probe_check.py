#!/usr/bin/env python3
"""Runs the ThreadSanitizer build of cpu_launch_race_probe.cpp three times: without its barrier,
and with only a warp barrier (which does not order the other warp's write), TSan must report a
data race whose stack names the probe's line marked RACE (the shared-memory read); with the
block's barrier, it must report nothing and the result must be right.

Usage: race_probe_check.py PROBE_BINARY PROBE_SOURCE"""
import os
import re
import subprocess
import sys

probe, source = sys.argv[1], sys.argv[2]
race_line = next(i for i, line in enumerate(open(source), 1) if "// RACE:" in line)
name = os.path.basename(source)
env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66")

failures = []
for args, what in (([], "without its barrier"), (["--warp-sync-only"], "with a warp barrier only")):
    bad = subprocess.run([probe] + args, capture_output=True, text=True, env=env, timeout=120)
    out = bad.stdout + bad.stderr
    if "WARNING: ThreadSanitizer: data race" not in out:
        failures.append(f"no data race reported for the kernel {what}")
    elif not re.search(rf"{re.escape(name)}:{race_line}\b", out):
        failures.append(f"{what}: the race report does not name {name}:{race_line} (the read)")
    if bad.returncode != 66:
        failures.append(f"{what}: expected TSan's exit code 66, got {bad.returncode}")

good = subprocess.run([probe, "--with-barrier"], capture_output=True, text=True, env=env,
                      timeout=120)
if good.returncode != 0 or "ThreadSanitizer" in good.stdout + good.stderr:
    failures.append(f"with the barrier: exit {good.returncode}, output:\n{good.stderr[-2000:]}")
if "0 of 256 elements wrong" not in good.stdout:
    failures.append(f"with the barrier the result is wrong: {good.stdout.strip()}")

print(f"race reports name {name}:{race_line}" if not failures else "\n".join(failures))
print(f"[doctest] test cases: 1 | {0 if failures else 1} passed | {1 if failures else 0} failed")
sys.exit(1 if failures else 0)

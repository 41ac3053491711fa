#!/usr/bin/env python3
"""Compile-fail test: the file must compile with -DMOEFOLD_CF_CONTROL (so the failure below is
not an unrelated typo) and must fail without it, with the message its first line names
("// expect: <text>")."""
import subprocess
import sys

src, include = sys.argv[1], sys.argv[2]
compiler = sys.argv[3:]
expect = open(src).readline().split("expect:", 1)[1].strip()
base = compiler + ["-std=c++20", "-fsyntax-only", "-I", include, src]
ok = subprocess.run(base + ["-DMOEFOLD_CF_CONTROL"], capture_output=True, text=True)
if ok.returncode != 0:
    print(f"FAIL: control build of {src} does not compile:\n{ok.stderr}")
    sys.exit(1)
bad = subprocess.run(base, capture_output=True, text=True)
if bad.returncode == 0:
    print(f"FAIL: {src} compiled, but it must not")
    sys.exit(1)
if expect not in bad.stderr:
    print(f"FAIL: {src} failed without the expected message '{expect}':\n{bad.stderr[-3000:]}")
    sys.exit(1)
print(f"ok: {src} is rejected with '{expect}'")

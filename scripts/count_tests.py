#!/usr/bin/env python3
"""Counts test cases from meson testlog.json files and extra results, and prints the line
"N passed, N failed, N skipped".

A program that prints a doctest summary contributes its case counts; if meson says the program
failed while its summary shows no failure (a crash after the summary, a sanitizer report at exit),
one failure is added. A program without a summary (it crashed first, or is not a doctest program)
counts as one case. Meson's SKIP (exit 77) counts as skipped.
Usage: count_tests.py testlog.json [more.json ...] [--extra name=ok|fail ...]"""
import json
import re
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SUMMARY = re.compile(r"^\[doctest\] test cases:\s*(\d+) \|\s*(\d+) passed \|\s*(\d+) failed \|\s*(\d+) skipped", re.M)
GOOD = ("OK", "EXPECTEDFAIL")
passed = failed = skipped = 0
failures = []
args = sys.argv[1:]
extras = []
if "--extra" in args:
    i = args.index("--extra")
    args, extras = args[:i], args[i + 1:]
for path in args:
    for line in open(path):
        t = json.loads(line)
        res, name = t["result"], t["name"]
        m = SUMMARY.findall(ANSI.sub("", t.get("stdout") or ""))
        if res == "SKIP":
            skipped += 1
        elif m:
            _, p, f, s = map(int, m[-1])
            passed, failed, skipped = passed + p, failed + f, skipped + s
            if res not in GOOD and f == 0:
                failed += 1
            if res not in GOOD:
                failures.append(name)
        elif res in GOOD:
            passed += 1
        else:
            failed += 1
            failures.append(name)
for e in extras:
    name, _, verdict = e.rpartition("=")
    if verdict == "ok":
        passed += 1
    else:
        failed += 1
        failures.append(name)
if failures:
    print("failed: " + ", ".join(failures))
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)

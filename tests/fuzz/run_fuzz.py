#!/usr/bin/env python3
"""Runs one libFuzzer target and replays its corpus through the tool.

1. The fuzzer runs from a copy of the corpus in the tree (valid/ and invalid/ inputs) with a
   fixed seed, until 100,000 runs or 60 s, whichever comes first; any crash, hang, leak,
   sanitizer report or failed check of the target fails this case.
2. Every input in the tree is replayed through the tool binary: valid/ ones must exit 0,
   invalid/ ones exit 2 with one "error:" line on stderr and nothing on stdout.
3. Up to 300 of the inputs the fuzzer generated are replayed the same way: each must exit 0, or
   exit 2 with one "error:" line and nothing on stdout; none may run past 20 s.
Findings are kept as invalid/regression-*.json. Each check is one case of the summary line.
Usage: run_fuzz.py FUZZER CORPUS_DIR model|cluster TOOL [RUNS SECONDS]"""
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

fuzzer = str(pathlib.Path(sys.argv[1]).resolve())
corpus, kind, tool = pathlib.Path(sys.argv[2]), sys.argv[3], str(pathlib.Path(sys.argv[4]).resolve())
runs = int(sys.argv[5]) if len(sys.argv) > 5 else 100000
seconds = int(sys.argv[6]) if len(sys.argv) > 6 else 60
results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + ("" if ok else f": {detail}"))


def tool_args(path):
    sizes = ["--tp", "1", "--cp", "1", "--ep", "1", "--etp", "1", "--pp", "1", "--vpp", "1",
             "--mbs", "1", "--format", "json", "--gpus", "1"]
    if kind == "model":
        return [tool, "--model", str(path), "--cluster", "h100-sxm"] + sizes
    return [tool, "--model", "mixtral-8x7b", "--cluster", str(path)] + sizes


def replay(path):
    try:
        r = subprocess.run(tool_args(path), capture_output=True, text=True, timeout=20,
                           errors="replace")
    except subprocess.TimeoutExpired:
        return None
    return r


def one_error(r):
    lines = r.stderr.splitlines()
    return r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")


work = pathlib.Path(tempfile.mkdtemp(prefix=f"moefold-fuzz-{kind}-"))
seeds = work / "corpus"
seeds.mkdir()
tree = sorted(corpus.glob("*/*.json"))
for f in tree:
    shutil.copy(f, seeds / f"{f.parent.name}-{f.name}")
before = {p.name for p in seeds.iterdir()}
cmd = [fuzzer, f"-runs={runs}", f"-max_total_time={seconds}", "-seed=1", "-max_len=4096",
       "-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1", str(seeds)]
r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, errors="replace")
done = re.search(r"Done (\d+) runs in (\d+) second", r.stderr)
n, t = (int(done.group(1)), int(done.group(2))) if done else (0, 0)
check(f"fuzz {kind}: {n} runs in {t} s, no crash, hang or sanitizer report",
      r.returncode == 0 and done is not None and (n >= runs or t >= seconds),
      f"exit {r.returncode}\n{r.stderr[-3000:]}")

for f in tree:
    res = replay(f)
    if f.parent.name == "valid":
        check(f"replay {f.parent.name}/{f.name}: exit 0", res is not None and res.returncode == 0,
              res and res.stderr)
    else:
        check(f"replay {f.parent.name}/{f.name}: exit 2, one error line",
              res is not None and one_error(res), res and (res.returncode, res.stdout[:100], res.stderr))

generated = sorted(p for p in seeds.iterdir() if p.name not in before)[:300]
bad = []
for p in generated:
    res = replay(p)
    if res is None or not (res.returncode == 0 or one_error(res)):
        bad.append((p.name, None if res is None else (res.returncode, res.stderr[-300:])))
check(f"replay {len(generated)} generated inputs: exit 0 or exit 2 with one error line", not bad,
      bad[:3])

if all(results):
    shutil.rmtree(work, ignore_errors=True)
else:
    print(f"(kept {work})")
failed = results.count(False)
print(f"[doctest] test cases: {len(results)} | {len(results) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

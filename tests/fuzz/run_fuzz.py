#!/usr/bin/env python3
"""Runs one libFuzzer target and replays its corpus through the tool.

Kinds: model and cluster (moefold-plan's file readers; inputs *.json, given to the tool as
--model or --cluster FILE with one mapping's sizes), safetensors (moefold-upcycle's reader;
inputs *.safetensors, given as --dense FILE with a fresh --out folder, which a refused input must
leave absent) and flags (a tool's flag parsing, any of the
three tools; inputs *.args, the tool's arguments each ended by a NUL, as /proc/PID/cmdline).
1. The fuzzer runs from a copy of the corpus in the tree (valid/ and invalid/ inputs) with a
   fixed seed, until 100,000 runs or 60 s, whichever comes first; any crash, hang, leak,
   sanitizer report, allocation over the limit or failed check of the target fails this case.
2. Every input in the tree is replayed through the tool binary: valid/ ones must exit 0,
   invalid/ ones exit 2 with one "error:" line on stderr and nothing on stdout.
3. Up to 300 of the inputs the fuzzer generated are replayed the same way: files must exit 0, or
   exit 2 with one "error:" line and nothing on stdout; none may run past 20 s. Flag sets are
   first run through the target alone, which records what parsing came to; those it refused must
   make the tool exit 2 printing exactly the target's error line and nothing on stdout, --help
   and --version exit 0 with output; those it accepted are not run (they would run the tool at
   whatever size they ask for).
Findings are kept as invalid/regression-*. Each check is one case of the summary line.
Usage: run_fuzz.py FUZZER CORPUS_DIR model|cluster|flags TOOL [RUNS SECONDS]"""
import os
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


flags = kind == "flags"
label = f"{pathlib.Path(tool).name} flags" if flags else kind
suffix = "args" if flags else kind if kind == "safetensors" else "json"


def split_args(data):
    """The arguments of a flags input, as the fuzz target splits it."""
    args = data.split(b"\0")
    return args[:-1] if args[-1] == b"" else args


def tool_args(path):
    if flags:
        return [tool.encode()] + split_args(pathlib.Path(path).read_bytes())
    if kind == "safetensors":
        return [tool, "--dense", str(path), "--out", str(work / "out"), "--activation", "relu",
                "--experts", "2", "--topk", "2", "--world", "1"]
    sizes = ["--tp", "1", "--cp", "1", "--ep", "1", "--etp", "1", "--pp", "1", "--vpp", "1",
             "--mbs", "1", "--format", "json", "--gpus", "1"]
    if kind == "model":
        return [tool, "--model", str(path), "--cluster", "h100-sxm"] + sizes
    return [tool, "--model", "mixtral-8x7b", "--cluster", str(path)] + sizes


def replay(path):
    """The tool run on one input: returncode, stdout and stderr as bytes, or None after 20 s."""
    shutil.rmtree(work / "out", ignore_errors=True)
    try:
        r = subprocess.run(tool_args(path), capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None
    if kind == "safetensors" and r.returncode != 0 and (work / "out").exists():
        r.returncode = -1000  # a refused input left output behind
    return r


def one_error(r):
    lines = r.stderr.decode(errors="replace").splitlines()
    return r.returncode == 2 and r.stdout == b"" and len(lines) == 1 and lines[0].startswith("error: ")


def shown(r):
    return r and (r.returncode, r.stdout[:100], r.stderr[-300:])


work = pathlib.Path(tempfile.mkdtemp(prefix=f"moefold-fuzz-{label.replace(' ', '-')}-"))
seeds = work / "corpus"
seeds.mkdir()
tree = sorted(corpus.glob(f"*/*.{suffix}"))
for f in tree:
    shutil.copy(f, seeds / f"{f.parent.name}-{f.name}")
before = {p.name for p in seeds.iterdir()}
# Flag sets are short, and parsing one allocates little: a single allocation over 64 MiB fails.
limits = ["-max_len=1024", "-malloc_limit_mb=64"] if flags else ["-max_len=4096"]
cmd = [fuzzer, f"-runs={runs}", f"-max_total_time={seconds}", "-seed=1", *limits,
       "-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1", str(seeds)]
r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, errors="replace")
done = re.search(r"Done (\d+) runs in (\d+) second", r.stderr)
n, t = (int(done.group(1)), int(done.group(2))) if done else (0, 0)
check(f"fuzz {label}: {n} runs in {t} s, no crash, hang or sanitizer report",
      r.returncode == 0 and done is not None and (n >= runs or t >= seconds),
      f"exit {r.returncode}\n{r.stderr[-3000:]}")

for f in tree:
    res = replay(f)
    if f.parent.name == "valid":
        check(f"replay {f.parent.name}/{f.name}: exit 0", res is not None and res.returncode == 0,
              shown(res))
    else:
        check(f"replay {f.parent.name}/{f.name}: exit 2, one error line",
              res is not None and one_error(res), shown(res))

generated = sorted(p for p in seeds.iterdir() if p.name not in before)[:300]
bad = []
if flags:
    # What parsing came to for each, from the target itself: "INPUT-IN-HEX<TAB>STATUS<TAB>LINE".
    verdicts = work / "verdicts.txt"
    v = subprocess.run([fuzzer] + [str(p) for p in generated], cwd=work, capture_output=True,
                       env=dict(os.environ, MOEFOLD_FUZZ_VERDICTS=str(verdicts)))
    said = {}
    for line in (verdicts.read_bytes().split(b"\n")[:-1] if verdicts.exists() else []):
        hex_input, status, error = line.split(b"\t", 2)
        said[bytes.fromhex(hex_input.decode())] = (status, error)
    if v.returncode != 0:
        bad.append(("verdicts", v.returncode, v.stderr[-300:]))
    replayed = 0
    for p in generated:
        status, error = said.get(p.read_bytes(), (b"none", b""))
        if status == b"-1":
            continue
        replayed += 1
        res = replay(p)
        if status == b"2":
            ok = res is not None and one_error(res) and res.stderr == error + b"\n"
        else:
            ok = res is not None and res.returncode == 0 and res.stdout != b"" and res.stderr == b""
        if not ok:
            bad.append((p.name, status, error[-200:], shown(res)))
    check(f"replay {replayed} of {len(generated)} generated inputs (the rest parse and would run): "
          "the tool's error line is the parser's, --help and --version exit 0", not bad, bad[:3])
else:
    for p in generated:
        res = replay(p)
        if res is None or not (res.returncode == 0 or one_error(res)):
            bad.append((p.name, shown(res)))
    check(f"replay {len(generated)} generated inputs: exit 0 or exit 2 with one error line",
          not bad, bad[:3])

if all(results):
    shutil.rmtree(work, ignore_errors=True)
else:
    print(f"(kept {work})")
failed = results.count(False)
print(f"[doctest] test cases: {len(results)} | {len(results) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

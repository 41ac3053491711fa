#!/usr/bin/env python3
"""moefold-plan --calibration FILE, run as a user runs it: the output of
shared/bench/calibration_probe.py (written here in exactly its shape) and the H200 file in
docs/calibration/ are read, the tool says which rates were measured and which curves stayed
built in (text and JSON), slower measured GEMMs lower the predicted MFU, bench-comm-a2av-mpi's
text output is read as it is (intra- or inter-node by its header, the NIC's share by hand), every
kind of bad file exits 2 with one error line naming it, and docs/planner-calibration.schema.json accepts the good
files and rejects those whose fault a schema can state.
Usage: calibration_cli_test.py MOEFOLD_PLAN DOCS_DIR"""
import json
import pathlib
import subprocess
import sys
import tempfile

tool, docs = sys.argv[1], pathlib.Path(sys.argv[2])
work = pathlib.Path(tempfile.mkdtemp(prefix="moefold-calibration-"))
cases = []


def check(name, ok, detail=""):
    cases.append(bool(ok))
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + ("" if ok else f": {detail}"))


def run(*args):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=120)


def one_error(r):
    lines = r.stderr.splitlines()
    return r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")


fixed = ["--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 128, "--tp", 2, "--cp", 1,
         "--ep", 8, "--etp", 1, "--pp", 8, "--vpp", 7, "--mbs", 1]

# calibration_probe.py's output: {"gemm": [{M, K, N, tflops}], "attn": [{S, B, heads, head_dim,
# causal, fwd_tflops, fwdbwd_tflops}]}, rates of an H100-class GPU.
probe = {"gemm": [{"M": m, "K": k, "N": n, "tflops": t}
                  for m, k, n, t in [(2048, 4096, 4096, 610.2), (8192, 6144, 32768, 690.5),
                                     (16384, 8192, 8192, 720.0), (4096, 6144, 768, 402.3)]],
         "attn": [{"S": s, "B": max(1, 16384 // s), "heads": 48, "head_dim": 128, "causal": True,
                   "fwd_tflops": f, "fwdbwd_tflops": fb}
                  for s, f, fb in [(2048, 380.1, 300.4), (4096, 450.2, 360.0), (8192, 480.7, 390.2)]]}
probe_file = work / "calib.json"
probe_file.write_text(json.dumps(probe, indent=1))
r = run(*fixed, "--calibration", probe_file)
check("calibration_probe.py's output is read as it is", r.returncode == 0, r.stderr)
check("the text says what was measured and what stayed built in",
      "measured: dense GEMM (4 shapes), expert GEMM (from the dense GEMM table), attention "
      "(3 sequence lengths)" in r.stdout and
      "built-in: memory-bound bandwidth, all-to-all intra-node" in r.stdout, r.stdout[:600])

# The probe's real output, as an H200 wrote it (2026-12-04), read as it is.
r = run(*fixed, "--calibration", docs / "calibration" / "h200-2026-12-04-probe.json")
check("the probe's H200 output in docs/calibration is read as it is",
      r.returncode == 0 and "measured: dense GEMM (52 shapes), expert GEMM (from the dense GEMM "
      "table), attention (5 sequence lengths)" in r.stdout, r.stderr + r.stdout[:600])
r = run(*fixed, "--calibration", docs / "calibration" / "h200-2026-12-04-queued.json")
check("benchmarks/plan/gemm_attention_rates.py's H200 output is read as it is",
      r.returncode == 0 and "measured: dense GEMM (52 shapes), expert GEMM (from the dense GEMM "
      "table), attention (5 sequence lengths)" in r.stdout, r.stderr + r.stdout[:600])
r = run(*fixed, "--calibration", docs / "calibration" / "h200-2026-12-04.json")
check("the combined H200 file of 2026-12-04 is read",
      r.returncode == 0 and "measured: dense GEMM (52 shapes), expert GEMM (8 shapes), attention "
      "(5 sequence lengths), memory-bound bandwidth" in r.stdout, r.stderr + r.stdout[:600])

h200 = docs / "calibration" / "h200-2026-11-30.json"
r = run("--model", "mixtral-8x22b", "--cluster", "h100-sxm", "--gpus", 128, "--top", 3,
        "--format", "json", "--calibration", h200)
doc = json.loads(r.stdout) if r.returncode == 0 else {}
check("the H200 file in docs/calibration: a search, JSON with the calibration named",
      doc.get("calibration", {}).get("measured") == [
          "dense GEMM (9 shapes)", "expert GEMM (8 shapes)", "memory-bound bandwidth"] and
      len(doc.get("ranked", [])) == 3, (r.returncode, r.stderr, r.stdout[:300]))
# Rates of an H200 on an H100 cluster carry over (the same peak); on a GB200 they do not, and the
# tool says so (text and JSON); a file naming no GPU is taken as measured on the planned one,
# which the tool states too.
h200_12 = docs / "calibration" / "h200-2026-12-04.json"
gb200 = ["--model", "mixtral-8x22b", "--cluster", "gb200-nvl72", "--gpus", 128, "--tp", 2,
         "--cp", 1, "--ep", 8, "--etp", 1, "--pp", 8, "--vpp", 7, "--mbs", 1]
r = run(*gb200, "--calibration", h200_12)
check("an H200 file on a GB200 cluster: the text cautions, naming both peaks",
      r.returncode == 0 and "caution: measured on a GPU of 989 TFLOP/s bf16 peak, planned on "
      "gb200-nvl72 at 2500" in r.stdout, r.stderr + r.stdout[:800])
r = run(*gb200, "--format", "json", "--calibration", h200_12)
doc = json.loads(r.stdout) if r.returncode == 0 else {}
check("... and the JSON carries it", "2500" in doc.get("calibration", {}).get("caution", ""),
      r.stderr + r.stdout[:300])
r = run(*fixed, "--format", "json", "--calibration", h200_12)
doc = json.loads(r.stdout) if r.returncode == 0 else {}
check("an H200 file on an H100 cluster: no caution",
      doc.get("calibration", {}).get("caution", None) == "", r.stderr + r.stdout[:300])
r = run(*gb200, "--calibration", docs / "calibration" / "h200-2026-12-04-probe.json")
check("a file naming no GPU: taken as measured on the planned GPU, and the tool says so",
      r.returncode == 0 and "caution: the file names no GPU: its compute rates are read as measured "
      "on gb200-nvl72 itself (2500 TFLOP/s bf16 peak)" in r.stdout, r.stderr + r.stdout[:800])

r = run(*fixed, "--format", "json", "--calibration", h200)
one = json.loads(r.stdout) if r.returncode == 0 else {}
check("one mapping in JSON carries the calibration too", "calibration" in one and "mfu" in one,
      r.stdout[:300])

# Slower measured GEMMs (30% of peak at every shape) lower the predicted MFU.
base = json.loads(run(*fixed, "--format", "json").stdout)
slow = work / "slow.json"
slow.write_text(json.dumps({"gemm": [{"M": m, "K": k, "N": n, "tflops": 0.3 * 989}
                                     for m, k, n in [(4096, 6144, 6144), (16384, 6144, 32768)]],
                            "expert_gemm": [{"rows_per_expert": 2048, "K": 6144, "N": 32768,
                                             "tflops": 0.3 * 989}]}))
r = run(*fixed, "--format", "json", "--calibration", slow)
got = json.loads(r.stdout) if r.returncode == 0 else {}
check(f"GEMMs measured at 30% of peak lower the MFU ({base['mfu']:.3f} -> {got.get('mfu', 0):.3f})",
      r.returncode == 0 and got["mfu"] < 0.8 * base["mfu"], r.stderr)

# A collective sweep: ring collectives at the same sizes merge (the slowest counts), and an
# inter-node all-to-all states its group size.
sweep = work / "sweep.json"
sweep.write_text(json.dumps({"source": "nccl-tests on 2 x 8 H100", "collectives": [
    {"op": op, "link": "intra", "bytes": b, "busbw_gbs": bw}
    for op, b, bw in [("all_gather", 1e6, 90), ("all_gather", 1e8, 360), ("all_reduce", 1e6, 80),
                      ("all_reduce", 1e8, 370), ("reduce_scatter", 1e8, 350)]] + [
    {"op": "all_to_all", "link": "inter", "bytes": b, "busbw_gbs": bw, "gpus": 16}
    for b, bw in [(1e6, 20), (1e8, 70)]]}))
r = run(*fixed, "--calibration", sweep)
check("a collective sweep: ring collectives at one size merge, inter-node all-to-all with its size",
      r.returncode == 0 and "all-gather/reduce-scatter intra-node (2 sizes)" in r.stdout and
      "all-to-all inter-node (2 sizes)" in r.stdout, (r.returncode, r.stderr, r.stdout[:500]))
check("... bandwidths need no GPU named: no caution", r.returncode == 0 and "caution" not in r.stdout,
      r.stdout[:500])

bad = {
    "not JSON": ("{", "malformed JSON"),
    "an unknown member": (json.dumps({"gemm": [], "flops": 1}), 'unknown calibration member "flops"'),
    "a negative rate": (json.dumps({"gemm": [{"M": 1, "K": 1, "N": 1, "tflops": -5}]}),
                        'gemm[0] member "tflops" must be a positive number'),
    "a GEMM without its N": (json.dumps({"gemm": [{"M": 1, "K": 1, "tflops": 5}]}), 'lacks "N"'),
    "two rates for one sequence length": (json.dumps({"attn": [
        {"S": 4096, "fwdbwd_tflops": 300}, {"S": 4096, "fwdbwd_tflops": 310}]}),
        "two rates for size"),
    "non-causal attention": (json.dumps({"attn": [{"S": 4096, "causal": False,
                                                    "fwdbwd_tflops": 300}]}), "only causal"),
    "an unknown collective": (json.dumps({"collectives": [{"op": "broadcast", "link": "intra",
                                                           "bytes": 1e6, "busbw_gbs": 100}]}),
                              '"op" must be all_to_all'),
    "no measured rate": (json.dumps({"source": "nothing"}), "at least one measured rate"),
    "an inter-node all-to-all without its group size": (json.dumps({"collectives": [
        {"op": "all_to_all", "link": "inter", "bytes": 1e6, "busbw_gbs": 40}]}), 'lacks "gpus"'),
    "an inter-node all-to-all inside one node": (json.dumps({"collectives": [
        {"op": "all_to_all", "link": "inter", "bytes": 1e6, "busbw_gbs": 40, "gpus": 8}]}),
        "must span more than one node"),
}
schema = json.loads((docs / "planner-calibration.schema.json").read_text())
try:
    import jsonschema
    validator = jsonschema.Draft202012Validator(schema)
except ImportError:
    validator = None
check("the schema is installed to check (python3-jsonschema, scripts/setup.sh)", validator is not None)
for name, (text, words) in bad.items():
    f = work / (name.replace(" ", "-") + ".json")
    f.write_text(text)
    r = run(*fixed, "--calibration", f)
    check(f"refused: {name}", one_error(r) and str(f) in r.stderr and words in r.stderr,
          (r.returncode, r.stderr))
    if validator is not None and name not in ("not JSON", "two rates for one sequence length",
                                              "an inter-node all-to-all inside one node"):
        check(f"the schema rejects it too: {name}",
              not validator.is_valid(json.loads(text)))
if validator is not None:
    for f in (probe_file, h200, slow, sweep,
              *sorted((docs / "calibration").glob("h200-2026-12-04*.json"))):
        errs = [e.message for e in validator.iter_errors(json.loads(f.read_text()))]
        check(f"the schema accepts {f.name}", not errs, errs[:2])

# bench-comm-a2av-mpi's text output, as it is: 16 ranks on 2 nodes (inter-node) and 8 ranks on
# one node (intra-node). Rates from the size and time columns; the inter-node table keeps the
# NIC's share, 8 of a rank's 15 peers.
def a2a_output(ranks, nodes, rows):
    head = (f"# moefold all_to_all_v, MPI backend, {ranks} ranks on {nodes} node"
            f"{'' if nodes == 1 else 's'}, float32\n"
            "#      size(B)        count   time(us)      algbw      busbw    mpi(us)      ratio\n"
            "#                (elements)                (GB/s)     (GB/s)\n")
    body = ""
    for size, us in rows:
        algbw = size / us / 1e3
        body += (f"  {size:12.0f} {size // 4:12d} {us:10.1f} {algbw:10.3f} "
                 f"{algbw * (ranks - 1) / ranks:10.3f} {us:10.1f} {1.0:10.2f}\n")
    return head + body


inter_rows = [(1 << 20, 120.0), (1 << 24, 900.0), (1 << 26, 3300.0)]
inter = work / "a2a-inter.txt"
inter.write_text(a2a_output(16, 2, inter_rows))
ep16 = ["--model", "mixtral-8x22b-g8t8", "--cluster", "h100-sxm", "--gpus", 128, "--tp", 1, "--cp", 1,
        "--ep", 16, "--etp", 1, "--pp", 8, "--vpp", 7, "--mbs", 1]
base = run(*ep16, "--format", "json")
r = run(*ep16, "--format", "json", "--calibration", inter)
doc = json.loads(r.stdout) if r.returncode == 0 else {}
check("bench-comm-a2av-mpi's output is read as it is: an inter-node table",
      doc.get("calibration", {}).get("measured") == ["all-to-all inter-node (3 sizes)"], r.stderr)
# By hand: EP 16 over two nodes of 8; each rank sends T_m * k rows of H (4096 * 8 * 6144 * 2 B =
# 402,653,184 B), 8/15 of it over the NIC at the measured rate interpolated in log size (the
# largest size is 64 MiB, so the rate there holds): busbw 2^26/3300 us * 15/16, times 8/15.
nic = (1 << 26) / 3300e-6 * 15 / 16 * 8 / 15
bytes_per_rank = 4096 * 8 * 6144 * 2
t_out = bytes_per_rank * 15 / 16 * 8 / 15 / nic
t_in = bytes_per_rank * 15 / 16 * 7 / 15 / (450e9 * 0.72)
layers, micro = 56 // 8, 256 // 16  # layers per stage; gbs / (mbs 1 * dp 16) micro-batches
expected = 4 * layers * micro * max(t_in, t_out)
got = doc.get("breakdown", {}).get("time_s", {}).get("ep_a2a", 0)
check("the inter-node rate is the bus bandwidth times the NIC's share, by hand",
      abs(got - expected) <= 1e-4 * expected + 1e-5, (got, expected))
check("a slower measured network makes the step slower",
      r.returncode == 0 and base.returncode == 0 and
      doc["step_time_s"] > json.loads(base.stdout)["step_time_s"])
check("the alltoall dispatcher sets nothing aside", doc.get("calibration", {}).get("ignored") == [])
# DeepEP's deduplicated traffic is not what an all-to-all measures: the table is set aside, said
# so, and the exchange keeps DeepEP's rates (the same time as without the file).
deep_plain = run(*ep16, "--dispatcher", "deepep", "--format", "json")
deep_cal = run(*ep16, "--dispatcher", "deepep", "--format", "json", "--calibration", inter)
dc = json.loads(deep_cal.stdout) if deep_cal.returncode == 0 else {}
check("DeepEP: a measured all-to-all is named as ignored, not as measured",
      dc.get("calibration", {}).get("ignored") == ["all-to-all inter-node"] and
      dc["calibration"]["measured"] == [] and deep_plain.returncode == 0 and
      dc["breakdown"]["time_s"]["ep_a2a"] == json.loads(deep_plain.stdout)["breakdown"]["time_s"]["ep_a2a"],
      (deep_cal.stderr, dc.get("calibration")))
r = run(*ep16, "--dispatcher", "hybridep", "--calibration", inter)
check("HybridEP: the text says which table was ignored and why",
      r.returncode == 0 and "ignored: all-to-all inter-node (DeepEP and HybridEP keep their own rates"
      in r.stdout, r.stdout[:600])
intra = work / "a2a-intra.txt"
intra.write_text(a2a_output(8, 1, [(1 << 20, 40.0), (1 << 24, 150.0)]))
r = run(*fixed, "--calibration", intra)
check("one node: the intra-node table",
      r.returncode == 0 and "measured: all-to-all intra-node (2 sizes)" in r.stdout and
      "bench-comm-a2av-mpi, 8 ranks on 1 node" in r.stdout, r.stderr or r.stdout[:400])
bad_a2a = {
    "a one-GPU loopback": ("# moefold all_to_all_v, device loopback, 8 ranks on one GPU, float32\n"
                           "      1024      256      1.0      1.0      1.0      1.0      1.0\n",
                           "loopback run measures no link"),
    "no node count": ("# moefold all_to_all_v, MPI backend, 2 ranks, float32\n"
                      "      1024      256      1.0      1.0      1.0      1.0      1.0\n",
                      "how many ranks on how many nodes"),
    "a failed collective": (a2a_output(16, 2, inter_rows) +
                            "# ERROR: a collective failed or delivered wrong data\n",
                            "line 7: the benchmark reported a failed collective"),
    "a short line": (a2a_output(16, 2, inter_rows) + "  1024 256 1.0\n", "line 7 is not 7 numbers"),
    "a size twice": (a2a_output(16, 2, inter_rows + [inter_rows[0]]), "line 7: a second rate"),
    "uneven nodes": (a2a_output(15, 2, inter_rows), "do not spread evenly"),
    "no measurements": (a2a_output(16, 2, []), "no measurement lines"),
}
for name, (text, words) in bad_a2a.items():
    f = work / (name.replace(" ", "-") + ".txt")
    f.write_text(text)
    r = run(*fixed, "--calibration", f)
    check(f"refused: bench output with {name}", one_error(r) and words in r.stderr, (r.returncode, r.stderr))

failed = cases.count(False)
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

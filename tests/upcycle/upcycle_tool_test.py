#!/usr/bin/env python3
"""moefold-upcycle end to end, against the reference `safetensors` package: the dense checkpoints
are written with its low-level serialize() (dtype BF16 for bf16), in fp32 and bf16, single-file and
sharded with model.safetensors.index.json, and the tool's output is read back with its
deserialize(), so our reader and writer cannot agree on a wrong format. Every expert shard is held
to the dense slice times the scale, rounded once, computed here from the dense values; the routers
to router_init.py, a Python twin of the generator; the rank layout to Megatron-Core's order
(etp fastest, then ep, edp, pp) and its even pipeline split. Laziness is measured: rchar of a
one-rank run is at most the slices it needs + the headers + 1 MiB. Bad input of every kind listed
in the tool's contract exits 2 with one "error:" line naming the file and the problem, and leaves
no output behind. Training continues: train_moe_cpu --upcycle-from starts from the upcycled
weights, its step-0 output equals the dense FFN's (G = 1), and its loss then falls.
Usage: upcycle_tool_test.py MOEFOLD_UPCYCLE TRAIN_MOE_CPU"""
import json
import math
import os
import pathlib
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import router_init  # noqa: E402

try:
    import safetensors
except ImportError:
    print("FAIL: the reference package `safetensors` is not installed (scripts/setup.sh installs it)")
    print("[doctest] test cases: 1 | 0 passed | 1 failed | 0 skipped")
    sys.exit(1)

tool = str(pathlib.Path(sys.argv[1]).resolve())
train = str(pathlib.Path(sys.argv[2]).resolve())
work = pathlib.Path(tempfile.mkdtemp(prefix="moefold-upcycle-test-"))
cases = []


def check(name, ok, detail=""):
    cases.append(bool(ok))
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + ("" if ok else f": {detail}"))


# --- numbers in the dtypes, computed exactly in Python ------------------------------------------
def to_bf16(x):
    """x (a double) rounded once to the nearest bf16, ties to even (normal range only)."""
    if x == 0.0:
        return 0.0
    _, e = math.frexp(x)  # |x| in [2^(e-1), 2^e)
    q = 2.0 ** (e - 8)  # bf16 keeps 8 significant bits
    return round(x / q) * q  # x / q is exact; round() breaks ties to even


def to_f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def encode(values, dtype):
    if dtype == "F32":
        return struct.pack(f"<{len(values)}f", *values)
    if dtype == "BF16":
        # bf16 is the high half of fp32; the values are bf16 already, so the low half is zero.
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    raise ValueError(dtype)


def decode(data, dtype):
    if dtype == "F32":
        return list(struct.unpack(f"<{len(data) // 4}f", data))
    if dtype == "BF16":
        return [struct.unpack("<f", b"\0\0" + data[i:i + 2])[0] for i in range(0, len(data), 2)]
    raise ValueError(dtype)


def rounded(x, dtype):
    return to_bf16(x) if dtype == "BF16" else to_f32(x)


# --- dense checkpoints written with the reference package ---------------------------------------
# serialize() takes torch's dtype names and writes the format's (BF16, F32, I32) in the header.
TORCH_NAME = {"F32": "float32", "BF16": "bfloat16", "I32": "int32"}


def make_dense(folder, *, layers, hidden, ffn, gated, dtype, sharded, hidden_act=None, seed=0,
               drop=(), extra_dtype=None, bias=False):
    """A dense decoder checkpoint in the Hugging Face layout (with attention and norm tensors the
    tool must not copy). Returns {name: (shape, values)} of the FFN tensors."""
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    tensors, ffn_values = {}, {}

    def add(name, shape, dt=dtype):
        n = math.prod(shape)
        vals = [rounded(rng.uniform(-1, 1), dt) for _ in range(n)]
        tensors[name] = {"dtype": TORCH_NAME[dt], "shape": list(shape), "data": encode(vals, dt)}
        return vals

    add("model.embed_tokens.weight", [7, hidden])
    for i in range(layers):
        add(f"model.layers.{i}.self_attn.q_proj.weight", [hidden, hidden])
        add(f"model.layers.{i}.input_layernorm.weight", [hidden])
        names = (["gate_proj"] if gated else []) + ["up_proj", "down_proj"]
        for p in names:
            name = f"model.layers.{i}.mlp.{p}.weight"
            shape = [hidden, ffn] if p == "down_proj" else [ffn, hidden]
            dt = extra_dtype if (extra_dtype and p == "down_proj") else dtype
            ffn_values[name] = (shape, add(name, shape, dt))
            if bias:
                bname = f"model.layers.{i}.mlp.{p}.bias"
                bshape = [hidden] if p == "down_proj" else [ffn]
                ffn_values[bname] = (bshape, add(bname, bshape, dt))
    for name in drop:
        del tensors[name]
    if sharded:
        names = sorted(tensors)
        half = len(names) // 2
        weight_map = {}
        for k, part in enumerate([names[:half], names[half:]]):
            file = f"model-{k + 1:05d}-of-00002.safetensors"
            (folder / file).write_bytes(safetensors.serialize({n: tensors[n] for n in part}))
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
        path = folder
    else:
        path = folder / "model.safetensors"
        path.write_bytes(safetensors.serialize(tensors, metadata={"format": "pt"}))
    if hidden_act:
        (folder / "config.json").write_text(json.dumps({"hidden_act": hidden_act,
                                                        "num_hidden_layers": layers}))
    return path, ffn_values


def run_tool(*args, timeout=120):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def one_error(r):
    lines = r.stderr.splitlines()
    return r.returncode == 2 and r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")


def read_back(path):
    """The tensors of one of our files, parsed by the reference package."""
    return {name: t for name, t in safetensors.deserialize(path.read_bytes())}


def scale_formula(experts, topk, g, act, pre):
    a = (experts // g) * g * g / topk if pre else g
    degree = 3 if act in ("swiglu", "geglu", "squared_relu") else 2
    return a ** (1.0 / degree)


def moe_coord(rank, world, pp, ep, etp):
    """Megatron-Core's expert mesh for the order tp-cp-ep-dp-pp: etp fastest, then ep, edp, pp."""
    edp = world // (pp * ep * etp)
    return {"etp": rank % etp, "ep": rank // etp % ep, "edp": rank // (etp * ep) % edp,
            "pp": rank // (etp * ep * edp)}


def check_upcycled(label, out, dense, *, world, pp, ep, etp, experts, topk, g, act, pre, seed,
                   layers, hidden, ffn, gated, out_dtype, uniform=False, only_rank=None,
                   bias=False):
    """Every rank's file against the dense values; returns the files' bytes by rank."""
    index = json.loads((out / "index.json").read_text())
    s = index["options"]["weight_scale"]
    want_s = scale_formula(experts, topk, g, act, pre)
    check(f"{label}: index.json's weight scale {s:.17g} is the formula's {want_s:.17g}",
          abs(s - want_s) <= 1e-15 * want_s)
    F = ffn // g
    Fs = F // etp
    per_stage = layers // pp
    ranks = [only_rank] if only_rank is not None else list(range(world))
    seen = {r["rank"]: r for r in index["ranks"]}
    check(f"{label}: index.json lists ranks {ranks}", sorted(seen) == ranks, sorted(seen))
    bad, blobs, cover = [], {}, {}
    for rank in ranks:
        c = moe_coord(rank, world, pp, ep, etp)
        if seen.get(rank, {}).get("moe") != c:
            bad.append((rank, "coordinates", seen.get(rank, {}).get("moe"), c))
        path = out / f"rank-{rank:05d}.safetensors"
        blobs[rank] = path.read_bytes()
        got = read_back(path)
        names = set()
        for i in range(c["pp"] * per_stage, (c["pp"] + 1) * per_stage):
            router_name = f"layers.{i}.router.weight"
            names.add(router_name)
            want_router = router_init.router(seed + i, experts, hidden, g, uniform)
            t = got.get(router_name)
            if t is None or t["dtype"] != "F32" or t["shape"] != [experts, hidden] or \
                    decode(t["data"], "F32") != [v for row in want_router for v in row]:
                bad.append((rank, router_name))
            L = experts // ep
            for e in range(c["ep"] * L, (c["ep"] + 1) * L):
                part = e % g
                rows = range(part * F + c["etp"] * Fs, part * F + (c["etp"] + 1) * Fs)
                pre_name = f"model.layers.{i}.mlp."
                down = dense[pre_name + "down_proj.weight"][1]
                fc1 = []
                for proj in (["gate_proj"] if gated else []) + ["up_proj"]:
                    vals = dense[pre_name + proj + ".weight"][1]
                    for n in rows:
                        fc1 += [rounded(s * v, out_dtype) for v in vals[n * hidden:(n + 1) * hidden]]
                fc2 = [rounded(s * down[h * ffn + n], out_dtype) for h in range(hidden) for n in rows]
                for n in rows:
                    cover[(i, n)] = cover.get((i, n), 0) + 1
                expected = [("fc1.weight", fc1, [(2 if gated else 1) * Fs, hidden]),
                            ("fc2.weight", fc2, [hidden, Fs])]
                if bias:  # fc1 biases scale as the weights; fc2's by E/k before top-k, else 1
                    t = experts / topk if pre else 1.0
                    b1 = []
                    for proj in (["gate_proj"] if gated else []) + ["up_proj"]:
                        vals = dense[pre_name + proj + ".bias"][1]
                        b1 += [rounded(s * vals[n], out_dtype) for n in rows]
                    b2 = [rounded(t * v, out_dtype) for v in dense[pre_name + "down_proj.bias"][1]]
                    expected += [("fc1.bias", b1, [len(b1)]), ("fc2.bias", b2, [hidden])]
                for kind, want, shape in expected:
                    name = f"layers.{i}.experts.{e}.{kind}"
                    names.add(name)
                    t = got.get(name)
                    if t is None or t["dtype"] != out_dtype or t["shape"] != shape:
                        bad.append((rank, name, t and (t["dtype"], t["shape"])))
                    elif decode(t["data"], out_dtype) != want:
                        bad.append((rank, name, "values"))
        if set(got) != names:
            bad.append((rank, "extra or missing tensors", sorted(set(got) ^ names)[:4]))
    check(f"{label}: {len(ranks)} rank files hold exactly their experts (dense slice x scale, "
          "rounded once) and the Python twin's routers", not bad, bad[:4])
    if only_rank is None:
        # Over the ETP shards of one EDP replica, each dense neuron is served E / G times per layer.
        edp = world // (pp * ep * etp)
        want = experts // g * edp
        wrong = [k for k, v in cover.items() if v != want]
        full = len(cover) == layers * ffn
        check(f"{label}: the shards cover every dense neuron of every layer E/G x EDP = {want} times",
              full and not wrong, (len(cover), wrong[:3]))
        # Ranks that differ only in their data-parallel coordinate get identical files.
        groups = {}
        for r in ranks:
            c = moe_coord(r, world, pp, ep, etp)
            groups.setdefault((c["pp"], c["ep"], c["etp"]), set()).add(blobs[r])
        check(f"{label}: ranks differing only in EDP get byte-identical files",
              all(len(v) == 1 for v in groups.values()))
    return index


# --- 1. fp32, single file, gated (hidden_act silu -> swiglu), G = 1, a folded mapping -----------
d1, v1 = make_dense(work / "d1", layers=4, hidden=6, ffn=8, gated=True, dtype="F32", sharded=False,
                    hidden_act="silu", seed=1)
r = run_tool("--dense", d1, "--out", work / "o1", "--experts", 4, "--topk", 2, "--world", 16,
             "--tp", 2, "--pp", 2, "--ep", 2, "--etp", 2, "--seed", 7)
check("fp32 single file: exit 0", r.returncode == 0, (r.returncode, r.stderr[-500:]))
if r.returncode == 0:
    idx = check_upcycled("fp32 G=1 pp2 ep2 etp2", work / "o1", v1, world=16, pp=2, ep=2, etp=2,
                         experts=4, topk=2, g=1, act="swiglu", pre=False, seed=7, layers=4,
                         hidden=6, ffn=8, gated=True, out_dtype="F32")
    check("index.json: mapping, options, the activation from config.json, what was not written",
          idx["mapping"]["edp"] == 2 and idx["mapping"]["dp"] == 4 and
          idx["options"]["activation"] == "swiglu" and "attention" in idx["not_written"] and
          idx["dense"]["layers_per_stage"] == 2, idx["mapping"])
    src = [t for t in idx["ranks"][3]["tensors"] if t["name"] == "layers.0.experts.2.fc1.weight"]
    # rank 3: etp 1, ep 1 -> experts 2, 3; expert 2's ETP shard 1 is dense rows [4, 8).
    check("index.json: each tensor names the dense slices it came from",
          src and src[0]["sources"] == [
              {"file": "model.safetensors", "tensor": "model.layers.0.mlp.gate_proj.weight",
               "rows": [4, 8], "cols": [0, 6]},
              {"file": "model.safetensors", "tensor": "model.layers.0.mlp.up_proj.weight",
               "rows": [4, 8], "cols": [0, 6]}], src)

# --- 2. bf16, sharded with an index, not gated (relu2 -> squared ReLU), G = 2, before top-k -----
d2, v2 = make_dense(work / "d2", layers=2, hidden=5, ffn=12, gated=False, dtype="BF16", sharded=True,
                    hidden_act="relu2", seed=2)
for dt_flag, out_dtype in (("same", "BF16"), ("fp32", "F32")):
    out = work / f"o2-{dt_flag}"
    r = run_tool("--dense", d2, "--out", out, "--experts", 4, "--topk", 2, "--granularity", 2,
                 "--pre-softmax", "--world", 4, "--ep", 2, "--etp", 3, "--pp", 1, "--tp", 1,
                 "--dtype", dt_flag)
    # ep 2 x etp 3 = 6 does not divide 4 ranks: refused by the fold's rules
    check(f"bf16 sharded --dtype {dt_flag}: a mapping whose MoE mesh does not tile the world is "
          "refused", one_error(r) and "world" in r.stderr, (r.returncode, r.stderr))
    r = run_tool("--dense", d2, "--out", out, "--experts", 4, "--topk", 2, "--granularity", 2,
                 "--pre-softmax", "--world", 6, "--ep", 2, "--etp", 3, "--dtype", dt_flag)
    check(f"bf16 sharded --dtype {dt_flag}: exit 0", r.returncode == 0, (r.returncode, r.stderr))
    if r.returncode == 0:
        check_upcycled(f"bf16 sharded G=2 pre-softmax --dtype {dt_flag}", out, v2, world=6, pp=1,
                       ep=2, etp=3, experts=4, topk=2, g=2, act="squared_relu", pre=True,
                       seed=1234, layers=2, hidden=5, ffn=12, gated=False, out_dtype=out_dtype)

# --- 2b. FFN biases (mlp_bias): gated, bf16, softmax before top-k --------------------------------
d11, v11 = make_dense(work / "d11", layers=2, hidden=4, ffn=8, gated=True, dtype="BF16",
                      sharded=False, hidden_act="silu", seed=11, bias=True)
r = run_tool("--dense", d11, "--out", work / "o11", "--experts", 4, "--topk", 2, "--granularity", 2,
             "--pre-softmax", "--world", 4, "--ep", 2, "--etp", 2)
check("biases: exit 0", r.returncode == 0, r.stderr)
if r.returncode == 0:
    check_upcycled("biases bf16 G=2 pre-softmax ep2 etp2", work / "o11", v11, world=4, pp=1, ep=2,
                   etp=2, experts=4, topk=2, g=2, act="swiglu", pre=True, seed=1234, layers=2,
                   hidden=4, ffn=8, gated=True, out_dtype="BF16", bias=True)

# --- 3. uniform router, --layers, --rank ---------------------------------------------------------
r = run_tool("--dense", d1, "--out", work / "o3", "--experts", 8, "--topk", 2, "--granularity", 2,
             "--router-init", "uniform", "--world", 4, "--pp", 2, "--ep", 2, "--rank", 3,
             "--layers", "3")
check("--rank 3 --layers 3 --router-init uniform: exit 0", r.returncode == 0, r.stderr)
if r.returncode == 0:
    got = read_back(work / "o3" / "rank-00003.safetensors")
    files = sorted(p.name for p in (work / "o3").iterdir())
    check("--rank writes one file; --layers keeps only layer 3 (on stage 1), with a zero router",
          files == ["index.json", "rank-00003.safetensors"] and
          sorted(got) == ["layers.3.experts.4.fc1.weight", "layers.3.experts.4.fc2.weight",
                          "layers.3.experts.5.fc1.weight", "layers.3.experts.5.fc2.weight",
                          "layers.3.experts.6.fc1.weight", "layers.3.experts.6.fc2.weight",
                          "layers.3.experts.7.fc1.weight", "layers.3.experts.7.fc2.weight",
                          "layers.3.router.weight"] and
          set(decode(got["layers.3.router.weight"]["data"], "F32")) == {0.0}, (files, sorted(got)))

# --- 4. laziness: one rank of a larger model reads its slices, the headers and little else ------
d4, _ = make_dense(work / "d4", layers=2, hidden=128, ffn=512, gated=True, dtype="F32",
                   sharded=True, hidden_act="silu", seed=4)
dense_bytes = sum(p.stat().st_size for p in d4.iterdir())
r = run_tool("--dense", d4, "--out", work / "o4", "--experts", 8, "--topk", 2, "--granularity", 2,
             "--world", 16, "--ep", 8, "--etp", 2, "--rank", 5)
if r.returncode == 0:
    idx = json.loads((work / "o4" / "index.json").read_text())
    slices = set()
    for t in idx["ranks"][0]["tensors"]:
        for s in t["sources"]:
            slices.add((s["tensor"], tuple(s["rows"]), tuple(s["cols"])))
    need = sum((a[1] - a[0]) * (b[1] - b[0]) * 4 for _, a, b in slices)
    headers = 0
    for p in d4.iterdir():
        if p.suffix == ".safetensors":
            headers += 8 + struct.unpack("<Q", p.read_bytes()[:8])[0]
        else:
            headers += p.stat().st_size
    rchar = int(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("rchar:")))
    check(f"laziness: rchar {rchar} <= slices {need} + headers {headers} + 1 MiB (dense files "
          f"{dense_bytes} bytes)", 0 < rchar <= need + headers + (1 << 20) and rchar < dense_bytes / 3,
          r.stdout)
else:
    check("laziness run: exit 0", False, r.stderr)

# --- 5. bad input: exit 2, one error line naming the file and the problem, nothing left behind --
def refused(label, args, words, out=None):
    before = set(out.iterdir()) if out else set()
    out = out or work / ("bad-" + str(len(cases)))
    r = run_tool(*args, "--out", out)
    left = out.exists() and set(out.iterdir()) != before
    created = out.exists() and not left and out.name.startswith("bad-")
    check(f"refused: {label}", one_error(r) and all(w in r.stderr for w in words) and not left
          and not created, (r.returncode, r.stderr, left, created))


base = ["--experts", 4, "--topk", 2, "--world", 2, "--ep", 2]
good = pathlib.Path(d1).read_bytes()
trunc = work / "truncated.safetensors"
trunc.write_bytes(good[:len(good) - 10])
refused("a truncated file", ["--dense", trunc, "--activation", "swiglu", *base],
        [str(trunc), "truncated"])
short = work / "short.safetensors"
short.write_bytes(good[:5])
refused("a file shorter than the length field", ["--dense", short, "--activation", "swiglu", *base],
        [str(short), "truncated"])
notjson = work / "notjson.safetensors"
notjson.write_bytes(struct.pack("<Q", 8) + b"{not js}")
refused("a header that is not JSON", ["--dense", notjson, "--activation", "swiglu", *base],
        [str(notjson), "malformed JSON"])
hdr = json.dumps({"model.layers.0.mlp.up_proj.weight": {"dtype": "Q7", "shape": [1],
                                                        "data_offsets": [0, 1]}}).encode()
unknown = work / "unknown-dtype.safetensors"
unknown.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0")
refused("an unknown dtype", ["--dense", unknown, "--activation", "swiglu", *base],
        [str(unknown), "model.layers.0.mlp.up_proj.weight", "unknown dtype"])
d5, _ = make_dense(work / "d5", layers=2, hidden=4, ffn=8, gated=True, dtype="F32", sharded=False,
                   hidden_act="silu", extra_dtype="BF16")
refused("a dtype that differs within a layer", ["--dense", d5, *base],
        ["model.layers.0.mlp.down_proj.weight", "dtype BF16 differs"])
d6 = work / "d6"
d6.mkdir()
(d6 / "model.safetensors").write_bytes(safetensors.serialize({
    "model.layers.0.mlp.up_proj.weight": {"dtype": "int32", "shape": [2, 2], "data": bytes(16)},
    "model.layers.0.mlp.down_proj.weight": {"dtype": "int32", "shape": [2, 2], "data": bytes(16)}}))
refused("integer weights", ["--dense", d6, "--activation", "relu", *base],
        ["model.layers.0.mlp.up_proj.weight", "dtype I32"])
d10 = work / "d10"
d10.mkdir()
(d10 / "model.safetensors").write_bytes(safetensors.serialize({
    "model.layers.0.mlp.up_proj.weight": {"dtype": "float32", "shape": [2, 2], "data": bytes(16)},
    "model.layers.0.mlp.up_proj.bias": {"dtype": "float32", "shape": [3], "data": bytes(12)},
    "model.layers.0.mlp.down_proj.weight": {"dtype": "float32", "shape": [2, 2], "data": bytes(16)}}))
refused("an FFN bias of the wrong shape", ["--dense", d10, "--activation", "relu", *base],
        ["model.layers.0.mlp.up_proj.bias", "shape [3]", "up_proj.bias is [2]"])
refused("G not dividing the dense FFN", ["--dense", d1, "--experts", 3, "--topk", 2, "--granularity",
                                         3, "--world", 1], ["model.layers.0.mlp.up_proj.weight",
                                                            "does not divide the dense FFN"])
refused("ETP not dividing the expert FFN", ["--dense", d1, "--experts", 4, "--topk", 2, "--world",
                                            3, "--etp", 3], ["not divisible by etp = 3"])
refused("E not divisible by EP", ["--dense", d1, "--experts", 3, "--topk", 2, "--world", 2, "--ep",
                                  2], ["not divisible by ep = 2"])
d7, _ = make_dense(work / "d7", layers=2, hidden=4, ffn=8, gated=True, dtype="F32", sharded=True,
                   hidden_act="silu", drop=["model.layers.1.mlp.down_proj.weight"])
refused("a missing tensor (and a stale index entry)", ["--dense", d7, *base],
        ["model.layers.1.mlp.down_proj.weight", "missing"])
refused("a layer index out of range", ["--dense", d1, *base, "--layers", "0,9"],
        ["layer 9 is out of range", "has 4 layers"])
refused("layers that do not split over --pp",
        ["--dense", d1, "--experts", 4, "--topk", 2, "--pp", 3, "--world", 6],
        ["4 layers do not split evenly over pp = 3"])
(work / "d2" / "config.json").write_text(json.dumps({"hidden_act": "gelu_pytorch_tanh"}))
refused("a hidden_act moefold cannot match", ["--dense", d2, "--experts", 4, "--topk", 2,
                                              "--world", 1], ["config.json", "gelu_pytorch_tanh"])
(work / "d2" / "config.json").unlink()
refused("no activation anywhere", ["--dense", d2, "--experts", 4, "--topk", 2, "--world", 1],
        ["give --activation"])
refused("a gated activation for an FFN without gate_proj",
        ["--dense", d2, "--experts", 4, "--topk", 2, "--world", 1, "--activation", "swiglu"],
        ["swiglu is gated", "has no gate projection"])
full = work / "full"
full.mkdir()
(full / "keep.txt").write_text("a user's file")
refused("a non-empty --out", ["--dense", d1, *base], ["is not empty"], out=full)
check("a non-empty --out is left as it was", sorted(p.name for p in full.iterdir()) == ["keep.txt"])
# --- 6. training continues from the upcycled weights ---------------------------------------------
d9, _ = make_dense(work / "d9", layers=2, hidden=16, ffn=32, gated=True, dtype="F32", sharded=False,
                   hidden_act="silu", seed=9)
r = run_tool("--dense", d9, "--out", work / "o9", "--experts", 8, "--topk", 2, "--world", 4,
             "--ep", 2, "--etp", 2)
check("upcycled for training: exit 0", r.returncode == 0, r.stderr)
for dtype, limit in (("fp64", 1e-12), ("fp32", 1e-6)):
    t = subprocess.run([train, *map(str, ["--upcycle-from", work / "o9", "--world", 4, "--ep", 2,
                                          "--etp", 2, "--dtype", dtype, "--steps", 60, "--lr",
                                          0.05, "--aux-loss", 0, "--quiet"])],
                       capture_output=True, text=True, timeout=300)
    lines = t.stdout.splitlines()
    err = [float(x.split("= ")[1]) for x in lines if x.startswith("step 0 output vs the dense FFN")]
    losses = [float(x.split()[3]) for x in lines if x.startswith("step ")
              and not x.startswith("step 0 output")]
    check(f"train_moe_cpu --upcycle-from ({dtype}): the step-0 output equals the dense FFN's "
          f"(relative {err[0] if err else None:.3g} <= {limit:g}) and the loss falls "
          f"({losses[0] if losses else 0:.4g} -> {losses[-1] if losses else 0:.4g})",
          t.returncode == 0 and err and err[0] <= limit and len(losses) >= 2 and
          losses[-1] < 0.5 * losses[0], (t.returncode, t.stdout[-600:], t.stderr[-400:]))
t = subprocess.run([train, *map(str, ["--upcycle-from", work / "o11", "--world", 4, "--ep", 2,
                                      "--etp", 2, "--steps", 1])], capture_output=True, text=True,
                   timeout=60)
check("train_moe_cpu --upcycle-from experts with biases is refused (moefold's experts have none)",
      one_error(t) and "have no biases" in t.stderr, (t.returncode, t.stderr))
t = subprocess.run([train, *map(str, ["--upcycle-from", work / "o9", "--world", 4, "--ep", 4,
                                      "--steps", 1])],
                   capture_output=True, text=True, timeout=60)
check("train_moe_cpu --upcycle-from on another mapping is refused, naming the rule",
      one_error(t) and "must be the upcycled mapping's" in t.stderr, (t.returncode, t.stderr))

# A run that fails after writing a file removes it: a file-size limit lets rank 0's file (one layer)
# be written and makes rank 1's (two layers) fail with EFBIG, SIGXFSZ ignored so write(2) reports it.
args = ["--dense", d1, "--experts", 4, "--topk", 2, "--world", 2, "--pp", 2, "--layers", "1,2,3"]
r = run_tool(*args, "--out", work / "sizes")
sizes = [(work / "sizes" / f"rank-{k:05d}.safetensors").stat().st_size for k in (0, 1)] \
    if r.returncode == 0 else [0, 0]
limit = (sizes[0] + sizes[1]) // 2


def small_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


partial = work / "partial"
r = subprocess.run([tool, *map(str, args), "--out", str(partial)], capture_output=True, text=True,
                   timeout=60, preexec_fn=small_files)
check(f"a run failing at rank 1's file (limit {limit} bytes, files of {sizes}) exits 2 naming "
      "the file, and removes rank 0's file and the folder it made",
      sizes[0] < limit < sizes[1] and one_error(r) and "rank-00001.safetensors" in r.stderr and
      not partial.exists(), (r.returncode, r.stderr, partial.exists() and list(partial.iterdir())))

# The fuzz corpus's invalid files, each refused for its own reason (the fuzz replay accepts any
# one error line; here each must name the rule it breaks).
corpus = pathlib.Path(__file__).resolve().parent.parent / "fuzz" / "corpus" / "safetensors"
reasons = {
    "bias-wrong-shape": "down_proj.bias is [3]", "deep-nesting": "nesting deeper than 64",
    "down-proj-wrong-shape": "needs down_proj [H, F_d]", "duplicate-name": "duplicate member name",
    "gap": "a gap precedes its data", "gated-under-relu": "has a gate projection",
    "int-weights": "dtype I32", "json-array": "does not start with '{'",
    "length-past-end": "truncated (the header length", "length-zero": "header of 0 bytes",
    "metadata-not-strings": "must be a string", "negative-offset": "two non-negative integers",
    "no-down-proj": "down_proj.weight is missing", "no-layers": "no tensor named model.layers",
    "not-json": "malformed JSON", "overlap": "overlaps another tensor",
    "shape-disagrees-with-offsets": "its F32 shape needs 64", "shape-not-array": "shape missing",
    "shorter-than-length": "truncated (5 bytes", "trailing-bytes": "bytes after the last tensor",
    "truncated-data": "truncated: data_offsets", "unknown-dtype": 'unknown dtype "Q7"',
    "unknown-entry-member": 'unknown member "x"', "up-proj-3d": "shape [2, 2, 3]"}
files = sorted(corpus.glob("invalid/*.safetensors"))
wrong = []
for f in files:
    out = work / "corpus-out"
    r = run_tool("--dense", f, "--out", out, "--activation", "relu", "--experts", 2, "--topk", 2,
                 "--world", 1)
    want = reasons.get(f.stem)
    if want is None or not one_error(r) or want not in r.stderr or out.exists():
        wrong.append((f.stem, want, r.stderr[-200:]))
check(f"the {len(files)} invalid corpus files are refused, each naming its own rule",
      len(files) == len(reasons) and not wrong, wrong[:3])

r = run_tool("--help")
check("--help exits 0 and shows the usage", r.returncode == 0 and "usage: moefold-upcycle" in r.stdout)

failed = cases.count(False)
if failed == 0:
    shutil.rmtree(work, ignore_errors=True)
else:
    print(f"(kept {work})")
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

#!/usr/bin/env python3
"""docs/planner-model.schema.json and docs/planner-cluster.schema.json describe the files
moefold-plan reads: every preset (written out by presets_json, which also checks that the tool
reads each back to the same preset) and every example file in tests/plan/data validates, and
files the tool refuses for a reason the schema can state are invalid under the schema too.
Usage: schema_test.py PRESETS_JSON DATA_DIR DOCS_DIR"""
import copy
import json
import pathlib
import subprocess
import sys
import tempfile

try:
    import jsonschema
except ImportError:
    print("python3-jsonschema is not installed (scripts/setup.sh installs it)")
    sys.exit(77)

presets_json, data, docs = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
schemas = {k: json.loads((docs / f"planner-{k}.schema.json").read_text()) for k in ("model", "cluster")}
validators = {}
for k, s in schemas.items():
    cls = jsonschema.validators.validator_for(s)
    cls.check_schema(s)
    validators[k] = cls(s)

cases = []  # (name, ok)


def check(name, ok, detail=""):
    cases.append(ok)
    print(f"[{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail and not ok else ""))


def kind_of(path, doc):
    return "cluster" if "peak_bf16_flops" in doc else "model"


def errors(kind, doc):
    return [e.message for e in validators[kind].iter_errors(doc)]


tmp = pathlib.Path(tempfile.mkdtemp())
r = subprocess.run([presets_json, str(tmp)], capture_output=True, text=True)
check("presets_json writes every preset and reads each back", r.returncode == 0, r.stderr)
files = sorted(tmp.glob("*.json")) + sorted(data.glob("*.json"))
for f in files:
    doc = json.loads(f.read_text())
    kind = "cluster" if f.name.startswith("cluster-") else "model" if f.name.startswith("model-") \
        else kind_of(f, doc)
    e = errors(kind, doc)
    check(f"{f.name} validates against the {kind} schema", not e, "; ".join(e))
check("at least 7 model and 3 cluster presets", len(list(tmp.glob("model-*.json"))) >= 7 and
      len(list(tmp.glob("cluster-*.json"))) >= 3)

# What the schema must refuse, as the tool does.
model = json.loads((tmp / "model-mixtral-8x7b.json").read_text())
cluster = json.loads((tmp / "cluster-h100-sxm.json").read_text())
bad = [
    ("model", "unknown member", dict(model, colour=1)),
    ("model", "layers not an integer", dict(model, layers=2.5)),
    ("model", "layers a string", dict(model, layers="2")),
    ("model", "layers 0", dict(model, layers=0)),
    ("model", "layers above 10000", dict(model, layers=20000)),
    ("model", "32-bit overflow", dict(model, hidden=4294967296)),
    ("model", "dtype fp16", dict(model, dtype="fp16")),
    ("model", "gated 1", dict(model, gated=1)),
    ("model", "not an object", [1]),
    ("cluster", "unknown member", dict(cluster, nvlink=1)),
    ("cluster", "negative memory", dict(cluster, memory_gib=-40)),
    ("cluster", "peak a string", dict(cluster, peak_bf16_flops="fast")),
    ("cluster", "gpus_per_node 0", dict(cluster, gpus_per_node=0)),
    ("cluster", "latency above 1 s", dict(cluster, inter_latency_s=2)),
]
for req in schemas["model"]["required"]:
    m = copy.deepcopy(model)
    del m[req]
    bad.append(("model", f"no {req}", m))
for req in schemas["cluster"]["required"]:
    c = copy.deepcopy(cluster)
    del c[req]
    bad.append(("cluster", f"no {req}", c))
for kind, name, doc in bad:
    check(f"the {kind} schema refuses: {name}", bool(errors(kind, doc)))
# Both schemas name exactly the members the tool knows (its error message lists them).
check("model schema members", len(schemas["model"]["properties"]) == 26)
check("cluster schema members", len(schemas["cluster"]["properties"]) == 11)

failed = cases.count(False)
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

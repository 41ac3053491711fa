#!/usr/bin/env python3
"""Tests of the moefold-mesh command-line tool, run as a user runs it.

Prints a doctest-style summary line so the CI count sees each case."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

tool, data = sys.argv[1], sys.argv[2]
cases = []


def case(fn):
    cases.append(fn)
    return fn


def run(*args):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=120)


def megatron_record(**want):
    """The groups Megatron-Core built for a configuration, from the committed reference data."""
    rec = None
    for line in open(data):
        if line.startswith("config "):
            cfg = dict(kv.split("=", 1) for kv in line.split()[1:])
            rec = {"config": cfg, "groups": {}} if all(cfg.get(k) == str(v) for k, v in want.items()) else None
        elif rec is not None and line.startswith("group "):
            parts = line.split()
            rec["groups"][parts[1]] = [[int(r) for r in g.split(",")] for g in parts[2:]]
        elif rec is not None and line.strip() == "end":
            return rec
    raise AssertionError(f"no reference record for {want}")


@case
def json_equals_megatron_for_the_done_when_configuration():
    r = run("--world", 64, "--tp", 2, "--pp", 4, "--ep", 8, "--etp", 1, "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cfg = out["config"]
    assert (cfg["world_size"], cfg["tp"], cfg["cp"], cfg["pp"], cfg["dp"], cfg["ep"], cfg["etp"],
            cfg["edp"], cfg["order"]) == (64, 2, 1, 4, 8, 8, 1, 2, "tp-cp-ep-dp-pp"), cfg
    ref = megatron_record(world=64, tp=2, cp=1, pp=4, ep=8, etp=1, order="tp-cp-ep-dp-pp", nd=1,
                          hcp="-", offset=0)
    assert list(out["groups"].keys()) == list(ref["groups"].keys())
    assert out["groups"] == ref["groups"]


@case
def json_with_options_equals_megatron():
    r = run("--world", 16, "--cp", 2, "--pp", 2, "--ep", 2, "--etp", 1, "--dist-opt-instances", 2,
            "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref = megatron_record(world=16, tp=1, cp=2, pp=2, ep=2, etp=1, order="tp-cp-ep-dp-pp", nd=2,
                          hcp="-", offset=0)
    assert out["groups"] == ref["groups"]
    r = run("--world", 16, "--cp", 4, "--pp", 2, "--hierarchical-cp", "2,2", "--format", "json")
    out = json.loads(r.stdout)
    assert out["groups"]["hcp_L1"][:2] == [[0, 2], [1, 3]], out["groups"]["hcp_L1"]


@case
def etp_defaults_to_tp():
    out = json.loads(run("--world", 16, "--tp", 4, "--ep", 2, "--format", "json").stdout)
    assert out["config"]["etp"] == 4 and out["config"]["edp"] == 2
    assert out["groups"]["etp"][0] == [0, 1, 2, 3]


@case
def text_names_sizes_and_node_placement():
    r = run("--world", 128, "--tp", 2, "--pp", 8, "--ep", 8, "--etp", 1)
    assert r.returncode == 0, r.stderr
    t = r.stdout
    assert "tp 2 x cp 1 x dp 8 x pp 8" in t and "etp 1 x ep 8 x edp 2 x pp 8" in t, t[:400]
    inside = next(l for l in t.splitlines() if l.startswith("inside a node:"))
    across = next(l for l in t.splitlines() if l.startswith("cross nodes:"))
    assert " ep," in inside + "," and "tp" in inside, inside  # the point of folding
    assert "pp" in across and "edp" in across, across
    r = run("--world", 16, "--ep", 16, "--gpus-per-node", 4)
    across = next(l for l in r.stdout.splitlines() if l.startswith("cross nodes:"))
    assert " ep" in across, across


@case
def svg_is_well_formed_with_one_cell_per_gpu_in_each_mesh():
    for args, world in [((), 128), (("--gpus-per-node", 4, "--rank-offset", 8), 128),
                        (("--gpus-per-node", 3), 128)]:
        r = run("--world", world, "--tp", 2, "--pp", 8, "--ep", 8, "--etp", 1, "--format", "svg", *args)
        assert r.returncode == 0, r.stderr
        root = ET.fromstring(r.stdout)
        ns = "{http://www.w3.org/2000/svg}"
        assert root.tag == ns + "svg"
        for panel in ("attention", "moe"):
            g = next(e for e in root.iter(ns + "g") if panel in e.get("class", "").split())
            cells = [e for e in g.iter(ns + "rect") if e.get("class") == "gpu"]
            ranks = sorted(int(c.get("data-rank")) for c in cells)
            offset = int(dict(zip(args[::2], args[1::2])).get("--rank-offset", 0))
            assert ranks == list(range(offset, offset + world)), (panel, ranks[:5])
            # No two cells overlap.
            spots = {(c.get("x"), c.get("y")) for c in cells}
            assert len(spots) == world
            # A cell's colour is its group's (tp-cp groups on the left, ep groups on the right),
            # as the JSON output lists the groups.
            j = run("--world", world, "--tp", 2, "--pp", 8, "--ep", 8, "--etp", 1, "--format", "json",
                    *args)
            groups = json.loads(j.stdout)["groups"]["tp-cp" if panel == "attention" else "ep"]
            fill = {int(c.get("data-rank")): c.get("fill") for c in cells}
            for i, grp in enumerate(groups):
                assert {fill[r] for r in grp} == {f"hsl({i * 47 % 360},70%,{78 if i % 2 else 68}%)"}, (panel, i)


@case
def bad_input_exits_2_with_one_error_line_and_no_stdout():
    bad = [
        [],
        ["--world"],
        ["--world", "abc"],
        ["--world", "0"],
        ["--world", "-8"],
        ["--world", "99999999999"],
        ["--world", "8", "--tp", "3"],
        ["--world", "12", "--tp", "4", "--pp", "2"],
        ["--world", "12", "--pp", "2", "--ep", "4"],
        ["--world", "64", "--tp", "2", "--pp", "4", "--ep", "8", "--etp", "1", "--order", "tp-cp-ep-pp-dp"],
        ["--world", "16", "--cp", "2", "--order", "tp-ep-dp-pp"],
        ["--world", "16", "--order", "tp-cp-xx-dp-pp"],
        ["--world", "16", "--order", "tp-tp-cp-dp-pp"],
        ["--world", "16", "--order", ""],
        ["--world", "16", "--cp", "2", "--dist-opt-instances", "3"],
        ["--world", "16", "--cp", "4", "--hierarchical-cp", "2,3"],
        ["--world", "16", "--hierarchical-cp", "1,x"],
        ["--world", "16", "--rank-offset", "-1"],
        ["--world", "16", "--rank-offset", "2147483647"],
        ["--world", "16", "--gpus-per-node", "0"],
        ["--world", "16", "--format", "yaml"],
        ["--world", "16", "--bogus", "1"],
        ["--world", "16", "--tp", "2", "--tp", "2"],
        ["--world", "2147483647", "--tp", "2147483647", "--pp", "2"],
    ]
    for args in bad:
        r = run(*args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert r.stdout == "", (args, r.stdout[:200])
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, r.stderr)


@case
def errors_name_the_rule():
    expect = {
        ("--world", "12", "--tp", "4", "--pp", "2"): "rule 2",
        ("--world", "12", "--pp", "2", "--ep", "4"): "rule 5",
        ("--world", "64", "--tp", "2", "--pp", "4", "--ep", "8", "--etp", "1", "--order", "tp-cp-ep-pp-dp"): "rule 7",
        ("--world", "16", "--cp", "2", "--order", "tp-ep-dp-pp"): "rule 4",
        ("--world", "16", "--cp", "2", "--dist-opt-instances", "3"): "rule 9",
        ("--world", "16", "--cp", "4", "--hierarchical-cp", "2,3"): "rule 11",
        ("--world", "16", "--ep", "2", "--dist-opt-instances", "16"): "rule 13",
    }
    for args, rule in expect.items():
        r = run(*args)
        assert r.returncode == 2 and rule in r.stderr, (args, r.stderr)


@case
def help_goes_to_stdout():
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: moefold-mesh"), r.stdout


failed = 0
for fn in cases:
    try:
        fn()
        print(f"[ok]   {fn.__name__}")
    except Exception as e:  # noqa: BLE001 - report every failure, keep going
        failed += 1
        print(f"[FAIL] {fn.__name__}: {e!r}"[:3000])
print(f"[doctest] test cases: {len(cases)} | {len(cases) - failed} passed | {failed} failed | 0 skipped")
sys.exit(1 if failed else 0)

#!/usr/bin/env python3
"""The library's layers include only layers below them (docs/architecture.md):

    core <- mesh <- kernels <- exec <- comm <- {routing, dispatch, experts} <- layer <- {plan, upcycle}

Reads every header of include/moefold/ (cuda/, mpi/ and torch/ sub-folders belong to their layer) and of
the top-level kernels/, resolves each #include of a moefold header (<moefold/...> or relative) to
its layer, and fails on an include of a higher layer, on a cycle between the three peers of the
same level, and on an include that names no header of the tree (a stale path). plan and upcycle
sit above what they use; the umbrella moefold.hpp above everything; version.hpp beside core.

Usage: include_order_check.py REPO_ROOT
       include_order_check.py --self-test   (the check must catch a planted upward include)"""
import pathlib
import posixpath
import re
import sys
import tempfile

RANK = {"core": 0, "mesh": 1, "kernels": 2, "exec": 3, "comm": 4,
        "routing": 5, "dispatch": 5, "experts": 5, "layer": 6, "plan": 7, "upcycle": 7}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def layer_of(rel):
    """Layer of a header given as a path relative to include/ ('moefold/exec/x.hpp')."""
    parts = rel.parts
    if len(parts) < 2 or parts[0] != "moefold":
        return None
    if len(parts) == 2:
        return {"version.hpp": "core", "moefold.hpp": "umbrella"}.get(parts[1])
    return parts[1] if parts[1] in RANK else None


def rank(layer):
    return 8 if layer == "umbrella" else RANK[layer]


def headers(root):
    """(path relative to include/, file) of every library header, kernels/ as moefold/kernels/."""
    inc = root / "include"
    for f in sorted(inc.rglob("*")):  # rglob does not follow the link include/moefold/kernels
        if f.suffix in (".hpp", ".cuh") and f.is_file() and not f.is_symlink():
            yield f.relative_to(inc), f
    for f in sorted((root / "kernels").rglob("*")):
        if f.suffix in (".hpp", ".cuh") and f.is_file():
            yield pathlib.Path("moefold/kernels") / f.relative_to(root / "kernels"), f


def check(root):
    known = {rel.as_posix(): f for rel, f in headers(root)}
    problems, edges, count = [], set(), 0
    for rel_s, f in known.items():
        rel = pathlib.Path(rel_s)
        me = layer_of(rel)
        if me is None:
            problems.append(f"{rel_s}: in no layer (a folder the layer list does not name)")
            continue
        for kind, name in INCLUDE.findall(f.read_text()):
            if kind == "<" and not name.startswith("moefold/"):
                continue  # the standard library, CUDA, NCCL, MPI, ...
            t = name if kind == "<" else posixpath.normpath((rel.parent / name).as_posix())
            if t not in known:
                if kind == '"' and not t.startswith("moefold/"):
                    problems.append(f"{rel_s}: #include \"{name}\" leaves the include tree")
                else:
                    problems.append(f"{rel_s}: #include {name} names no header of the tree")
                continue
            count += 1
            them = layer_of(pathlib.Path(t))
            if rank(them) > rank(me):
                problems.append(f"{rel_s} ({me}) includes {t} ({them}), a higher layer")
            elif them != me and rank(them) == rank(me):
                edges.add((me, them))
    # The peers of one level may use each other one way only.
    for a, b in sorted(edges):
        if (b, a) in edges and a < b:
            problems.append(f"{a} and {b} include each other (the peers of one level form no cycle)")
    return problems, count


def self_test():
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "include/moefold/core").mkdir(parents=True)
        (root / "include/moefold/exec").mkdir(parents=True)
        (root / "kernels").mkdir()
        (root / "include/moefold/exec/ctx.hpp").write_text('#include "../core/base.hpp"\n')
        (root / "include/moefold/core/base.hpp").write_text('#pragma once\n')
        (root / "kernels/k.hpp").write_text('#include <moefold/core/base.hpp>\n')
        ok, _ = check(root)
        (root / "include/moefold/core/bad.hpp").write_text('#include "../exec/ctx.hpp"\n')
        (root / "kernels/bad.hpp").write_text('#include <moefold/exec/ctx.hpp>\n')
        bad, _ = check(root)
    if ok or len(bad) != 2:
        sys.exit(f"self-test failed: clean tree gave {ok}, planted tree gave {bad}")
    print("self-test: a clean tree passes, both planted upward includes are reported")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        sys.exit(0)
    problems, count = check(pathlib.Path(sys.argv[1]))
    for p in problems:
        print("FAIL:", p)
    print(f"{count} includes of moefold headers checked, {len(problems)} breaking the layer order")
    sys.exit(1 if problems or count == 0 else 0)

#!/usr/bin/env python3
"""moefold_torch.new_groups and groups_from over gloo, 4 processes.

- new_groups(tp=2, ep=2), (ep=4) and (ep=2, etp=2): each rank's group of every kind has the
  global ranks of Megatron-Core's layout, written out here by hand for world 4 (order
  tp-cp-ep-dp-pp), and the ProcessGroup is that group (dist.get_process_group_ranks; a collective
  on it gathers exactly those ranks; a kind of size 1 has no group);
- groups_from with the trainer's own groups of that layout is accepted, and the groups it adds
  (tp-cp, tp-dp-cp, dp-cp, tp-ep) are Megatron's; with an EP group of another layout it raises
  ValueError naming the kind and both rank lists, on every rank, and no rank hangs; with one
  rank's groups wrong (its sizes), every rank raises its message at once;
- bad sizes: a size that does not divide the world raises ValueError naming the rule.
Exit 77 without torch; a doctest-style summary line."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

WORLD = 4

# Megatron-Core's groups for world 4, order tp-cp-ep-dp-pp (RankGenerator: the attention mesh
# tp-cp-dp-pp, the expert mesh etp-ep-edp-pp; strides in that order).
LAYOUTS = {
    "tp2-ep2": ({"tp": 2, "ep": 2, "etp": 1}, {
        "tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
        "dp-cp": [[0, 2], [1, 3]], "tp-cp": [[0, 1], [2, 3]], "tp-dp-cp": [[0, 1, 2, 3]],
        "ep": [[0, 1], [2, 3]], "etp": [[0], [1], [2], [3]], "tp-ep": [[0, 1], [2, 3]],
        "edp": [[0, 2], [1, 3]]}),
    "ep4": ({"tp": 1, "ep": 4, "etp": 1}, {
        "tp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]], "dp-cp": [[0, 1, 2, 3]],
        "tp-cp": [[0], [1], [2], [3]], "tp-dp-cp": [[0, 1, 2, 3]], "ep": [[0, 1, 2, 3]],
        "etp": [[0], [1], [2], [3]], "tp-ep": [[0, 1, 2, 3]], "edp": [[0], [1], [2], [3]]}),
    "ep2-etp2": ({"tp": 1, "ep": 2, "etp": 2}, {
        "tp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]], "dp-cp": [[0, 1, 2, 3]],
        "tp-dp-cp": [[0, 1, 2, 3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]],
        "tp-ep": [[0, 1, 2, 3]], "edp": [[0], [1], [2], [3]]}),
}


def mine(groups, rank):
    return next(g for g in groups if rank in g)


def scenario_new(rank, world, out, name):
    import torch
    import torch.distributed as dist
    import moefold_torch
    sizes, want = LAYOUTS[name]
    g = moefold_torch.new_groups(**sizes)
    bad = []
    for kind, groups in want.items():
        expect = mine(groups, rank)
        if g.ranks[kind] != expect:
            bad.append([kind, g.ranks[kind], expect])
        pg = g.group(kind)
        if len(expect) == 1:
            if pg is not None:
                bad.append([kind, "a group of one rank has a ProcessGroup"])
            continue
        if dist.get_process_group_ranks(pg) != expect:
            bad.append([kind, dist.get_process_group_ranks(pg), expect])
        # A collective on it reaches exactly its ranks, in order.
        comm = moefold_torch.Communicator(pg)
        got = torch.zeros(len(expect), dtype=torch.int64)
        comm.all_gather_v(torch.tensor([rank], dtype=torch.int64), got, [1] * len(expect))
        if got.tolist() != expect:
            bad.append([kind, "all_gather", got.tolist(), expect])
    out["bad"] = bad


def scenario_from(rank, world, out, wrong, none_on=None):
    import torch.distributed as dist
    import moefold_torch
    # The trainer's own groups of the tp2-ep2 layout (every rank creates every group, in order).
    _, want = LAYOUTS["tp2-ep2"]
    own = {}
    ep_layout = [[0, 2], [1, 3]] if wrong else want["ep"]  # wrong: EP across the TP pairs
    for kind, groups in (("tp", want["tp"]), ("dp", want["dp"]), ("ep", ep_layout),
                         ("edp", want["edp"])):
        for grp in groups:
            pg = dist.new_group(grp)
            if rank in grp:
                own[kind] = pg
    try:
        if rank == none_on:  # this rank alone passes no EP group: its sizes break the rule
            own["ep"] = None
        g = moefold_torch.groups_from(tp=own["tp"], dp=own["dp"], ep=own["ep"], edp=own["edp"])
        out["raised"] = None
        out["added"] = {k: g.ranks[k] for k in ("tp-cp", "tp-dp-cp", "dp-cp", "tp-ep")}
        out["added_pg"] = {k: dist.get_process_group_ranks(g.group(k))
                           for k in ("tp-cp", "tp-dp-cp", "dp-cp", "tp-ep")}
    except ValueError as e:
        out["raised"] = str(e)


def scenario_bad_sizes(rank, world, out):
    import moefold_torch
    try:
        moefold_torch.new_groups(tp=3)
        out["raised"] = None
    except ValueError as e:
        out["raised"] = str(e)


def worker(scenario, rank, world, port):
    ranks.join(rank, world, port, 30)
    out = {"rank": rank}
    if scenario.startswith("new:"):
        scenario_new(rank, world, out, scenario[4:])
    elif scenario == "from":
        scenario_from(rank, world, out, wrong=False)
    elif scenario == "from-wrong":
        scenario_from(rank, world, out, wrong=True)
    elif scenario == "from-partial":
        scenario_from(rank, world, out, wrong=False, none_on=3)
    else:
        scenario_bad_sizes(rank, world, out)
    # Every rank leaves together: a rank that exits while a peer still completes the handshake of
    # a group they share resets that peer's connection (gloo connects lazily, pair by pair).
    import torch.distributed as dist
    dist.barrier()
    ranks.report(out)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ranks.skip_without_torch()
    cases = ranks.Cases()
    me = os.path.abspath(__file__)
    for name in LAYOUTS:
        res, hung = ranks.launch(me, "new:" + name, WORLD, 120)
        ok = not hung and all(r["rc"] == 0 and r["result"] is not None for r in res)
        cases.check(f"new_groups {name}: every rank finished", ok, [r["stderr"] for r in res][:1])
        if ok:
            bad = [(r["result"]["rank"], b) for r in res for b in r["result"]["bad"]]
            cases.check(f"new_groups {name}: Megatron's ranks, groups and collectives", not bad,
                        bad[:6])
    _, want = LAYOUTS["tp2-ep2"]
    res, hung = ranks.launch(me, "from", WORLD, 120)
    rs = [r["result"] for r in res]
    cases.check("groups_from: accepted on every rank", not hung and all(
        r is not None and r["raised"] is None for r in rs),
        [(r["rc"], r["result"], r["stderr"][-300:]) for r in res])
    if all(r is not None and r["raised"] is None for r in rs):
        cases.check("groups_from: the added groups are Megatron's", all(
            r["added"][k] == mine(want[k], r["rank"]) == r["added_pg"][k]
            for r in rs for k in r["added"]), rs)
    res, hung = ranks.launch(me, "from-wrong", WORLD, 120)
    rs = [r["result"] for r in res]
    cases.check("groups_from with another layout's EP group: ValueError naming it on every rank",
                not hung and all(r is not None and r["raised"] and "ep group" in r["raised"]
                                 for r in rs),
                [(r["rc"], r["result"], r["stderr"][-300:]) for r in res])
    # Only rank 3's groups are wrong: the other ranks pass their own checks but raise too (the
    # verdicts are exchanged before any group is made), rather than waiting in dist.new_group.
    res, hung = ranks.launch(me, "from-partial", WORLD, 60)
    rs = [r["result"] for r in res]
    cases.check("groups_from wrong on one rank only: ValueError on every rank, none waits",
                not hung and all(r is not None and r["raised"] and "ep 1" in r["raised"]
                                 for r in rs),
                [(r["rc"], r["result"], r["stderr"][-300:]) for r in res])
    res, hung = ranks.launch(me, "bad-sizes", WORLD, 60)
    rs = [r["result"] for r in res]
    cases.check("new_groups(tp=3) on 4 ranks: ValueError naming the rule",
                not hung and all(r is not None and r["raised"] and "divis" in r["raised"].lower()
                                 for r in rs), [r and r["raised"] for r in rs])
    return cases.finish()


if __name__ == "__main__":
    sys.exit(main())

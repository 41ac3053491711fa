#!/usr/bin/env python3
"""moefold_torch.MoELayer over 4 gloo processes.

- EP 4; TP 2 x EP 2; EP 2 x ETP 2; dropless and sub-sequence dropping; both dispatchers: each
  rank's output, input gradient and (after reduce_gradients) every parameter gradient equal the
  single-process reference of reference.py over the whole world's tokens (fp32, 1e-5);
- the same mapping on moefold's C++ thread world in one process (moefold_torch.run_thread_world,
  the same module code per rank thread) gives every rank's output and gradients bitwise;
- with the aux and z coefficients 0, dropless out and dx are bitwise equal across EP 4, TP 2 x
  EP 2 and one process;
- DDP over the group the non-MoE parameters are replicated on, plus reduce_gradients for the
  layer's, equals the reference's gradients;
- ranks that disagree (another num_experts), a rank that exits, a rank that stalls: a Python
  exception naming the rule on every surviving rank, nothing hangs, no process aborts.
Exit 77 without torch; a doctest-style summary line."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

WORLD = 4
E, H, F, K, N = 8, 6, 4, 2, 10
# Attention TP 2 folded onto experts EP 2 with ETP 1 (etp defaults to tp otherwise); the shared
# expert runs with this mapping (TP-sharded, its sequence-parallel MLP over the TP group).
MAPPINGS = {"ep4": {"ep": 4}, "tp2-ep2": {"tp": 2, "ep": 2, "etp": 1},
            "ep2-etp2": {"ep": 2, "etp": 2}}
FS = 4  # the shared expert's FFN size (tp2-ep2)


def tokens(rank, dtype):
    import torch
    return torch.randn(N, H, generator=torch.Generator().manual_seed(100 + rank),
                       dtype=torch.float64).to(dtype)


def dout_of(rank, dtype):
    import torch
    return torch.randn(N, H, generator=torch.Generator().manual_seed(200 + rank),
                       dtype=torch.float64).to(dtype)


def weights(shared=False):
    import torch
    g = torch.Generator().manual_seed(7)
    w = {"router": torch.randn(E, H, generator=g, dtype=torch.float64) * 0.5,
         "fc1": torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64) * 0.5,
         "fc2": torch.randn(E, H, F, generator=g, dtype=torch.float64) * 0.5}
    if shared:
        w.update(shared_fc1=torch.randn(2 * FS, H, generator=g, dtype=torch.float64) * 0.5,
                 shared_fc2=torch.randn(H, FS, generator=g, dtype=torch.float64) * 0.5,
                 shared_gate=torch.randn(1, H, generator=g, dtype=torch.float64) * 0.5)
    return w


def layer_kwargs(dispatcher, drop, losses=True, shared=False):
    kw = {"token_dispatcher_type": dispatcher}
    if shared:
        kw.update(shared_expert_intermediate_size=FS, shared_expert_gate=True)
    if drop:
        kw["expert_capacity_factor"] = 1.0
    if losses:
        kw.update(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    return kw


def run_rank(groups, rank, dispatcher, drop, losses=True, reduce=True, shared=False):
    """This rank's layer on its tokens: (out, dx, {param name: reduced grad}, losses)."""
    import torch
    import moefold_torch
    layer = moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=E,
                                   router_topk=K, groups=groups, max_tokens=N,
                                   **layer_kwargs(dispatcher, drop, losses, shared))
    w = weights(shared)
    layer.load_global(**{n: t.float() for n, t in w.items()})
    x = tokens(rank, torch.float32).requires_grad_()
    out, ls = layer(x)
    loss = (out * dout_of(rank, torch.float32)).sum() + sum(ls.values(), torch.zeros(()))
    loss.backward()
    if reduce:
        moefold_torch.reduce_gradients(layer, groups)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad.clone(), grads, {n: v.item() for n, v in ls.items()}


def reference_world(tp_cp, drop, losses=True, shared=False):
    """The reference over every rank's tokens: per rank (out, dx), the full weights' grads."""
    import torch
    from reference import moe_world
    w = {n: t.clone().requires_grad_() for n, t in weights(shared).items()}
    xs = [tokens(r, torch.float64).requires_grad_() for r in range(WORLD)]
    opts = {"capacity_factor": 1.0 if drop else None}
    if losses:
        opts.update(aux=0.01, z=0.001)
    if shared:
        opts["shared"] = (w["shared_fc1"], w["shared_fc2"], w["shared_gate"])
    outs, parts = moe_world(xs, w["router"], w["fc1"], w["fc2"], k=K, tp_cp_groups=tp_cp, **opts)
    loss = sum((o * dout_of(r, torch.float64)).sum() for r, o in enumerate(outs))
    loss = loss + sum(sum(p.values(), torch.zeros((), dtype=torch.float64)) for p in parts)
    loss.backward()
    return [(o.detach(), x.grad) for o, x in zip(outs, xs)], {n: t.grad for n, t in w.items()}


def shards(groups, full):
    """This rank's shards of the full gradients (the layer's layouts)."""
    from reference import fc1_shard, fc2_shard
    L = E // groups.ep
    ep_rank = groups.ranks["ep"].index(groups.rank)
    etp_rank = groups.ranks["etp"].index(groups.rank)
    import torch
    experts = range(ep_rank * L, (ep_rank + 1) * L)
    out = {"router.weight": full["router"],
           "experts.fc1": torch.stack([fc1_shard(full["fc1"][e], F, groups.etp, etp_rank, True)
                                       for e in experts]),
           "experts.fc2": torch.stack([fc2_shard(full["fc2"][e], F, groups.etp, etp_rank)
                                       for e in experts])}
    if "shared_fc1" in full:
        tp_rank = groups.ranks["tp"].index(groups.rank)
        out.update({"shared_expert.fc1": fc1_shard(full["shared_fc1"], FS, groups.tp, tp_rank,
                                                   True),
                    "shared_expert.fc2": fc2_shard(full["shared_fc2"], FS, groups.tp, tp_rank),
                    "shared_expert.gate": full["shared_gate"]})
    return out


def tensors_key(t):
    return t.double().flatten().tolist()


COMBOS = [(d, drop) for d in ("alltoall", "allgather") for drop in ("dropless", "drop")]


def scenario_mapping(rank, world, out, name):
    """Every dispatcher and drop combination of one mapping (one launch: torch imports once)."""
    import torch
    import moefold_torch
    from reference import rel_err
    torch.set_num_threads(1)
    groups = moefold_torch.new_groups(**MAPPINGS[name])
    tp_cp = [[0, 1], [2, 3]] if groups.tp > 1 else None
    shared = groups.tp > 1
    for dispatcher, drop in COMBOS:
        label = f"{dispatcher}, {drop}"
        o, dx, grads, ls = run_rank(groups, rank, dispatcher, drop == "drop", shared=shared)
        per_rank, full = reference_world(tp_cp, drop == "drop", shared=shared)
        ro, rdx = per_rank[rank]
        errs = {"out": rel_err(o, ro), "dx": rel_err(dx, rdx)}
        for n, want in shards(groups, full).items():
            errs["d" + n] = rel_err(grads[n], want)
        out[label] = {"errs": errs}
        # The same mapping on the thread world in this process: each rank thread runs the module.
        results = {}

        def rank_fn(world_comm):
            g = moefold_torch.thread_groups(world_comm, **MAPPINGS[name])
            results[world_comm.rank] = run_rank(g, world_comm.rank, dispatcher, drop == "drop",
                                                shared=shared)

        fails = moefold_torch.run_thread_world(WORLD, rank_fn)
        if any(fails):
            out[label]["thread_errors"] = fails
        else:
            to, tdx, tg, tls = results[rank]
            out[label]["thread_bitwise"] = bool(
                torch.equal(o, to) and torch.equal(dx, tdx) and
                all(torch.equal(grads[n], tg[n]) for n in grads) and ls == tls)


def scenario_across(rank, world, out):
    """Dropless with the aux and z coefficients 0: out and dx of EP 4, TP 2 x EP 2 and of one
    process (this rank's tokens alone through a world of one) are bitwise equal."""
    import torch
    import moefold_torch
    torch.set_num_threads(1)
    res = []
    for name in ("ep4", "tp2-ep2"):
        g = moefold_torch.new_groups(**MAPPINGS[name])
        o, dx, _, _ = run_rank(g, rank, "alltoall", False, losses=False, reduce=False)
        res.append((o, dx))
    single = {}

    def one(world_comm):
        g = moefold_torch.thread_groups(world_comm)
        single["r"] = run_rank(g, rank, "alltoall", False, losses=False, reduce=False)

    fails = moefold_torch.run_thread_world(1, one)
    o1, dx1 = single["r"][0], single["r"][1]
    out["bitwise"] = not any(fails) and all(torch.equal(o, o1) and torch.equal(dx, dx1)
                                            for o, dx in res)


def scenario_ddp(rank, world, out):
    """A block: x -> Linear (DDP over tp-dp-cp, replicated) -> MoE (reduce_gradients). Gradients
    equal the reference's, the Linear's averaged by DDP as DDP does."""
    import torch
    import moefold_torch
    from reference import moe_world, rel_err
    torch.set_num_threads(1)
    groups = moefold_torch.new_groups(ep=4)
    lin = torch.nn.Linear(H, H, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(H) * 0.5 + 0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(lin, process_group=groups.group("tp-dp-cp"))
    layer = moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=E,
                                   router_topk=K, groups=groups, max_tokens=N)
    w = weights()
    layer.load_global(**{n: t.float() for n, t in w.items()})
    h = ddp(tokens(rank, torch.float32))
    o, _ = layer(h)
    (o * dout_of(rank, torch.float32)).sum().backward()
    moefold_torch.reduce_gradients(layer, groups)
    # Reference: the same block over the world's tokens; DDP averages over the 4 replicas.
    L = (torch.eye(H, dtype=torch.float64) * 0.5 + 0.1).requires_grad_()
    wr = {n: t.clone().requires_grad_() for n, t in w.items()}
    hs = [tokens(r, torch.float64) @ L.t() for r in range(WORLD)]
    outs, _ = moe_world(hs, wr["router"], wr["fc1"], wr["fc2"], k=K)
    sum((oo * dout_of(r, torch.float64)).sum() for r, oo in enumerate(outs)).backward()
    errs = {"linear": rel_err(lin.weight.grad, L.grad / WORLD)}
    for n, want in shards(groups, {n: t.grad for n, t in wr.items()}).items():
        errs[n] = rel_err(dict(layer.named_parameters())[n].grad, want)
    out["errs"] = errs


def scenario_fault(rank, world, out, kind):
    import time
    import torch
    import moefold_torch
    torch.set_num_threads(1)
    groups = moefold_torch.new_groups(ep=4)
    experts = E * 2 if (kind == "mismatch" and rank == 3) else E
    try:
        layer = moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=experts,
                                       router_topk=K, groups=groups, max_tokens=N)
        if kind == "exit" and rank == 3:
            os._exit(3)
        if kind == "stall" and rank == 3:
            time.sleep(30)
        o, _ = layer(tokens(rank, torch.float32))
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"


WORKERS = {"mapping": scenario_mapping, "across": scenario_across, "ddp": scenario_ddp,
           "fault": scenario_fault}


def worker(scenario, rank, world, port, *extra):
    timeout = 6 if scenario == "fault" else 60
    ranks.join(rank, world, port, timeout)
    out = {}
    try:
        WORKERS[scenario](rank, world, out, *extra)
    except Exception as e:  # noqa: BLE001
        import traceback
        out["exception"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    ranks.report(out)


def main():
    ranks.skip_without_torch()
    cases = ranks.Cases()
    me = os.path.abspath(__file__)
    for name in MAPPINGS:
        res, hung = ranks.launch(me, "mapping", WORLD, 300, (name,))
        for dispatcher, drop in COMBOS:
            label = f"{dispatcher}, {drop}"
            got = [(r["result"] or {}).get(label) for r in res]
            ok = not hung and all(g and max(g["errs"].values()) <= 1e-5 for g in got)
            cases.check(f"{name}, {label}: every rank equals the reference", ok,
                        [g or r["result"] or r["stderr"] for g, r in zip(got, res)])
            ok = not hung and all(g and g.get("thread_bitwise") for g in got)
            cases.check(f"{name}, {label}: the thread world in one process gives the same bits",
                        ok, got)
    res, hung = ranks.launch(me, "across", WORLD, 240)
    cases.check("dropless, losses off: out and dx bitwise equal across EP 4, TP 2 x EP 2, one "
                "process", not hung and all(r["result"] and r["result"].get("bitwise")
                                            for r in res), [r["result"] or r["stderr"]
                                                            for r in res])
    res, hung = ranks.launch(me, "ddp", WORLD, 240)
    cases.check("DDP for the block's Linear + reduce_gradients for the layer equal the reference",
                not hung and all(r["result"] and "errs" in r["result"] and
                                 max(r["result"]["errs"].values()) <= 1e-5 for r in res),
                [r["result"] or r["stderr"] for r in res])
    # A stalled rank: the survivors time out (or, once the first of them has given up and left,
    # see it gone); at least one names the timeout.
    for kind, words in (("mismatch", ["count mismatch"]), ("exit", ["a peer died"]),
                        ("stall", ["timeout", "a peer died"])):
        res, hung = ranks.launch(me, "fault", WORLD, 120, (kind,))
        survivors = res[:3] if kind in ("exit", "stall") else res
        errors = [(r["result"] or {}).get("error") or "" for r in survivors]
        ok = not hung and all(any(w in e for w in words) for e in errors) and \
            any(words[0] in e for e in errors)
        cases.check(f"fault ({kind}): every surviving rank raises, none hangs or aborts", ok,
                    [r["result"] or (r["rc"], r["stderr"]) for r in res])
    return cases.finish()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(a[0], int(a[1]), int(a[2]), int(a[3]), *a[4:])
    else:
        sys.exit(main())

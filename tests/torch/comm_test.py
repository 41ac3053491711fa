#!/usr/bin/env python3
"""moefold_torch.Communicator (moefold's torch_communicator) over gloo, 4 processes.

Each case starts 4 plain processes (not torch's spawn, which kills the survivors when one exits)
that join one gloo group and run a scenario; the parent checks every rank's verdict and that no
rank hung (each case has a wall-clock limit).
- collectives: all_to_all_v, all_gather_v (unequal parts), reduce_scatter_v and all_reduce (sum
  and max), broadcast, barrier, in float32, float64, bfloat16, float16 and the integer types,
  against references each rank computes from every rank's inputs (regenerated from the seeds):
  moves exact, sums bit for bit a sum in rank order (fp32 accumulation for 16-bit floats), which
  gloo's own sums are not; spare rows untouched.
- mismatch: a rank expecting more rows than its peer sends: every rank raises MoefoldError
  (comm_mismatch) with the same message before any data moves; the next call is comm_broken.
- dead peer: a rank that exits before a collective: every other rank raises MoefoldError at once
  (well before the group's timeout), no process aborts inside gloo.
- stalled peer: a rank that sleeps past the group's timeout: the others raise MoefoldError
  (comm_timeout) at the timeout.
- bad input: a tensor off the CPU (NotImplementedError), a dtype that is not reduced, mixed
  dtypes, a non-contiguous tensor, send and recv of all_to_all_v overlapping (ValueError),
  fail() (the peers' MoefoldError names the rank).
Prints a doctest-style summary line (counted by scripts/count_tests.py); exit 77 without torch.

Usage: comm_test.py            (the parent)
       comm_test.py --worker SCENARIO RANK WORLD PORT   (one rank; started by the parent)"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

WORLD = 4
TIMEOUT_S = 4  # the group's timeout (the stall case waits for it)


# --- the ranks ------------------------------------------------------------------------------

def rank_order(parts, op, dtype):
    """The reduction of `parts` (one tensor per rank) in rank order, accumulated in fp32 for
    16-bit floats: moefold's definition."""
    import torch
    acc_type = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    acc = parts[0].to(acc_type)
    for p in parts[1:]:
        x = p.to(acc_type)
        acc = acc + x if op == "sum" else torch.maximum(acc, x)
    return acc.to(dtype)


def same_bits(a, b):
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def inputs(seed, rank, n, dtype, width=1):
    import torch
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        v = torch.randn(n, width, generator=g, dtype=torch.float64) * (1 + rank * 37.5)
    else:
        v = torch.randint(-1000, 1000, (n, width), generator=g, dtype=torch.int64)
    v = v.to(dtype)
    return v if width > 1 else v.reshape(n)


def counts_matrix(seed, world):
    import torch
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 6, (world, world), generator=g)
    c[1, :] = 0  # rank 1 sends nothing; rank 2 receives nothing
    c[:, 2] = 0
    return c.tolist()


def scenario_collectives(comm, rank, world, out):
    import torch
    checks = []
    moved = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
    reduced = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    for i, dt in enumerate(moved):
        # all_to_all_v in rows of 3: rank r's block for peer p is inputs(seed r, p)[: C[r][p]].
        C = counts_matrix(10 + i, world)
        send = torch.cat([inputs(100 + i, rank * world + p, C[rank][p], dt, 3)
                          for p in range(world)])
        want = torch.cat([inputs(100 + i, q * world + rank, C[q][rank], dt, 3)
                          for q in range(world)])
        recv = torch.full((want.shape[0] + 1, 3), 7, dtype=dt)  # one spare row
        comm.all_to_all_v(send, C[rank], recv, [C[q][rank] for q in range(world)])
        checks.append(("all_to_all_v " + str(dt), same_bits(recv[:-1], want)
                       and same_bits(recv[-1:], torch.full((1, 3), 7, dtype=dt))))
        # all_gather_v with unequal parts (one empty): padded underneath.
        counts = [3, 0, 5, 1]
        parts = [inputs(200 + i, q, counts[q], dt) for q in range(world)]
        recv = torch.zeros(sum(counts), dtype=dt)
        comm.all_gather_v(parts[rank], recv, counts)
        checks.append(("all_gather_v " + str(dt), same_bits(recv, torch.cat(parts))))
        # broadcast from the last rank.
        buf = inputs(300 + i, rank, 6, dt)
        comm.broadcast(buf, world - 1)
        checks.append(("broadcast " + str(dt), same_bits(buf, inputs(300 + i, world - 1, 6, dt))))
    for i, dt in enumerate(reduced):
        for op in ("sum", "max"):
            counts = [2, 0, 7, 3]
            sends = [inputs(400 + i, q, sum(counts), dt) for q in range(world)]
            recv = torch.zeros(counts[rank], dtype=dt)
            comm.reduce_scatter_v(sends[rank], counts, recv, op)
            lo = sum(counts[:rank])
            want = rank_order([s[lo:lo + counts[rank]] for s in sends], op, dt)
            checks.append((f"reduce_scatter_v {op} {dt}", same_bits(recv, want)))
            for n in (0, 1, world + 1, 37):
                bufs = [inputs(500 + i + n, q, n, dt) for q in range(world)]
                buf = bufs[rank].clone()
                comm.all_reduce(buf, op)
                checks.append((f"all_reduce {op} {dt} n={n}", same_bits(buf, rank_order(bufs, op, dt))))
    comm.barrier()
    out["checks"] = [[name, bool(ok)] for name, ok in checks]


def scenario_mismatch(comm, rank, world, out):
    import torch
    import moefold_torch
    sc, rc = [1] * world, [1] * world
    if rank == 1:
        sc[2] = 2
    if rank == 2:
        rc[1] = 3
    send = torch.ones(sum(sc), dtype=torch.float32)
    recv = torch.full((sum(rc),), -1.0)
    try:
        comm.all_to_all_v(send, sc, recv, rc)
        out["raised"] = None
    except moefold_torch.MoefoldError as e:
        out["raised"], out["code"], out["message"] = "MoefoldError", e.code, str(e)
    out["untouched"] = bool(torch.all(recv == -1.0))
    try:
        comm.barrier()
        out["later"] = None
    except moefold_torch.MoefoldError as e:
        out["later"] = e.code


def scenario_dead(comm, rank, world, out):
    import torch
    import moefold_torch
    comm.barrier()
    if rank == world - 1:
        sys.stdout.flush()
        os._exit(3)  # dies before the next collective
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16), "sum")
        out["raised"] = None
    except moefold_torch.MoefoldError as e:
        out["raised"], out["code"], out["message"] = "MoefoldError", e.code, str(e)
    out["seconds"] = time.monotonic() - t0


def scenario_stall(comm, rank, world, out):
    import torch
    import moefold_torch
    comm.barrier()
    if rank == world - 1:
        time.sleep(TIMEOUT_S * 2.5)  # past the group's timeout, then leaves
        out["slept"] = True
        return
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16), "sum")
        out["raised"] = None
    except moefold_torch.MoefoldError as e:
        out["raised"], out["code"], out["message"] = "MoefoldError", e.code, str(e)
    out["seconds"] = time.monotonic() - t0


def scenario_bad_input(comm, rank, world, out):
    import torch
    import moefold_torch
    got = {}

    def expect(name, exc, f):
        try:
            f()
            got[name] = None
        except exc as e:
            got[name] = type(e).__name__
        except Exception as e:  # noqa: BLE001: any other type is a failure, reported by name
            got[name] = "wrong: " + type(e).__name__ + ": " + str(e)

    expect("meta tensor", NotImplementedError,
           lambda: comm.all_reduce(torch.ones(4, device="meta"), "sum"))
    expect("int all_reduce", ValueError, lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32)))
    expect("mixed dtypes", ValueError,
           lambda: comm.all_gather_v(torch.ones(1), torch.ones(4, dtype=torch.float64), [1] * world))
    expect("non-contiguous", ValueError,
           lambda: comm.all_reduce(torch.ones(4, 4).t(), "sum"))
    expect("bad op", ValueError, lambda: comm.all_reduce(torch.ones(4), "mean"))
    both = torch.zeros(2 * world, 3)
    expect("overlapping all_to_all_v", ValueError,
           lambda: comm.all_to_all_v(both[:world], [1] * world, both[1:world + 1], [1] * world))
    comm.barrier()  # none of the refusals reached a collective: still in step
    # fail(): rank 0 gives up; the others' next collective names it.
    try:
        if rank == 0:
            comm.fail("the trainer's step raised")
        else:
            comm.all_reduce(torch.ones(4), "sum")
        got["fail"] = None
    except moefold_torch.MoefoldError as e:
        got["fail"] = e.code + ": " + str(e)
    out["got"] = got


SCENARIOS = {"collectives": scenario_collectives, "mismatch": scenario_mismatch,
             "dead": scenario_dead, "stall": scenario_stall, "bad_input": scenario_bad_input}


def worker(scenario, rank, world, port):
    import moefold_torch
    ranks.join(rank, world, port, TIMEOUT_S)
    comm = moefold_torch.Communicator()
    out = {"rank": rank}
    SCENARIOS[scenario](comm, rank, world, out)
    ranks.report(out)


# --- the parent -----------------------------------------------------------------------------

def launch(scenario, limit_s):
    return ranks.launch(os.path.abspath(__file__), scenario, WORLD, limit_s)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ranks.skip_without_torch()
    cases = ranks.Cases()
    case = cases.check

    res, hung = launch("collectives", 120)
    case("collectives: every rank finished", not hung and all(r["rc"] == 0 for r in res),
         [r["stderr"] for r in res if r["rc"] != 0][:1])
    bad = [(r["result"]["rank"], n) for r in res if r["result"] for n, ok in r["result"]["checks"]
           if not ok]
    n_checks = sum(len(r["result"]["checks"]) for r in res if r["result"])
    case(f"collectives: {n_checks} checks equal the references bit for bit",
         n_checks > 0 and not bad, bad[:8])

    res, hung = launch("mismatch", 60)
    rs = [r["result"] for r in res]
    case("mismatch: no rank hung", not hung and all(r is not None for r in rs),
         [r["stderr"] for r in res][:1])
    if all(r is not None for r in rs):
        case("mismatch: every rank raised comm_mismatch, one message, nothing received",
             all(r["code"] == "comm_mismatch" and r["message"] == rs[0]["message"]
                 and r["untouched"] for r in rs) and "count mismatch" in rs[0]["message"], rs)
        case("mismatch: the next call is comm_broken", all(r["later"] == "comm_broken" for r in rs),
             [r["later"] for r in rs])

    res, hung = launch("dead", 60)
    live = [r["result"] for r in res[:-1]]
    case("dead peer: it died (exit 3), no survivor hung or aborted",
         not hung and res[-1]["rc"] == 3 and all(r["rc"] == 0 for r in res[:-1]),
         [(r["rc"], r["stderr"][-300:]) for r in res])
    if all(r is not None for r in live):
        case("dead peer: every survivor raised MoefoldError before the group's timeout",
             all(r["raised"] == "MoefoldError" and r["code"] in ("comm_peer_failed", "comm_timeout")
                 for r in live) and max(r["seconds"] for r in live) < TIMEOUT_S * 0.75, live)

    res, hung = launch("stall", 60)
    live = [r["result"] for r in res[:-1]]
    case("stalled peer: no rank hung", not hung and all(r["rc"] == 0 for r in res),
         [(r["rc"], r["stderr"][-300:]) for r in res])
    if all(r is not None for r in live):
        case("stalled peer: the others raised comm_timeout at the group's timeout",
             all(r["raised"] == "MoefoldError" and r["code"] == "comm_timeout"
                 and TIMEOUT_S * 0.5 <= r["seconds"] <= TIMEOUT_S * 2 for r in live), live)

    res, hung = launch("bad_input", 60)
    gots = [r["result"]["got"] if r["result"] else None for r in res]
    case("bad input: no rank hung", not hung and all(g is not None for g in gots),
         [r["stderr"] for r in res][:1])
    if all(g is not None for g in gots):
        want = {"meta tensor": "NotImplementedError", "int all_reduce": "ValueError",
                "mixed dtypes": "ValueError", "non-contiguous": "ValueError",
                "bad op": "ValueError", "overlapping all_to_all_v": "ValueError"}
        case("bad input: each refusal is the named exception, before any collective",
             all(all(g[k] == v for k, v in want.items()) for g in gots), gots)
        case("bad input: fail() on rank 0 raises on every rank; its peers name it",
             gots[0]["fail"] is not None and "the trainer's step raised" in gots[0]["fail"]
             and all(g["fail"] is not None and g["fail"].startswith("comm_peer_failed")
                     and "rank 0 failed" in g["fail"] for g in gots[1:]), [g["fail"] for g in gots])

    return cases.finish()


if __name__ == "__main__":
    sys.exit(main())

"""The process groups of an MoE layer under moefold's Megatron-Core layout.

new_groups(tp=, cp=, pp=, ep=, etp=) creates them with dist.new_group (collective: every rank of
the job calls it with the same sizes, in the same order); groups_from(tp=, cp=, dp=, ep=, etp=,
edp=) takes the trainer's own groups instead, checks each against the layout (ValueError naming
the first mismatch) and creates only the combined groups the layer also needs (tp-cp, tp-dp-cp,
dp-cp, tp-ep), again collectively.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _C

# The kinds the layer runs collectives on, and the ones a trainer usually has (by moefold's names).
LAYER_KINDS = ("tp", "tp-cp", "tp-dp-cp", "dp-cp", "ep", "etp", "tp-ep", "edp")
ALL_KINDS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "ep", "etp", "tp-ep", "edp")


@dataclass
class Groups:
    """This rank's process group of each kind (None where the kind has one rank), the fold's
    sizes, and each kind's global ranks in group order (`ranks[kind]`)."""

    world: int
    tp: int
    cp: int
    pp: int
    ep: int
    etp: int
    dp: int
    edp: int
    order: str
    rank: int = 0  # this rank's global rank
    groups: dict = field(default_factory=dict)  # kind -> ProcessGroup or None (size 1)
    ranks: dict = field(default_factory=dict)   # kind -> this rank's group, global ranks

    def group(self, kind):
        """The ProcessGroup of `kind` ('ep', 'tp-dp-cp', ...; None for a group of one rank)."""
        if kind not in self.groups:
            raise ValueError(f"moefold_torch: no group of kind {kind!r} (kinds: {ALL_KINDS})")
        return self.groups[kind]

    def __getattr__(self, name):
        kind = name.replace("_", "-")
        groups = self.__dict__.get("groups", {})
        if kind in groups:
            return groups[kind]
        raise AttributeError(name)


def _layout(world, tp, cp, pp, ep, etp, order):
    for name, v in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"moefold_torch: {name} must be an int >= 1 (got {v!r})")
    return _C.megatron_group_ranks(world, tp, cp, pp, ep, etp, order)


def _mine(groups_of_kind, rank):
    for g in groups_of_kind:
        if rank in g:
            return g
    raise ValueError(f"moefold_torch: rank {rank} is in no group of the layout")


def _default_timeout():
    """The job's default group's timeout (init_process_group's): dist.new_group would otherwise
    give every new group torch's default of 30 minutes, so a stalled peer would hold the layer
    that long."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001  (another backend or torch version: torch's default)
        return None


def _make(layout, kinds, rank, have=None, timeout=None):
    """dist.new_group for every group of each kind in `kinds`, in the same order on every rank;
    keeps this rank's. `have`: kinds already given (not created)."""
    groups, ranks = {}, {}
    for kind in ALL_KINDS:
        mine = _mine(layout[kind], rank)
        ranks[kind] = mine
        if have is not None and kind in have:
            groups[kind] = have[kind]
            continue
        if kind not in kinds:
            continue
        for g in layout[kind]:
            if len(g) == 1:  # a group of one rank needs no process group
                if g == mine:
                    groups[kind] = None
                continue
            pg = dist.new_group(g, timeout=timeout)
            if g == mine:
                groups[kind] = pg
    return groups, ranks


def _world():
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("moefold_torch: torch.distributed is not initialized "
                         "(call dist.init_process_group first)")
    return dist.get_world_size(), dist.get_rank()


def new_groups(tp=1, cp=1, pp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp", timeout=None):
    """Every group of moefold's layout of the fold (tp, cp, pp, ep, etp over the whole job; etp
    defaults to tp, as Megatron-Core's expert_tensor_parallel_size), created with dist.new_group.
    `timeout`: how long a collective waits for a peer (default: the job's default group's).
    Collective: every rank calls it with the same arguments."""
    world, rank = _world()
    etp = tp if etp is None else etp
    layout = _layout(world, tp, cp, pp, ep, etp, order)
    groups, ranks = _make(layout, ALL_KINDS, rank,
                          timeout=timeout if timeout is not None else _default_timeout())
    return Groups(world=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp,
                  dp=world // (tp * cp * pp), edp=world // (etp * ep * pp), order=order,
                  rank=rank, groups=groups, ranks=ranks)


def _size(pg):
    return 1 if pg is None else dist.get_world_size(pg)


def groups_from(tp=None, cp=None, dp=None, ep=None, etp=None, edp=None, pp=1,
                order="tp-cp-ep-dp-pp", timeout=None):
    """The trainer's own groups (None for size 1), checked against moefold's layout of the fold
    their sizes give; the combined groups the layer also needs are created (collective), with
    `timeout` (default: the job's default group's)."""
    world, rank = _world()
    sizes = {"tp": _size(tp), "cp": _size(cp), "dp": _size(dp), "ep": _size(ep),
             "etp": _size(etp), "edp": _size(edp)}
    given = {"tp": tp, "cp": cp, "dp": dp, "ep": ep, "etp": etp, "edp": edp}
    layout, problem = None, None
    if sizes["tp"] * sizes["cp"] * sizes["dp"] * pp != world:
        problem = (f"tp {sizes['tp']} x cp {sizes['cp']} x dp {sizes['dp']} x pp {pp} != world "
                   f"{world}")
    elif sizes["etp"] * sizes["ep"] * sizes["edp"] * pp != world:
        problem = (f"etp {sizes['etp']} x ep {sizes['ep']} x edp {sizes['edp']} x pp {pp} != "
                   f"world {world}")
    else:
        try:
            layout = _layout(world, sizes["tp"], sizes["cp"], pp, sizes["ep"], sizes["etp"], order)
        except ValueError as e:
            problem = str(e)
    for kind in ("tp", "cp", "dp", "ep", "etp", "edp"):
        if problem is not None:
            break
        try:
            want = _mine(layout[kind], rank)
        except ValueError as e:
            problem = str(e)
            break
        pg = given[kind]
        have = [rank] if pg is None else dist.get_process_group_ranks(pg)
        if have != want:
            problem = (f"rank {rank}'s {kind} group has ranks {have}, moefold's layout ({order}) "
                       f"puts it in {want}")
    # Every rank's verdict, exchanged before any group is made: a mismatch found on some ranks
    # raises on all of them instead of leaving the others waiting in dist.new_group.
    verdicts = [None] * world
    dist.all_gather_object(verdicts, problem)
    for r, found in enumerate(verdicts):
        if found is not None:
            raise ValueError(f"moefold_torch: groups_from: {found}"
                             + ("" if r == rank else f" (found on rank {r})"))
    groups, ranks = _make(layout, ("pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-ep"), rank, have=given,
                          timeout=timeout if timeout is not None else _default_timeout())
    return Groups(world=world, tp=sizes["tp"], cp=sizes["cp"], pp=pp, ep=sizes["ep"],
                  etp=sizes["etp"], dp=sizes["dp"], edp=sizes["edp"], order=order,
                  rank=rank, groups=groups, ranks=ranks)


def thread_groups(world, tp=1, cp=1, pp=1, ep=1, etp=None, order="tp-cp-ep-dp-pp"):
    """The groups of a rank of moefold's C++ thread world (`world`: the communicator
    moefold_torch._C._run_thread_world hands each rank's function), laid out as new_groups lays
    out process groups: every rank of a mapping runs as a thread of one process, bit for bit as
    over gloo. For tests and for debugging a mapping without a job. Collective over `world`."""
    etp = tp if etp is None else etp
    n, rank = world.size, world.rank
    layout = _layout(n, tp, cp, pp, ep, etp, order)
    groups, ranks = {}, {}
    for kind in ALL_KINDS:
        mine = _mine(layout[kind], rank)
        ranks[kind] = mine
        if kind not in LAYER_KINDS:
            continue
        if len(mine) == 1:
            groups[kind] = None
            continue
        groups[kind] = world.split(layout[kind].index(mine), mine.index(rank))
    return Groups(world=n, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, dp=n // (tp * cp * pp),
                  edp=n // (etp * ep * pp), order=order, rank=rank, groups=groups, ranks=ranks)

#!/usr/bin/env python3
"""Produce tests/mesh/data/megatron_groups.txt: Megatron-Core's own process groups for a sweep
of configurations, used as an independent reference for moefold's mesh layer.

Nothing here re-implements Megatron's rank arithmetic: for every configuration we import the
real ``megatron/core/parallel_state.py`` from a Megatron-LM checkout given on the command line
and call its ``initialize_model_parallel`` once per rank, with ``torch.distributed`` replaced by
an in-process fake that only records the groups it is asked to create. No GPU, no process group
and no network are involved.

Needs: Python 3.11, torch (any CPU-capable build; only imported, never used for compute), and
the packages Megatron-Core's import chain needs (numpy, packaging, einops for hierarchical
groups).

Usage:
    python3 tools/gen_megatron_groups.py --megatron /path/to/Megatron-LM \
        > tests/mesh/data/megatron_groups.txt
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

# --------------------------------------------------------------------------------------------
# Group kinds: our name -> (the module global holding this rank's group, the group_desc that
# Megatron passes to new_group). The global is how we learn which groups exist; the group_desc
# is only used to cross-check that the per-rank union really recovered every created group.
# The order of this table is the order in which kinds are written.
# --------------------------------------------------------------------------------------------
KINDS: list[tuple[str, str, str]] = [
    ("tp", "_TENSOR_MODEL_PARALLEL_GROUP", "TENSOR_MODEL_PARALLEL_GROUP"),
    ("cp", "_CONTEXT_PARALLEL_GROUP", "CONTEXT_PARALLEL_GROUP"),
    ("dp", "_DATA_PARALLEL_GROUP", "DATA_PARALLEL_GROUP"),
    ("dp-cp", "_DATA_PARALLEL_GROUP_WITH_CP", "DATA_PARALLEL_GROUP_WITH_CP"),
    ("tp-cp", "_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "TENSOR_AND_CONTEXT_PARALLEL_GROUP"),
    ("tp-dp", "_TENSOR_AND_DATA_PARALLEL_GROUP", "TENSOR_AND_DATA_PARALLEL_GROUP"),
    (
        "tp-dp-cp",
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
        "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    ),
    ("pp", "_PIPELINE_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"),
    ("tp-pp", "_MODEL_PARALLEL_GROUP", "MODEL_PARALLEL_GROUP"),
    ("embd", "_EMBEDDING_GROUP", "EMBEDDING_GROUP"),
    ("pos_embd", "_POSITION_EMBEDDING_GROUP", "POSITION_EMBEDDING_GROUP"),
    ("ep", "_EXPERT_MODEL_PARALLEL_GROUP", "EXPERT_MODEL_PARALLEL_GROUP"),
    ("etp", "_EXPERT_TENSOR_PARALLEL_GROUP", "EXPERT_TENSOR_PARALLEL_GROUP"),
    ("tp-ep", "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"),
    (
        "tp-ep-pp",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
        "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    ),
    ("edp", "_EXPERT_DATA_PARALLEL_GROUP", "EXPERT_DATA_PARALLEL_GROUP"),
    (
        "intra_dist_opt_instance",
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
        "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
    ),
]
# With nd == 1 Megatron aliases these globals to dp-cp / edp (and leaves "inter" unset), so
# they are distinct kinds only when nd > 1.
PARTIAL_DISTOPT_KINDS: list[tuple[str, str, str]] = [
    (
        "intra_dp_cp",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    ),
    (
        "intra_ep_dp",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0",
    ),
    (
        "inter_ep_dp",
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1",
    ),
]
# One global holds a list with one group per hierarchy level.
HCP_GLOBAL = "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"
HCP_DESC = "HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{}"

# destroy_model_parallel() does not reset these, so a previous run would leak into the next one
# (for example hierarchical CP groups into a config without them). We clear them ourselves.
NOT_RESET_BY_DESTROY = {
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": lambda: None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": lambda: None,
    "_PIPELINE_GLOBAL_RANKS": lambda: None,
    "_HYBRID_DP_CP_GROUPS": dict,
    "_global_process_group_list": lambda: None,
}

# Exception messages are cut here: the pipeline-consistency assertion embeds every pp group.
MAX_MESSAGE = 300


# --------------------------------------------------------------------------------------------
# Fake torch.distributed
# --------------------------------------------------------------------------------------------
class FakeGroup:
    """Stands in for a ProcessGroup; remembers when and with which ranks it was created."""

    __slots__ = ("index", "ranks", "desc", "backend")

    def __init__(self, index: int, ranks: list[int], desc: str | None, backend: str | None):
        self.index = index
        self.ranks = ranks
        self.desc = desc
        self.backend = backend


class FakeDist:
    """The handful of torch.distributed entry points initialize_model_parallel touches.

    Anything else that would need a real backend (barrier, for SHARP) raises, so an unexpected
    code path shows up as an error instead of silently producing wrong groups."""

    def __init__(self) -> None:
        self.world_size = 1
        self.rank = 0
        self.created: list[FakeGroup] = []

    def install(self, dist) -> None:
        dist.is_initialized = lambda: True
        dist.get_world_size = self.get_world_size
        dist.get_rank = self.get_rank
        dist.new_group = self.new_group
        dist.barrier = self.unsupported("barrier")
        dist.destroy_process_group = lambda group=None: None

    def get_world_size(self, group=None) -> int:
        if group is not None:
            raise NotImplementedError("fake get_world_size(group)")
        return self.world_size

    def get_rank(self, group=None) -> int:
        if group is not None:
            raise NotImplementedError("fake get_rank(group)")
        return self.rank

    def new_group(self, ranks=None, timeout=None, backend=None, pg_options=None,
                  use_local_synchronization=False, group_desc=None, **_ignored) -> FakeGroup:
        group = FakeGroup(len(self.created), list(ranks), group_desc, backend)
        self.created.append(group)
        return group

    @staticmethod
    def unsupported(name: str):
        def fail(*_args, **_kwargs):
            raise NotImplementedError(f"fake torch.distributed.{name} called")

        return fail


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
PP_DP_ORDER = "tp-cp-ep-pp-dp"  # what the trainer passes with --use-tp-pp-dp-mapping


@dataclass(frozen=True)
class Config:
    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: let Megatron apply its default (etp = tp)
    order: str = DEFAULT_ORDER
    nd: int = 1
    hcp: tuple[int, ...] = ()
    offset: int = 0

    def header(self) -> str:
        etp = self.tp if self.etp is None else self.etp
        hcp = ",".join(map(str, self.hcp)) if self.hcp else "-"
        return (f"config world={self.world} tp={self.tp} cp={self.cp} pp={self.pp} ep={self.ep} "
                f"etp={etp} order={self.order} nd={self.nd} hcp={hcp} offset={self.offset}")

    def key(self) -> tuple:
        # etp=None and etp=tp are the same configuration for the sweep's purposes.
        return (self.world, self.tp, self.cp, self.pp, self.ep,
                self.tp if self.etp is None else self.etp, self.order, self.nd, self.hcp,
                self.offset)


# Our own reading of Megatron's rules (reference note, section 4). It is used only to steer the
# random sampler towards configurations Megatron should accept, and to flag on stderr any
# configuration where Megatron's actual behaviour differs from what we expected. The data file
# always records what Megatron actually did.
AXES = ("tp", "cp", "ep", "dp", "pp")


def expected_valid(c: Config) -> bool:
    etp = c.tp if c.etp is None else c.etp
    if c.world % (c.tp * c.cp * c.pp) or c.world % (etp * c.ep * c.pp):
        return False
    dp = c.world // (c.tp * c.cp * c.pp)
    edp = c.world // (etp * c.ep * c.pp)
    tokens = c.order.lower().split("-")  # Megatron lowercases for the generators ...
    if len(set(tokens)) != len(tokens) or not set(tokens) <= set(AXES):
        return False
    dec = {"tp": c.tp, "cp": c.cp, "ep": 1, "dp": dp, "pp": c.pp}
    exp = {"tp": etp, "cp": 1, "ep": c.ep, "dp": edp, "pp": c.pp}
    for sizes in (dec, exp):
        if any(sizes[a] > 1 and a not in tokens for a in AXES):
            return False
    if c.pp > 1 and not c.order.endswith("pp") and edp != dp:  # ... but not here
        return False
    if c.pp > 1:
        # pp groups agree iff the sizes of the axes left of pp have the same product.
        left = tokens[: tokens.index("pp")]
        if math.prod(dec[a] for a in left) != math.prod(exp[a] for a in left):
            return False
    if (dp * c.cp) % c.nd or edp % c.nd:
        return False
    if c.hcp and math.prod(c.hcp) != c.cp:
        return False
    return True


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The four worked examples (reference section 8, v0000..v0003) and the section 5 snippets come
# first so that a reader of the data file can find them without searching.
WORKED_EXAMPLES = [
    Config(8, tp=2, pp=2),  # v0000, etp left to Megatron's default
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1),  # v0001
    Config(64, tp=2, pp=4, ep=8, etp=1),  # v0002
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order=PP_DP_ORDER),  # v0003
    Config(16, tp=1, cp=2, pp=2, ep=2, etp=1, nd=2),  # section 5: partial DistOpt
    Config(16, tp=1, cp=4, pp=2, hcp=(2, 2)),  # section 5: hierarchical CP
    Config(8, tp=2, pp=2, ep=2, etp=1, offset=8),  # section 5: rank offset
]

# Hand-picked valid cases: edges (world 1, primes), folding extremes, every order we want to
# cover explicitly, nd and hierarchical CP variants, offsets, and accepted odd spellings.
HAND_VALID = [
    Config(1),
    Config(2, tp=2),
    Config(2, ep=2, etp=1),
    Config(3, pp=3),
    Config(5, cp=5),
    Config(7, ep=7),
    Config(7, tp=7, etp=1, ep=7),
    Config(9, tp=3, pp=3, ep=3, etp=1),
    Config(16, tp=4, ep=16, etp=1),  # EP folds over TP and DP entirely
    Config(16, tp=1, ep=1, etp=16),  # etp > tp
    Config(16, tp=4, cp=4, ep=2, etp=2),  # edp > dp
    Config(16, tp=1, cp=1, ep=4, etp=4),  # edp < dp
    Config(12, tp=2, cp=3, pp=2, ep=6, etp=1),
    Config(24, tp=2, cp=2, pp=3, ep=4, etp=2),
    Config(48, tp=4, cp=2, pp=2, ep=12, etp=1),
    Config(36, tp=3, cp=2, pp=3, ep=2, etp=3, order=PP_DP_ORDER),
    Config(32, tp=2, cp=2, pp=4, ep=2, etp=2, order=PP_DP_ORDER),
    Config(32, tp=4, cp=1, pp=2, ep=2, etp=2, order=PP_DP_ORDER),  # tp*cp == etp*ep, etp != tp
    Config(32, tp=2, cp=2, pp=1, ep=8, etp=1, order=PP_DP_ORDER),  # pp=1: any edp accepted
    Config(16, tp=2, cp=2, pp=2, ep=2, etp=1, order="tp-dp-cp-ep-pp"),
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="cp-tp-ep-dp-pp"),
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-ep-cp-dp-pp"),
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="ep-tp-cp-dp-pp"),
    Config(16, tp=2, pp=2, order="tp-dp-pp"),  # size-1 axes left out of the order
    Config(16, tp=2, pp=4, order="tp-pp-dp"),
    Config(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp"),
    Config(16, tp=2, pp=2, ep=2, etp=2, order="tp-ep-dp-pp"),
    Config(16, tp=2, pp=2, ep=2, etp=1, order="pp-tp-cp-ep-dp"),  # pp fastest, edp == dp
    Config(8, tp=2, pp=2, order="pp-dp-ep-cp-tp"),  # fully reversed
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="pp-dp-ep-cp-tp"),  # reversed, edp == dp
    Config(24, tp=2, cp=3, ep=8, etp=1, order="pp-dp-ep-cp-tp"),  # reversed, pp=1, edp != dp
    Config(32, tp=2, cp=2, pp=2, ep=1, etp=4, order="tp-cp-pp-ep-dp"),  # left of pp: 4 == 4
    Config(24, tp=2, cp=3, pp=2, ep=3, etp=2, order="tp-pp-cp-ep-dp"),  # EP folds over CP
    Config(32, tp=2, cp=2, pp=2, nd=2),
    Config(32, tp=2, cp=2, pp=2, ep=2, etp=1, nd=4),
    Config(48, tp=2, cp=2, pp=2, ep=3, etp=2, nd=2),
    Config(64, tp=1, cp=4, pp=2, ep=8, etp=1, nd=4),
    Config(16, cp=8, pp=2, hcp=(2, 4)),
    Config(16, cp=8, pp=1, hcp=(2, 2, 2)),
    Config(24, tp=2, cp=6, hcp=(3, 2)),
    Config(36, cp=6, pp=2, ep=6, etp=1, hcp=(2, 3)),
    Config(16, cp=4, hcp=(4,)),  # one level: hcp_L0 == cp
    Config(32, tp=2, cp=4, pp=2, ep=2, etp=2, nd=2, hcp=(2, 2)),
    Config(8, tp=2, cp=2, pp=2, offset=1),
    Config(12, tp=2, pp=3, ep=4, etp=1, offset=5),
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order=PP_DP_ORDER, offset=16),
    Config(32, tp=2, cp=2, ep=4, etp=2, nd=2, offset=32),
    # Uppercase orders: RankGenerator lowercases, but the pp-last check uses the raw string.
    Config(16, tp=2, cp=2, pp=1, ep=4, etp=1, order="TP-CP-EP-DP-PP"),
    Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="TP-CP-EP-DP-PP"),  # edp == dp
    Config(8, tp=2, pp=2, order="Tp-Cp-Ep-Dp-Pp"),
]

# Big worlds (>= 128) are kept to a dozen so the file stays small.
BIG_VALID = [
    Config(128, tp=8, pp=2, ep=16, etp=1),
    Config(128, tp=2, cp=2, pp=4, ep=8, etp=2, nd=2),
    Config(128, tp=4, cp=4, pp=1, ep=32, etp=1, hcp=(2, 2)),
    Config(128, tp=4, cp=2, pp=4, ep=8, etp=1, order=PP_DP_ORDER),
    Config(144, tp=4, cp=3, pp=3, ep=12, etp=1),
    Config(144, tp=2, cp=2, pp=2, ep=9, etp=2, order="tp-dp-cp-ep-pp"),
    Config(192, tp=8, pp=4, ep=8, etp=2),
    Config(192, tp=4, cp=2, pp=2, ep=24, etp=1, nd=4),
    Config(256, tp=8, cp=2, pp=4, ep=32, etp=1),
    Config(256, tp=4, pp=8, ep=4, etp=1, order=PP_DP_ORDER),
    Config(256, tp=2, cp=4, pp=2, ep=64, etp=1, nd=2, hcp=(2, 2), offset=256),
    Config(256, tp=1, cp=1, pp=1, ep=256, etp=1),
]

# Configurations Megatron must reject, with the exception class we expect.
HAND_INVALID: list[tuple[Config, str]] = [
    # world not divisible by tp*pp*cp
    (Config(12, tp=4, pp=2, etp=4), "RuntimeError"),
    (Config(6, tp=4), "RuntimeError"),
    (Config(10, tp=2, cp=2), "RuntimeError"),
    (Config(7, tp=2), "RuntimeError"),
    (Config(18, tp=2, cp=2), "RuntimeError"),
    (Config(24, tp=4, cp=2, pp=2), "RuntimeError"),
    # world not divisible by etp*ep*pp
    (Config(16, tp=2, pp=2, ep=3, etp=1), "RuntimeError"),
    (Config(12, ep=8, etp=1), "RuntimeError"),
    (Config(24, tp=2, pp=2, ep=4, etp=4), "RuntimeError"),
    (Config(48, tp=4, cp=2, pp=2, ep=5, etp=1), "RuntimeError"),
    (Config(9, tp=3, ep=2), "RuntimeError"),  # default etp = tp = 3
    # pp not last and edp != dp
    (Config(64, tp=2, pp=4, ep=8, etp=1, order=PP_DP_ORDER), "AssertionError"),
    (Config(16, tp=2, pp=2, ep=4, etp=1, order=PP_DP_ORDER), "AssertionError"),
    (Config(32, cp=2, pp=2, order=PP_DP_ORDER, etp=1), "AssertionError"),
    (Config(16, tp=2, pp=2, ep=4, etp=1, order="TP-CP-EP-DP-PP"), "AssertionError"),
    # pp groups of the two generators differ (edp == dp, but tp != etp left of pp)
    (Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-pp-cp-ep-dp"), "AssertionError"),
    (Config(8, tp=2, pp=2, ep=2, etp=1, order="tp-pp-ep-dp"), "AssertionError"),
    # dp*cp not divisible by nd
    (Config(12, tp=2, pp=2, nd=2), "AssertionError"),
    (Config(16, tp=2, pp=2, nd=8), "AssertionError"),
    (Config(24, tp=2, cp=1, pp=1, nd=8), "AssertionError"),
    # edp not divisible by nd (checked only after most groups were created)
    (Config(16, pp=2, ep=4, etp=1, nd=4), "AssertionError"),
    (Config(32, cp=2, ep=8, etp=2, nd=4), "AssertionError"),
    (Config(16, tp=2, pp=2, ep=4, etp=1, nd=4), "AssertionError"),
    # hierarchical CP sizes whose product is not cp
    (Config(16, cp=4, hcp=(2, 3)), "AssertionError"),
    (Config(16, cp=4, hcp=(2,)), "AssertionError"),
    (Config(16, cp=8, pp=2, hcp=(2, 2)), "AssertionError"),
    (Config(16, cp=2, pp=2, hcp=(2, 2, 2)), "AssertionError"),
    # order lacks an axis whose size is > 1
    (Config(16, tp=2, cp=2, order="tp-ep-dp-pp"), "RuntimeError"),
    (Config(16, tp=2, pp=2, order="tp-cp-ep-dp"), "RuntimeError"),
    (Config(16, tp=2, pp=2, ep=2, order="tp-cp-dp-pp"), "RuntimeError"),  # expert side only
    (Config(16, tp=2, pp=2, order="tp-cp-ep-pp"), "RuntimeError"),  # dp = 4
    (Config(16, tp=4, pp=4, ep=2, etp=1, order="tp-cp-ep-pp"), "RuntimeError"),  # dp 1, edp 2
    (Config(8, tp=2, pp=2, ep=2, etp=1, order="tp-pp"), "RuntimeError"),
    # unknown tokens
    (Config(16, tp=2, cp=2, pp=2, ep=4, etp=1, order="tp-cp-ep-dp-pp-xx"), "KeyError"),
    (Config(16, tp=2, cp=2, pp=2, order="tp-cp-xp-dp-pp"), "KeyError"),
    (Config(8, tp=2, pp=2, order="tp_cp_ep_dp_pp"), "KeyError"),
    (Config(8, tp=2, pp=2, order="tp-cp-ep-dp-pp-"), "KeyError"),
]

# Orders the random sampler draws from (with weights). Orders without "tp" are left out on
# purpose: at HEAD the missing-axis check is a substring test that "gtp_remat" defeats.
RANDOM_ORDERS = [
    (DEFAULT_ORDER, 10),
    (PP_DP_ORDER, 5),
    ("tp-dp-cp-ep-pp", 1),
    ("cp-tp-ep-dp-pp", 1),
    ("tp-ep-cp-dp-pp", 1),
    ("ep-tp-cp-dp-pp", 1),
    ("tp-cp-dp-ep-pp", 1),
    ("dp-tp-cp-ep-pp", 1),
    ("tp-cp-pp-ep-dp", 1),
    ("pp-tp-cp-ep-dp", 1),
    ("tp-dp-pp", 1),
    ("tp-cp-dp-pp", 1),
    ("tp-ep-dp-pp", 1),
]
RANDOM_WORLDS = [2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 18, 20, 24, 27, 32, 36, 40, 48, 64, 72, 96]
TARGET_VALID = 240
SEED = 20260822


def random_config(rng: random.Random) -> Config:
    world = rng.choice(RANDOM_WORLDS)
    # Small factors are what real jobs use; still allow any divisor.
    pick = lambda n: rng.choice(divisors(n)[: max(2, len(divisors(n)) * 2 // 3)])
    pp = pick(world)
    cp = pick(world // pp)
    tp = pick(world // (pp * cp))
    etp = pick(world // pp)
    ep = rng.choice(divisors(world // (pp * etp)))
    dp = world // (tp * cp * pp)
    edp = world // (etp * ep * pp)
    order = rng.choices([o for o, _ in RANDOM_ORDERS], [w for _, w in RANDOM_ORDERS])[0]
    nd = 1
    if rng.random() < 0.2:
        nd = rng.choice([d for d in (2, 4) if (dp * cp) % d == 0 and edp % d == 0] or [1])
    hcp: tuple[int, ...] = ()
    if cp > 1 and rng.random() < 0.2:
        first = rng.choice(divisors(cp))
        rest = cp // first
        second = rng.choice(divisors(rest))
        hcp = tuple(x for x in (first, second, rest // second) if x > 1) or (cp,)
    offset = rng.choice([1, 3, 8, world]) if rng.random() < 0.08 else 0
    etp_arg = None if etp == tp and rng.random() < 0.5 else etp
    return Config(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp_arg, order=order, nd=nd, hcp=hcp,
                  offset=offset)


def build_sweep() -> tuple[list[Config], list[tuple[Config, str]]]:
    valid = WORKED_EXAMPLES + HAND_VALID + BIG_VALID
    seen = {c.key() for c in valid}
    rng = random.Random(SEED)
    while len(valid) < TARGET_VALID:
        c = random_config(rng)
        if c.key() in seen or not expected_valid(c):
            continue
        seen.add(c.key())
        valid.append(c)
    return valid, HAND_INVALID


# --------------------------------------------------------------------------------------------
# Running Megatron
# --------------------------------------------------------------------------------------------
class Outcome:
    def __init__(self, groups: dict[str, list[list[int]]] | None = None,
                 error: tuple[str, str] | None = None):
        self.groups = groups
        self.error = error


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = " ".join(lines[0].split()) if lines else ""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 4] + " ..."


def groups_of(value) -> list[FakeGroup]:
    """A global holds a group, a list of groups (pp, when a rank is in several), or None."""
    if value is None:
        return []
    if isinstance(value, FakeGroup):
        return [value]
    if isinstance(value, (list, tuple)):
        return [g for v in value for g in groups_of(v)]
    raise TypeError(f"unexpected global value {value!r}")


def run_config(ps, fake: FakeDist, c: Config) -> Outcome:
    kinds = list(KINDS) + (PARTIAL_DISTOPT_KINDS if c.nd > 1 else [])
    kinds += [(f"hcp_L{i}", None, HCP_DESC.format(i)) for i in range(len(c.hcp))]
    found: dict[str, dict[int, list[int]]] = {k: {} for k, _, _ in kinds}
    outcomes: set[tuple] = set()
    reference_sequence = None

    fake.world_size = c.offset + c.world
    for rank in range(c.offset, c.offset + c.world):
        for name, fresh in NOT_RESET_BY_DESTROY.items():
            setattr(ps, name, fresh())
        fake.rank = rank
        fake.created = []
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=c.tp,
                pipeline_model_parallel_size=c.pp,
                context_parallel_size=c.cp,
                hierarchical_context_parallel_sizes=list(c.hcp) or None,
                expert_model_parallel_size=c.ep,
                expert_tensor_parallel_size=c.etp,
                num_distributed_optimizer_instances=c.nd,
                order=c.order,
                rank_offset=c.offset,
                local_world_size=c.world if c.offset else None,
            )
        except Exception as exc:  # record what Megatron raised, whatever it is
            outcomes.add(("error", type(exc).__name__, one_line(exc)))
        else:
            outcomes.add(("groups",))
            for kind, global_name, _ in kinds:
                if kind.startswith("hcp_L"):
                    level_groups = getattr(ps, HCP_GLOBAL)
                    value = level_groups[int(kind[5:])] if level_groups else None
                else:
                    value = getattr(ps, global_name)
                for g in groups_of(value):
                    if rank not in g.ranks:
                        raise AssertionError(f"{c.header()}: rank {rank} not in its {kind} group")
                    found[kind][g.index] = g.ranks
            # Every rank must walk the same creation sequence, or creation indices would not
            # be comparable across ranks.
            sequence = [(g.desc, g.backend, g.ranks) for g in fake.created]
            if reference_sequence is None:
                reference_sequence = sequence
            elif sequence != reference_sequence:
                raise AssertionError(f"{c.header()}: creation sequence differs on rank {rank}")
        finally:
            ps.destroy_model_parallel()

    if len(outcomes) != 1:
        raise AssertionError(f"{c.header()}: ranks disagree: {sorted(outcomes)}")
    outcome = outcomes.pop()
    if outcome[0] == "error":
        return Outcome(error=(outcome[1], outcome[2]))

    result: dict[str, list[list[int]]] = {}
    for kind, _, desc in kinds:
        ordered = [found[kind][i] for i in sorted(found[kind])]
        # Cross-check the per-rank union against everything Megatron created under this
        # group_desc: it proves no group was missed (e.g. groups a rank is not part of).
        created = [ranks for d, backend, ranks in reference_sequence
                   if d == desc and backend != "gloo"]
        if ordered != created:
            raise AssertionError(f"{c.header()}: {kind}: union of globals != created groups")
        if not ordered:
            raise AssertionError(f"{c.header()}: kind {kind} was not created")
        result[kind] = ordered
    return Outcome(groups=result)


def write_record(out, c: Config, o: Outcome) -> None:
    out.write(c.header() + "\n")
    if o.error:
        cls, msg = o.error
        out.write(f"error {cls} {msg}".rstrip() + "\n")
    else:
        for kind, groups in o.groups.items():
            out.write(f"group {kind} " + " ".join(",".join(map(str, g)) for g in groups) + "\n")
    out.write("end\n")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------
def git_commit(path: Path) -> tuple[str, str] | None:
    try:
        sha = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                             capture_output=True, text=True).stdout.strip()
        date = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%cI", "HEAD"],
                              check=True, capture_output=True, text=True).stdout.strip()
        return sha, date
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, type=Path,
                        help="root of a Megatron-LM checkout (the folder holding megatron/)")
    parser.add_argument("--commit", help="commit sha, when the checkout is not a git work tree")
    parser.add_argument("--commit-date", default="date unknown", help="with --commit")
    args = parser.parse_args()

    root = args.megatron.resolve()
    ps_file = root / "megatron" / "core" / "parallel_state.py"
    if not ps_file.is_file():
        parser.error(f"{ps_file} not found")
    commit = git_commit(root) or (args.commit or "unknown", args.commit_date)

    sys.path.insert(0, str(root))
    import torch  # noqa: E402  (the real one; only torch.distributed is patched)

    fake = FakeDist()
    fake.install(torch.distributed)
    with warnings.catch_warnings():
        # Megatron warns about optional accelerators (TE, Apex) it cannot find; irrelevant here.
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state as ps  # noqa: E402
    if not ps.HAVE_EINOPS:
        sys.exit("einops is required for hierarchical groups (pip install einops)")
    for name in [g for _, g, _ in KINDS + PARTIAL_DISTOPT_KINDS] + [HCP_GLOBAL,
                                                                    *NOT_RESET_BY_DESTROY]:
        if not hasattr(ps, name):
            sys.exit(f"parallel_state has no global {name}: update this script")

    import einops
    import numpy

    valid, invalid = build_sweep()
    out = sys.stdout
    out.write(
        "# Megatron-Core rank groups, produced by running megatron/core/parallel_state.py "
        "(initialize_model_parallel) on the CPU\n"
        "# repository: NVIDIA/Megatron-LM\n"
        f"# commit: {commit[0]} ({commit[1]})\n"
        f"# file: megatron/core/parallel_state.py sha256 "
        f"{hashlib.sha256(ps_file.read_bytes()).hexdigest()}\n"
        "# command: python3 tools/gen_megatron_groups.py --megatron <path to Megatron-LM "
        "checkout> > tests/mesh/data/megatron_groups.txt\n"
        f"# torch: {torch.__version__} (the real PyPI wheel, run on a machine without GPU; numpy "
        f"{numpy.__version__}, "
        f"einops {einops.__version__}); torch.distributed.is_initialized/get_world_size/"
        "get_rank/new_group replaced by an in-process fake that records groups, "
        "initialize_model_parallel called once per rank\n"
        "# format: \"config\" line with key=value; then \"group <kind> <g1> <g2> ...\" where "
        "each group is comma-separated ranks; or \"error <ExceptionClass> <one-line message>\"; "
        "then \"end\"\n"
        "# groups: every group Megatron created for the kind (union over all ranks), in "
        "creation order; ranks inside a group in the order Megatron passed them\n"
        "# kinds, in this order: tp cp dp dp-cp tp-cp tp-dp tp-dp-cp pp tp-pp embd pos_embd "
        "ep etp tp-ep tp-ep-pp edp intra_dist_opt_instance, then intra_dp_cp intra_ep_dp "
        "inter_ep_dp only when nd>1, then hcp_L0 hcp_L1 ... only when hcp is given\n"
        "# keys: etp is always the size used (Megatron's default etp=tp when not passed); "
        "hcp=- means no hierarchical CP; world is the number of ranks; offset>0 runs HEAD's "
        "initialize_model_parallel(rank_offset=offset, local_world_size=world) on a global "
        "world of offset+world ranks, so ranks are offset..offset+world-1\n"
        f"# errors: first line of the message, whitespace collapsed, cut to {MAX_MESSAGE} "
        "characters (ending ' ...'); the message may be empty; KeyError messages keep "
        "Python's quotes\n"
        "# records: the first 4 are the worked examples v0000..v0003, the next 3 the "
        "section-5 snippets (nd=2, hcp=2,2, offset=8) of the reference note; then the other "
        "accepted configurations, then the rejected ones\n"
    )

    surprises = 0
    n_valid = n_invalid = 0
    records = [(c, "valid") for c in valid] + list(invalid)
    if len({c.key() for c, _ in records}) != len(records):
        sys.exit("the sweep lists a configuration twice")
    accepted, rejected = [], []
    for c, expect in records:
        o = run_config(ps, fake, c)
        # Two independent expectations: the one written next to the case, and our reading of
        # the rules (expected_valid). Either disagreeing with Megatron is worth a look.
        got = o.error[0] if o.error else "valid"
        if got != expect or (got == "valid") != expected_valid(c):
            print(f"surprise: listed as {expect}, rules say "
                  f"{'valid' if expected_valid(c) else 'invalid'}, Megatron: "
                  f"{o.error or 'groups'}: {c.header()}", file=sys.stderr)
            surprises += 1
        (rejected if o.error else accepted).append((c, o))
    # Accepted configurations first, whatever list they came from, then the rejected ones.
    for c, o in accepted + rejected:
        write_record(out, c, o)
        if o.error:
            n_invalid += 1
        else:
            n_valid += 1
    print(f"{n_valid} accepted, {n_invalid} rejected, {surprises} surprises", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A plain-Python model of the TransferQueue controller state (``ControllerState``).

It re-implements the semantics naively (scans over sets) so that each claim's exact result and
every freed, evicted, lost, discarded or abandoned report can be predicted and compared. A state
machine (``test_state_machine.py``) mixes :class:`Model` in, drives the real state and the model
with the same operations, and calls :meth:`Model.check_update` on every ``Update`` it gets back.

The model covers: samples and groups (:class:`MSample`, :class:`MGroup`), leases
(:class:`MLease`, rank-shared ones included), candidacy and whole-group eligibility per consumer
and column set, first-fit whole-group picks, the staleness window (stale groups are evicted
when unheld), and writes in progress: a sample is *committed* by its first column write, and an
uncommitted sample past its writer's deadline, or one whose writer died, is abandoned (dropped
and counted as discarded); so are the unfilled slots of an open group past its deadline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from asyncflow_actors.transfer_queue import (
    FIFO,
    WHOLE_GROUPS,
    Balanced,
    Eviction,
    Sampler,
    TopicSpec,
    Update,
)

T = "rollout"
CONSUMERS = ("fwd", "adv", "train")
UNITS = ("u0", "u1", "u2")
SHARED = frozenset({"prompt"})
COLUMN_SETS = (
    frozenset({"resp"}),
    frozenset({"resp", "prompt"}),
    frozenset({"resp", "lp"}),
    frozenset({"resp", "lp", "prompt"}),
)
SAMPLERS: tuple[Sampler, ...] = (FIFO, WHOLE_GROUPS, Balanced(2), Balanced(2, whole_groups=True))
HOLDERS = ("h0", "h1", "h2")
TTL = 10.0  # lease_ttl
WRITE_TTL = 8.0  # write_ttl
# A share key fixes every parameter of its claims, so sharing claimants always match.
SHARE_KEYS: dict[str, tuple[str, frozenset[str], int, Sampler]] = {
    "k0": ("train", COLUMN_SETS[1], 4, FIFO),
    "k1": ("adv", COLUMN_SETS[3], 4, WHOLE_GROUPS),
}


def uses_groups(sampler: Sampler) -> bool:
    return sampler is WHOLE_GROUPS or (isinstance(sampler, Balanced) and sampler.whole_groups)


@dataclass
class MSample:
    version: int
    gid: int
    unit: str
    cols: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    leased: set[str] = field(default_factory=set)
    committed: bool = False
    deadline: float = math.inf  # abandoned at this time unless committed
    writer: str | None = None
    nbytes: dict[str, int] = field(default_factory=dict)  # per written column


@dataclass
class MGroup:
    size: int
    allocated: int
    unit: str
    members: list[int] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)
    deadline: float = math.inf  # unfilled slots are given up at this time
    owner: str | None = None
    explicit: bool = True  # opened with open_group (else the group of one ungrouped sample)

    @property
    def pending(self) -> int:
        return self.size - self.allocated


@dataclass
class MLease:
    consumer: str
    indexes: tuple[int, ...]
    holders: set[str]
    share_count: int
    share_key: str | None
    deadline: float
    acked_by: set[str] = field(default_factory=set)


@dataclass
class Expect:
    freed: set[int] = field(default_factory=set)
    evicted: dict[int, set[int]] = field(default_factory=dict)
    groups_released: set[int] = field(default_factory=set)
    discarded: set[int] = field(default_factory=set)
    missing: list[int] = field(default_factory=list)
    abandoned: set[int] = field(default_factory=set)
    abandoned_groups: set[int] = field(default_factory=set)


class Model:
    """Expected state; the machine mixes it in and keeps it in step with the real one."""

    def init_model(self, spec: TopicSpec) -> None:
        self.spec = spec
        self.epoch = 0
        self.now = 0.0
        self.latest = 0
        self.samples: dict[int, MSample] = {}
        self.groups: dict[int, MGroup] = {}
        self.leases: dict[int, MLease] = {}
        self.shares: dict[tuple[str, str], int] = {}
        self.dead_leases: set[int] = set()
        self.ever_acked: dict[str, set[int]] = {c: set() for c in CONSUMERS}
        self.allocated: set[int] = set()
        self.freed: set[int] = set()
        self.evicted: set[int] = set()
        self.lost: set[int] = set()
        self.discarded: set[int] = set()
        self.lost_groups: set[int] = set()
        self.evicted_groups: set[int] = set()
        self.unit_of: dict[int, str] = {}
        self.group_of: dict[int, int] = {}

    @property
    def threshold(self) -> int:
        return self.latest - self.spec.staleness

    def occupied(self) -> int:
        return len(self.samples) + sum(g.pending for g in self.groups.values())

    def stale(self, gid: int) -> bool:
        g = self.groups[gid]
        return any(self.samples[i].version < self.threshold for i in g.members)

    def held(self, gid: int) -> int:
        return sum(len(self.samples[i].leased) for i in self.groups[gid].members)

    def candidate(self, c: str, cols: frozenset[str], i: int) -> bool:
        s = self.samples[i]
        g = self.groups[s.gid]
        return (
            (cols - SHARED) <= s.cols
            and (cols & SHARED) <= g.shared
            and c not in s.acked
            and c not in s.leased
            and not self.stale(s.gid)
        )

    def unacked(self, c: str, gid: int) -> list[int]:
        return [i for i in self.groups[gid].members if c not in self.samples[i].acked]

    def eligible(self, c: str, cols: frozenset[str], gid: int) -> bool:
        g = self.groups[gid]
        rest = self.unacked(c, gid)
        return (
            g.pending == 0
            and bool(rest)
            and not self.stale(gid)
            and all(self.candidate(c, cols, i) for i in rest)
        )

    def expected_pick(
        self, c: str, cols: frozenset[str], count: int, low: int, sampler: Sampler
    ) -> list[int] | None:
        if uses_groups(sampler):
            total, picked = 0, []
            for gid in sorted(self.groups):
                if not self.eligible(c, cols, gid):
                    continue
                rest = self.unacked(c, gid)
                if total + len(rest) <= count:
                    picked.extend(rest)
                    total += len(rest)
                    if total == count:
                        break
            return picked if total >= low else None
        cands = sorted(i for i in self.samples if self.candidate(c, cols, i))
        return cands[:count] if len(cands) >= low else None

    def drop(self, i: int) -> None:
        s = self.samples.pop(i)
        self.groups[s.gid].members.remove(i)

    def settle(self, gid: int, ex: Expect) -> None:
        g = self.groups.get(gid)
        if g is None:
            return
        if self.stale(gid) and self.held(gid) == 0:
            members = list(g.members)
            for i in members:
                self.drop(i)
            ex.evicted[gid] = set(members)
            del self.groups[gid]
            ex.groups_released.add(gid)
        elif not g.members and g.pending == 0:
            del self.groups[gid]
            ex.groups_released.add(gid)

    def return_lease(self, lid: int, ex: Expect) -> None:
        ml = self.leases.pop(lid)
        self.dead_leases.add(lid)
        if ml.share_key is not None:
            self.shares.pop((ml.consumer, ml.share_key), None)
        touched: list[int] = []
        for i in ml.indexes:
            s = self.samples.get(i)
            if s is None:
                ex.missing.append(i)
                continue
            s.leased.discard(ml.consumer)
            touched.append(s.gid)
        for gid in dict.fromkeys(touched):
            self.settle(gid, ex)

    def discard_samples(self, indexes: list[int], ex: Expect) -> None:
        """Drop samples on purpose (their groups shrink by as many members), then settle."""
        self._drop_members(indexes, ex, shrink=True)

    def unallocate_samples(self, indexes: list[int], ex: Expect) -> None:
        """Undo a failed put: uncommitted members of open groups give their slots back (the
        group keeps its size); committed and ungrouped samples are discarded."""
        back = [
            i
            for i in indexes
            if not self.samples[i].committed and self.groups[self.samples[i].gid].explicit
        ]
        self.discard_samples([i for i in indexes if i not in back], ex)
        self._drop_members(back, ex, shrink=False)

    def _drop_members(self, indexes: list[int], ex: Expect, *, shrink: bool) -> None:
        """Drop samples from their groups (``shrink``: the groups lose the slots too), then
        settle each group touched."""
        touched = []
        for i in sorted(indexes):
            gid = self.samples[i].gid
            if shrink:
                self.groups[gid].size -= 1
            self.groups[gid].allocated -= 1
            self.drop(i)
            touched.append(gid)
        ex.discarded |= set(indexes)
        for gid in dict.fromkeys(touched):
            self.settle(gid, ex)

    def abandon(self, ex: Expect, *, now: float | None = None, holder: str | None = None) -> None:
        """Writes past their deadline at ``now`` (or by the dead ``holder``): uncommitted
        samples are discarded, then the open groups' unfilled slots given up."""

        def due(deadline: float, who: str | None) -> bool:
            return deadline <= now if now is not None else who == holder

        gone = [i for i, s in self.samples.items() if not s.committed and due(s.deadline, s.writer)]
        ex.abandoned |= set(gone)
        ex.abandoned_groups |= {self.samples[i].gid for i in gone}
        self.discard_samples(gone, ex)
        for gid in sorted(self.groups):
            g = self.groups.get(gid)
            if g is not None and g.pending > 0 and due(g.deadline, g.owner):
                ex.abandoned_groups.add(gid)
                g.size = g.allocated
                self.settle(gid, ex)

    def check_update(self, upd: Update, ex: Expect) -> None:
        released = {i for r in upd.releases for i in r.indexes}
        assert len(released) == len(upd.freed_indexes), "an index released twice"
        evicted = {gid: set(e) for ev in upd.evictions for gid, e in self._by_group(ev)}
        assert evicted == ex.evicted
        want = ex.freed | ex.discarded | {i for m in ex.evicted.values() for i in m}
        assert released == want
        assert {g for r in upd.releases for g in r.group_ids} == ex.groups_released
        assert sorted(upd.missing) == sorted(ex.missing)
        assert {i for a in upd.abandoned for i in a.indexes} == ex.abandoned
        assert {g for a in upd.abandoned for g in a.group_ids} == ex.abandoned_groups
        for r in upd.releases:
            for i in r.indexes:
                assert self.unit_of[i] == r.unit
        for gid, members in ex.evicted.items():
            assert gid not in self.evicted_groups, "group evicted twice"
            self.evicted_groups.add(gid)
            assert not (members & self.evicted), "sample evicted twice"
            self.evicted |= members
        assert not (ex.freed & self.freed), "sample freed twice"
        self.freed |= ex.freed
        self.discarded |= ex.discarded

    def _by_group(self, ev: Eviction) -> list[tuple[int, set[int]]]:
        assert ev.topic == T and ev.reason == "stale"
        out: list[tuple[int, set[int]]] = []
        idx = set(ev.indexes)
        for gid in ev.group_ids:
            members = {i for i in idx if self.group_of[i] == gid}
            out.append((gid, members))
        covered: set[int] = set()
        for _, members in out:
            covered |= members
        assert covered == idx
        return out

"""A fault campaign against a whole pipeline run: a seeded schedule of random faults, carried out.

``FaultSchedule`` is a plain value: every ``every`` seconds it picks, from ``seed``, one fault
kind (by weight) and one target of that kind; ``plan(duration, targets)`` lists them, the same
list for the same seed and targets. ``open_fault_campaign`` carries a plan out against a run
started with ``open_pipeline`` and records what it did and when, so that the time from each
fault to the next completed step can be read off the run's records::

    schedule = FaultSchedule(every=20, seed=7)
    async with open_link_faults(system, config) as links, \\
            open_pipeline(system, config) as run, \\
            open_fault_campaign(system, run, schedule, duration=600, links=links) as campaign:
        await campaign.wait()
        run.stop()
        await run.wait()
    print(campaign.recovery_seconds(), campaign.counts())

The kinds (``FAULT_KINDS``): ``kill_role`` (``kill -9`` of a role's node process: rollout,
reward, the forward stations, advantage), ``kill_trainer`` (the Trainer's node: the run goes on
through ``train.auto_resume``), ``kill_unit`` (a TransferQueue
storage unit's process), ``stall`` (SIGSTOP of a station's or unit's process for a while,
shorter than the heartbeat timeout: a long GC pause, not a death), and three faults of the
driver's link to one node (through a ``LinkProxy``, ``open_link_faults``): ``link_cut`` (a
partition longer than the heartbeat timeout: the link drops), ``link_blip`` (a short partition
that TCP rides out) and ``link_delay`` (every message held back for a while).

Faults hit processes: a station folded into another role's process (``placement.roles.actor_fwd
= "trainer"``) dies with that process, so in such a placement ``kill_trainer`` kills ActorForward
and Advantage too; ``roles_at`` says what each target holds (each kill's ``detail`` names it)
and ``target_node`` which process a fault meant for a role's worker hits. A process the campaign
killed is never hit again: a fault that finds it still there waits for its successor.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, get_args

import attrs
import trio

from ..actors.remote import NodeOptions
from ._processes import alive, kill9
from ._proxy import LinkProxy, LinkRule, open_link_proxy

if TYPE_CHECKING:
    from ..actors.remote import NodeSystem
    from ..pipeline import PipelineConfig
    from ..pipeline._run import Pipeline

FaultKind = Literal[
    "kill_role", "kill_trainer", "kill_unit", "stall", "link_cut", "link_blip", "link_delay"
]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
LINK_KINDS: tuple[FaultKind, ...] = ("link_cut", "link_blip", "link_delay")
STATIONS = ("rollout", "reward", "actor_fwd", "ref_fwd", "advantage")

_HEARTBEAT = NodeOptions().heartbeat_timeout


def _weights(value: Mapping[str, float]) -> dict[FaultKind, float]:
    out: dict[FaultKind, float] = {}
    for kind, weight in dict(value).items():
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        if not weight >= 0:
            raise ValueError(f"the weight of {kind!r} must be >= 0, got {weight!r}")
        out[kind] = float(weight)
    return out


def _default_weights() -> dict[FaultKind, float]:
    return dict.fromkeys(FAULT_KINDS, 1.0)


def _span(value: Sequence[float]) -> tuple[float, float]:
    low, high = (float(v) for v in value)
    if not 0 <= low <= high:
        raise ValueError(f"a span is (low, high) with 0 <= low <= high, got {value!r}")
    return low, high


@attrs.frozen
class PlannedFault:
    """One fault of a plan: ``kind`` on ``target`` (a role's node name as configured, such as
    ``"rollout-0"``, or a storage unit, ``"unit-0"``) ``at`` seconds after the campaign starts,
    lasting ``seconds`` (stalls and link faults; 0 for kills)."""

    at: float
    kind: FaultKind
    target: str
    seconds: float = 0.0
    delay: float = 0.0  # link_delay: how long each message is held back


@attrs.frozen
class FaultSchedule:
    """Which faults a campaign injects, and when (see the module docstring).

    ``weights``: the chance of each kind (by default every kind alike; a kind with no target in
    the run is never picked). ``first``: when the first fault comes
    (default ``every``). ``stall_seconds`` / ``partition_seconds`` / ``delay_window``: the
    range a stall, a ``link_blip`` and a ``link_delay`` last (picked uniformly); ``link_cut``
    lasts ``cut_seconds``, past the heartbeat timeout; ``delay``: the range of the delay itself.
    ``only``: hit only these targets (node names such as ``"reward-0"``, units ``"unit-0"``).
    """

    every: float = attrs.field(default=20.0, validator=attrs.validators.gt(0))
    seed: int = 0
    weights: Mapping[FaultKind, float] = attrs.field(factory=_default_weights, converter=_weights)
    first: float | None = None
    stall_seconds: tuple[float, float] = attrs.field(default=(0.5, 3.0), converter=_span)
    partition_seconds: tuple[float, float] = attrs.field(default=(0.5, 3.0), converter=_span)
    cut_seconds: float = 2 * _HEARTBEAT
    delay_window: tuple[float, float] = attrs.field(default=(2.0, 6.0), converter=_span)
    delay: tuple[float, float] = attrs.field(default=(0.05, 0.3), converter=_span)
    only: frozenset[str] | None = attrs.field(
        default=None, converter=attrs.converters.optional(frozenset)
    )

    def plan(
        self, duration: float, targets: Mapping[FaultKind, Sequence[str]]
    ) -> tuple[PlannedFault, ...]:
        """The faults of ``duration`` seconds, given the targets of each kind: one every
        ``every`` seconds, the same plan for the same schedule and targets."""
        rng = random.Random(self.seed)
        if self.only is not None:
            targets = {k: [t for t in names if t in self.only] for k, names in targets.items()}
        kinds = sorted(k for k, w in self.weights.items() if w > 0 and targets.get(k))
        out: list[PlannedFault] = []
        at = self.every if self.first is None else self.first
        while kinds and at < duration:
            kind = rng.choices(kinds, weights=[self.weights[k] for k in kinds])[0]
            target = rng.choice(sorted(targets[kind]))
            delay = rng.uniform(*self.delay) if kind == "link_delay" else 0.0
            out.append(PlannedFault(at, kind, target, self._seconds(kind, rng), delay))
            at += self.every
        return tuple(out)

    def _seconds(self, kind: FaultKind, rng: random.Random) -> float:
        if kind == "stall":
            return rng.uniform(*self.stall_seconds)
        if kind == "link_blip":
            return rng.uniform(*self.partition_seconds)
        if kind == "link_cut":
            return self.cut_seconds
        if kind == "link_delay":
            return rng.uniform(*self.delay_window)
        return 0.0


def fault_targets(
    config: PipelineConfig, *, links: Collection[str] = ()
) -> dict[FaultKind, list[str]]:
    """What each fault kind can hit in a run of ``config``: the node processes of its roles
    (stations, the Trainer), its storage units when they run in processes, and the nodes in
    ``links`` (those ``open_link_faults`` proxies) for link faults."""
    from ..pipeline._config import DRIVER

    stations: list[str] = []
    trainer: list[str] = []
    for role, worker in config.instances():
        where = config.placement_of(role, worker)
        if where == DRIVER or where in config.placement.nodes:
            continue  # this process, or a node started by hand (nobody restarts it)
        roles_there = {r for r, w in config.instances() if config.placement_of(r, w) == where}
        bucket = trainer if "trainer" in roles_there else stations
        if role in (*STATIONS, "trainer") and where not in bucket:
            bucket.append(where)
    units = []
    if config.placement.tq_placement == "process":
        units = [f"unit-{i}" for i in range(config.placement.tq_units)]
    return {
        "kill_role": stations,
        "kill_trainer": trainer,
        "kill_unit": units,
        "stall": stations + units,
        "link_cut": list(links),
        "link_blip": list(links),
        "link_delay": list(links),
    }


def roles_at(config: PipelineConfig) -> dict[str, tuple[str, ...]]:
    """What each process a fault can hit in a run of ``config`` holds: node name -> the
    workers placed there and the stations folded into them (``placement.roles.actor_fwd =
    "trainer"``: the Trainer computes the old log-probs, so its process holds ActorForward's
    work; ``advantage = "actor_fwd"`` or ``"trainer"`` likewise), ``"unit-N"`` -> the storage
    unit. A kill of that process is a kill of each of them."""
    from ..pipeline._config import DRIVER

    out: dict[str, list[str]] = {}
    for role, worker in config.instances():
        where = config.placement_of(role, worker)
        if where == DRIVER:
            continue
        held = out.setdefault(where, [])
        held.append(worker)
        if role == "trainer":
            held += [f"{r}-0" for r, folded in (("actor_fwd", config.trainer_forward),
                                                 ("advantage", config.trainer_advantage))
                     if folded]  # fmt: skip
        if role == "actor_fwd" and config.fused_advantage:
            held.append(f"advantage-{worker.rpartition('-')[2]}")
    if config.placement.tq_placement == "process":
        out |= {f"unit-{i}": [f"unit-{i}"] for i in range(config.placement.tq_units)}
    return {name: tuple(held) for name, held in out.items()}


def target_node(config: PipelineConfig, name: str) -> str:
    """The process a fault meant for ``name`` hits in a run of ``config``: ``name`` itself for
    a node or a storage unit; for a station folded into another role (``"actor_fwd-0"`` with
    ``placement.roles.actor_fwd = "trainer"``), the node of the process that holds it.
    ``ValueError`` if no process of the run holds ``name``."""
    held = roles_at(config)
    if name in held:
        return name
    for node, workers in held.items():
        if name in workers:
            return node
    known = sorted({w for workers in held.values() for w in workers} | set(held))
    raise ValueError(f"no process of this run holds {name!r}; known: {', '.join(known)}")


def node_base_name(name: str) -> str:
    """The configured name of a run's node from the name its link is opened under: a role's
    node ``"rollout-0.<run>"`` -> ``"rollout-0"``, a storage unit's ``"tq.<run>-unit-1"`` ->
    ``"unit-1"``."""
    if name.startswith("tq.") and "-unit-" in name:
        return "unit-" + name.rpartition("-unit-")[2]
    return name.rpartition(".")[0] if "." in name else name


@contextlib.asynccontextmanager
async def open_link_faults(
    system: NodeSystem, config: PipelineConfig, *, seed: int = 0
) -> AsyncIterator[dict[str, LinkProxy]]:
    """One ``LinkProxy`` per node process of a run of ``config`` (its roles' nodes, its storage
    units'), through which ``system`` opens its links to that node, restarts included: a dict
    node name -> proxy. Open it before ``open_pipeline``; links opened before are not routed.
    Only the links this process opens go through them (not the nodes' links to each other)."""
    names = sorted({t for kind in ("kill_role", "kill_trainer", "kill_unit")
                    for t in fault_targets(config)[kind]})  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        proxies: dict[str, LinkProxy] = {}
        for i, name in enumerate(names):
            proxies[name] = await stack.enter_async_context(open_link_proxy(seed=seed + i))
        mesh = system.mesh
        previous = mesh.route

        def route(name: str, endpoint: str) -> str:
            if previous is not None:
                endpoint = previous(name, endpoint)
            proxy = proxies.get(node_base_name(name))
            return endpoint if proxy is None else proxy.relay(endpoint)

        mesh.route = route
        try:
            yield proxies
        finally:
            if mesh.route is route:
                mesh.route = previous


@attrs.frozen
class InjectedFault:
    """A fault carried out: the plan's ``fault``, the ``at`` (``trio.current_time()``) it
    began, and what was done (``detail``: the pid killed, the delay...)."""

    fault: PlannedFault
    at: float
    detail: str


class FaultCampaign:
    """A plan being carried out against a run (from ``open_fault_campaign``)."""

    def __init__(
        self,
        system: NodeSystem,
        run: Pipeline,
        plan: Sequence[PlannedFault],
        links: Mapping[str, LinkProxy],
    ) -> None:
        self.system = system
        self.run = run
        self.plan = tuple(plan)
        self.links = dict(links)
        self.injected: list[InjectedFault] = []
        self.skipped: list[tuple[PlannedFault, str]] = []  # (fault, why it could not be done)
        self.pids: set[int] = set()  # every node process seen (to check none outlives the run)
        self.killed: set[int] = set()  # never hit twice: a fault waits for the next process
        self.held = roles_at(run.config)  # what a kill of each target hits
        self.started = 0.0
        self._done = trio.Event()

    async def wait(self) -> None:
        """Until every fault of the plan was carried out and those that last have ended."""
        await self._done.wait()

    def counts(self) -> dict[str, int]:
        """Faults injected, by kind."""
        out: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        for item in self.injected:
            out[item.fault.kind] += 1
        return out

    def step_times(self) -> list[float]:
        """When each step of the run completed (``trio.current_time()``)."""
        run = self.run
        return [run.started + r.seconds - run.seconds_before for r in run.records]

    def recovery_seconds(self) -> list[float]:
        """For each injected fault, the seconds from it to the next step completed after it
        (``math.inf`` when none came)."""
        steps = self.step_times()
        out = []
        for item in self.injected:
            after = [t for t in steps if t > item.at]
            out.append(min(after) - item.at if after else math.inf)
        return out

    async def _carry_out(self) -> None:
        self.started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for fault in self.plan:
                await trio.sleep_until(self.started + fault.at)
                nursery.start_soon(self._one, fault)
        self._done.set()

    async def _one(self, fault: PlannedFault) -> None:
        try:
            if fault.kind in LINK_KINDS:
                await self._link(fault)
                return
            pid = await self._pid(fault.target)
            self.pids.add(pid)
            if fault.kind == "stall":
                await self._stall(fault, pid)
            else:
                kill9(pid)
                self.killed.add(pid)
                held = ", ".join(self.held.get(fault.target, (fault.target,)))
                detail = f"pid {pid}: {held}"
                self.injected.append(InjectedFault(fault, trio.current_time(), detail))
        except _Skip as skip:
            self.skipped.append((fault, str(skip)))

    async def _stall(self, fault: PlannedFault, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.injected.append(InjectedFault(fault, trio.current_time(), f"pid {pid} stopped"))
        try:
            await trio.sleep(fault.seconds)
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)

    async def _link(self, fault: PlannedFault) -> None:
        proxy = self.links.get(fault.target)
        if proxy is None:
            raise _Skip(f"no link proxy for {fault.target!r}")
        now = trio.current_time()
        if fault.kind == "link_delay":
            rule = LinkRule("delay", seconds=fault.delay, jitter=fault.delay / 2)
            proxy.add_rule(rule)
            self.injected.append(InjectedFault(fault, now, f"delay {fault.delay:.2f}s"))
            try:
                await trio.sleep(fault.seconds)
            finally:
                proxy.clear_rules()
            return
        hold = fault.kind == "link_blip"
        proxy.partition(fault.seconds, hold=hold)
        self.injected.append(InjectedFault(fault, now, f"partition {fault.seconds:.2f}s"))
        await trio.sleep(fault.seconds)

    async def _pid(self, target: str) -> int:
        """The process of ``target`` once it runs (a node restarting has none yet; one this
        campaign killed is not counted twice: the fault waits for its successor)."""
        with trio.move_on_after(30):
            while True:
                pid = await self._pid_now(target)
                if pid is not None and pid not in self.killed and alive(pid):
                    return pid
                await trio.sleep(0.1)
        raise _Skip(f"{target!r} had no process for 30 s")

    async def _pid_now(self, target: str) -> int | None:
        if target in self.run.nodes:
            return self.run.nodes[target].pid
        queue = self.run.queue
        if queue is None or target not in queue.units:
            raise _Skip(f"no node or storage unit {target!r} in this run")
        with trio.move_on_after(5):
            return (await queue.unit_pids()).get(target)
        return None


class _Skip(Exception):
    """A planned fault that could not be carried out (its target gone or restarting)."""


@contextlib.asynccontextmanager
async def open_fault_campaign(
    system: NodeSystem,
    run: Pipeline,
    schedule: FaultSchedule,
    *,
    duration: float,
    links: Mapping[str, LinkProxy] | None = None,
) -> AsyncIterator[FaultCampaign]:
    """Carry out ``schedule`` for ``duration`` seconds against ``run`` (from ``open_pipeline``
    under ``system``) in the background of the block; ``links``: the proxies of
    ``open_link_faults`` (without them, no link fault is planned). Leaving the block ends
    every fault still under way (processes continued, partitions healed, delays cleared)."""
    plan = schedule.plan(duration, fault_targets(run.config, links=links or {}))
    campaign = FaultCampaign(system, run, plan, links or {})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(campaign._carry_out)
        try:
            yield campaign
        finally:
            nursery.cancel_scope.cancel()
            for proxy in campaign.links.values():
                proxy.clear_rules()
                proxy.heal()

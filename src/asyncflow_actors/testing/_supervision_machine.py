"""``SupervisionMachine``: the actor runtime's supervision checked against ``SupervisionModel``.

Random trees (``supervision_trees``) take random schedules of crashes, normal exits, explicit
stops, tells, asks, concurrent bursts, clock jumps and workers getting stuck in a handler (whose
stops then take their grace and end in a kill). After every step, once the virtual time the
model says it takes has passed, the lifecycle log the actors wrote must equal the model's (the
kills included), live actors and restart counts must match, and no helper task may outlive its
actor. Subclass it and override ``make_supervisor`` to check a
``Supervisor`` subclass of your own against the same promises::

    class MySupervisorMachine(SupervisionMachine):
        def make_supervisor(self, log, children, strategy):
            return MySupervisor(log, children, strategy)   # must log like LoggingSupervisor

    TestMine = MySupervisorMachine.TestCase
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import trio
import trio.lowlevel
import trio.testing
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ..actors import (
    Actor,
    ActorContext,
    ActorCrashed,
    ActorKilled,
    ActorRef,
    ActorState,
    ChildSpec,
    Request,
    Strategy,
    Supervisor,
)
from ._machine import ActorMachine
from ._supervision import ModelNode, SupervisionModel, supervision_trees
from ._time import Attempt, Blocked, Raised, Returned, advance, attempt

# -- the actors under test ----------------------------------------------------------------------


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Tagged:
    sender: int
    seq: int


@attrs.frozen
class Get(Request[int]):
    pass


@attrs.frozen
class Seqs(Request[dict[int, list[int]]]):
    pass


@attrs.frozen
class Crash(Request[None]):
    pass


@attrs.frozen
class Exit:
    pass


@attrs.frozen
class Hang:
    """Block in ``receive`` for good (a handler stuck on a dead peer, an endless loop)."""


WorkerMsg = Add | Tagged | Get | Seqs | Crash | Exit | Hang


class LifecycleLog:
    """What the actors report: ``lines`` (``"start <path>"``, ``"stop <path>"``), the paths
    whose incarnation was killed (``on_stop`` got ``ActorKilled``), in order, and the paths whose
    helper task is running."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.killed: list[str] = []
        self.helpers: set[str] = set()

    def stopped(self, path: str, error: BaseException | None) -> None:
        """Log the stop of ``path`` (from its ``on_stop``)."""
        if isinstance(error, ActorKilled):
            self.killed.append(path)
        self.lines.append(f"stop {path}")


class LoggingWorker(Actor[WorkerMsg]):
    """Counts, records tagged sequences, crashes, exits or hangs on request; logs its
    lifecycle."""

    def __init__(self, log: LifecycleLog) -> None:
        self.log = log
        self.count = 0
        self.seqs: dict[int, list[int]] = {}

    async def on_start(self, ctx: ActorContext[WorkerMsg]) -> None:
        self.log.lines.append(f"start {ctx.name}")
        ctx.start_soon(self.helper, ctx.name)

    async def helper(self, name: str) -> None:
        self.log.helpers.add(name)
        try:
            await trio.sleep_forever()
        finally:
            self.log.helpers.discard(name)

    async def receive(self, msg: WorkerMsg, ctx: ActorContext[WorkerMsg]) -> Any:
        if isinstance(msg, Add):
            self.count += msg.n
        elif isinstance(msg, Tagged):
            self.seqs.setdefault(msg.sender, []).append(msg.seq)
            await trio.lowlevel.checkpoint()  # let the other sender interleave
        elif isinstance(msg, Get):
            return self.count
        elif isinstance(msg, Seqs):
            return self.seqs
        elif isinstance(msg, Crash):
            raise RuntimeError(f"crash {ctx.name}")
        elif isinstance(msg, Exit):
            ctx.stop_self()
        elif isinstance(msg, Hang):
            await trio.sleep_forever()
        return None

    async def on_stop(self, ctx: ActorContext[WorkerMsg], error: BaseException | None) -> None:
        self.log.stopped(ctx.name, error)


class LoggingSupervisor(Supervisor):
    """A ``Supervisor`` that logs its own start and stop like the workers do."""

    def __init__(self, log: LifecycleLog, children: list[ChildSpec], strategy: Strategy) -> None:
        super().__init__(children, strategy)
        self.log = log

    async def on_start(self, ctx: ActorContext[Any]) -> None:
        self.log.lines.append(f"start {ctx.name}")
        await super().on_start(ctx)

    async def on_stop(self, ctx: ActorContext[Any], error: BaseException | None) -> None:
        self.log.stopped(ctx.name, error)


# -- the machine ----------------------------------------------------------------------------------


class SupervisionMachine(ActorMachine):
    """Supervision trees against ``SupervisionModel`` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.log = LifecycleLog()
        self.model: SupervisionModel | None = None

    def make_supervisor(
        self, log: LifecycleLog, children: list[ChildSpec], strategy: Strategy
    ) -> Supervisor:
        """The supervisor actor of one (re)start; override to test your own."""
        return LoggingSupervisor(log, children, strategy)

    def spec(self, node: ModelNode) -> ChildSpec:
        """The ``ChildSpec`` that builds ``node`` (and, for a supervisor, its subtree)."""
        log = self.log
        if node.strategy is None:
            return ChildSpec(
                lambda: LoggingWorker(log), node.name, restart=node.restart, shutdown=node.shutdown
            )
        specs = [self.spec(child) for child in node.blueprint]
        strategy = node.strategy
        return ChildSpec(
            lambda: self.make_supervisor(log, specs, strategy), node.name, restart=node.restart
        )

    @initialize(tree=supervision_trees())
    def build(self, tree: ModelNode) -> None:
        self.model = SupervisionModel(tree, default_grace=self.shutdown_grace)
        self.model.start(tree)
        spec = self.spec(tree)

        async def spawn() -> None:
            await self.system.spawn(spec.factory, name="top")

        self.run(spawn)
        self.check_log()

    # -- helpers ------------------------------------------------------------------------------------

    def check_log(self) -> None:
        assert self.model is not None
        assert self.log.lines == self.model.log, (
            f"lifecycle {self.log.lines}, the model expects {self.model.log}"
        )
        assert self.log.killed == self.model.killed, (
            f"killed {self.log.killed}, the model expects {self.model.killed}"
        )
        self.log.lines.clear()
        self.log.killed.clear()
        self.model.log.clear()
        self.model.killed.clear()

    def let_time_pass(self, since: float) -> None:
        """Advance the clock to the model's ``now`` (stuck workers' stops take their graces)."""
        assert self.model is not None
        if self.model.now > since:
            self.advance(self.model.now - since)

    async def within(self, seconds: float, fn: Any, *args: Any) -> Attempt[Any]:
        """Like ``attempt``, while ``seconds`` of virtual time pass (timers fire on the way)."""
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        result: list[Attempt[Any]] = []

        async def go() -> None:
            try:
                result.append(Returned(await fn(*args)))
            except Exception as exc:
                result.append(Raised(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(go)
            await advance(clock, seconds)
            if not result:
                nursery.cancel_scope.cancel()
        return result[0] if result else Blocked()

    def ref(self, node: ModelNode) -> ActorRef[Any]:
        ref = self.system.whereis(node.path)
        assert ref is not None, f"{node.path} should be alive"
        return ref

    def workers(self) -> list[ModelNode]:
        """The live workers that answer (not stuck)."""
        return self.model.responsive() if self.model is not None else []

    def has_workers(self) -> bool:
        return bool(self.workers())

    def pick(self, data: st.DataObject, nodes: list[ModelNode]) -> ModelNode:
        return data.draw(st.sampled_from(sorted(nodes, key=lambda n: n.path)))

    # -- rules ----------------------------------------------------------------------------------

    @precondition(has_workers)
    @rule(data=st.data())
    def crash_worker(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.workers())
        result = self.run(attempt, self.ref(node).ask, Crash())
        assert isinstance(result, Raised) and isinstance(result.error, ActorCrashed), result
        since = self.model.now
        self.model.crashed(node)
        self.let_time_pass(since)
        self.check_log()

    @precondition(has_workers)
    @rule(data=st.data())
    def exit_worker(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.workers())
        self.run(self.ref(node).send, Exit())
        since = self.model.now
        self.model.exited(node)
        self.let_time_pass(since)
        self.check_log()

    @precondition(lambda self: self.model is not None and len(self.model.live()) > 1)
    @rule(data=st.data())
    def stop_actor(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.model.live()[1:])  # not the top
        ref = self.ref(node)
        since = self.model.now
        self.model.stopped_for_good(node)
        # bounded: a stop takes exactly the graces of the stuck workers it kills
        result = self.run(self.within, self.model.now - since, ref.stop)
        assert result == Returned(None), f"stopping {node.path}: {result}"
        self.check_log()
        if not node.is_supervisor:
            result = self.run(attempt, ref.ask, Get())
            assert isinstance(result, Raised) and isinstance(result.error, ActorCrashed), result

    @precondition(has_workers)
    @rule(data=st.data())
    def hang_worker(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.workers())
        self.run(self.ref(node).send, Hang())
        self.model.hung(node)

    @precondition(has_workers)
    @rule(data=st.data(), n=st.integers(1, 5))
    def tell_then_ask(self, data: st.DataObject, n: int) -> None:
        node = self.pick(data, self.workers())
        ref = self.ref(node)
        self.run(ref.send, Add(n))
        node.count += n
        result = self.run(attempt, ref.ask, Get())
        assert not isinstance(result, Blocked), "an ask hung"
        assert result == Returned(node.count)

    @precondition(has_workers)
    @rule(data=st.data(), n=st.integers(1, 20))
    def concurrent_burst_keeps_per_sender_fifo(self, data: st.DataObject, n: int) -> None:
        node = self.pick(data, self.workers())
        ref = self.ref(node)

        async def burst() -> dict[int, list[int]]:
            async with trio.open_nursery() as nursery:
                for sender in range(2):

                    async def go(sender: int = sender) -> None:
                        for seq in range(n):
                            await ref.send(Tagged(sender, seq))

                    nursery.start_soon(go)
            seqs: dict[int, list[int]] = await ref.ask(Seqs())
            return seqs

        seqs = self.run(burst)
        for sender in range(2):
            assert seqs[sender][-n:] == list(range(n))

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
    def advance_time(self, dt: float) -> None:
        assert self.model is not None
        self.advance(dt)
        self.model.advance(dt)

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def live_actors_match_the_model(self) -> None:
        if self.model is None:
            return
        live = {n.path: n for n in self.model.live()}
        actual = {s.name: s for s in self.system.statistics().actors}
        assert set(actual) == set(live)
        for path, node in live.items():
            assert actual[path].state is ActorState.RUNNING, path
            assert actual[path].restarts == node.restarts, path

    @invariant()
    def no_helper_task_outlives_its_actor(self) -> None:
        if self.model is not None:
            assert self.log.helpers == {n.path for n in self.model.workers()}

    def teardown(self) -> None:
        failing = sys.exc_info()[1] is not None
        super().teardown()
        if self.model is not None and not failing:
            if self.model.top is not None:
                self.model.stop(self.model.top)
            assert self.log.lines == self.model.log  # the system stops in reverse
            assert self.log.killed == self.model.killed  # only stuck workers are killed
            assert self.log.helpers == set()

"""A hypothesis state machine for supervision trees.

Random trees (a top supervisor with workers and possibly a nested supervisor, random strategies,
intensities and restart types) take random schedules of crashes, normal exits, explicit stops,
tells, asks, concurrent bursts and clock jumps. A plain-Python model predicts the exact lifecycle
log (every start and stop, in order), restart counts, counters and which actors are alive. The
actor system runs in a helper thread under a ``MockClock`` that only moves when a rule moves it.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
import trio.lowlevel
import trio.testing
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import asyncflow_actors as afa

T = TypeVar("T")

# -- the actors under test --------------------------------------------------------------------


@attrs.frozen
class Add:
    n: int


@attrs.frozen
class Tagged:
    sender: int
    seq: int


@attrs.frozen
class Get(afa.Request[int]):
    pass


@attrs.frozen
class Seqs(afa.Request[dict[int, list[int]]]):
    pass


@attrs.frozen
class Crash(afa.Request[None]):
    pass


@attrs.frozen
class Exit:
    pass


WorkerMsg = Add | Tagged | Get | Seqs | Crash | Exit


class World:
    """What the actors report back: the lifecycle log and live helper tasks."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.helpers: set[str] = set()


class Worker(afa.Actor[WorkerMsg]):
    def __init__(self, world: World) -> None:
        self.world = world
        self.count = 0
        self.seqs: dict[int, list[int]] = {}

    async def on_start(self, ctx: afa.ActorContext[WorkerMsg]) -> None:
        self.world.log.append(f"start {ctx.name}")
        ctx.start_soon(self.helper, ctx.name)

    async def helper(self, name: str) -> None:
        self.world.helpers.add(name)
        try:
            await trio.sleep_forever()
        finally:
            self.world.helpers.discard(name)

    async def receive(self, msg: WorkerMsg, ctx: afa.ActorContext[WorkerMsg]) -> Any:
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
        return None

    async def on_stop(self, ctx: afa.ActorContext[WorkerMsg], error: BaseException | None) -> None:
        self.world.log.append(f"stop {ctx.name}")


class LoggingSupervisor(afa.Supervisor):
    def __init__(self, world: World, children: list[afa.ChildSpec], strategy: afa.Strategy) -> None:
        super().__init__(children, strategy)
        self.world = world

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        self.world.log.append(f"start {ctx.name}")
        await super().on_start(ctx)

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        self.world.log.append(f"stop {ctx.name}")


# -- the model -------------------------------------------------------------------------------


@attrs.define(eq=False)
class Node:
    """A blueprint (for restarts) plus the model's live state of one actor."""

    name: str
    path: str
    restart: afa.Restart
    strategy: afa.Strategy | None = None  # None: a worker
    blueprint: list[Node] = attrs.Factory(list)
    children: list[Node] = attrs.Factory(list)
    parent: Node | None = attrs.field(default=None, repr=False)
    restarts: int = 0
    count: int = 0
    times: list[float] = attrs.Factory(list)

    @property
    def is_sup(self) -> bool:
        return self.strategy is not None

    def spec(self, world: World) -> afa.ChildSpec:
        if self.strategy is None:
            return afa.ChildSpec(lambda: Worker(world), self.name, restart=self.restart)
        specs = [child.spec(world) for child in self.blueprint]
        strategy = self.strategy
        return afa.ChildSpec(
            lambda: LoggingSupervisor(world, specs, strategy), self.name, restart=self.restart
        )


class Model:
    def __init__(self, top: Node) -> None:
        self.top: Node | None = top
        self.now = 0.0
        self.log: list[str] = []

    def fresh(self, node: Node) -> None:
        """A new incarnation: a worker's count resets; a supervisor gets new children."""
        node.count = 0
        node.times = []
        node.children = []
        for child in node.blueprint:
            copy = attrs.evolve(
                child, blueprint=child.blueprint, children=[], restarts=0, count=0, times=[]
            )
            copy.parent = node
            node.children.append(copy)

    def start(self, node: Node) -> None:
        self.fresh(node)
        self.log.append(f"start {node.path}")
        for child in node.children:
            self.start(child)

    def stop(self, node: Node) -> None:
        for child in reversed(node.children):
            self.stop(child)
        self.log.append(f"stop {node.path}")

    def live(self) -> list[Node]:
        out: list[Node] = []

        def walk(node: Node) -> None:
            out.append(node)
            for child in node.children:
                walk(child)

        if self.top is not None:
            walk(self.top)
        return out

    def remove(self, node: Node) -> None:
        if node.parent is None:
            self.top = None
        else:
            node.parent.children.remove(node)

    def ended(self, node: Node, crashed: bool) -> None:
        """``node`` has already logged its stop; apply its parent's supervision."""
        sup = node.parent
        if sup is None:  # the top is TEMPORARY under the root
            self.top = None
            return
        assert sup.strategy is not None
        if node.restart is afa.Restart.TEMPORARY or (
            node.restart is afa.Restart.TRANSIENT and not crashed
        ):
            sup.children.remove(node)
            return
        sup.times = [t for t in sup.times if t > self.now - sup.strategy.within] + [self.now]
        if len(sup.times) > sup.strategy.max_restarts:
            # the supervisor gives up: stops the rest in reverse, then itself
            for child in reversed(sup.children):
                if child is not node:
                    self.stop(child)
            self.log.append(f"stop {sup.path}")
            self.ended(sup, crashed=True)
            return
        index = sup.children.index(node)
        if isinstance(sup.strategy, afa.OneForAll):
            affected = list(sup.children)
        elif isinstance(sup.strategy, afa.RestForOne):
            affected = sup.children[index:]
        else:
            affected = [node]
        for other in reversed(affected):
            if other is not node:
                self.stop(other)
        for other in affected:
            other.restarts += 1
            self.start(other)


# -- the harness: an actor system in a helper thread ------------------------------------------


class Harness:
    def __init__(self) -> None:
        self.clock = trio.testing.MockClock()
        self.world = World()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main, clock=self.clock)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        async with afa.open_actor_system() as system:
            self.system = system
            self._ready.set()
            await self._done.wait()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def settled() -> T:
            result = await fn(*args)
            await trio.testing.wait_all_tasks_blocked()
            return result

        return trio.from_thread.run(settled, trio_token=self.token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._done.set, trio_token=self.token)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the actor system did not shut down"
        if self._error is not None:
            raise self._error


async def ask_or_hang(ref: afa.ActorRef[Any], request: afa.Request[Any]) -> tuple[str, Any]:
    """Ask; report ``("hung", None)`` if the ask is still pending once everything is idle."""
    out: list[tuple[str, Any]] = []

    async def go() -> None:
        try:
            out.append(("ok", await ref.ask(request)))
        except afa.ActorCrashed as exc:
            out.append(("crashed", exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(go)
        await trio.testing.wait_all_tasks_blocked()
        if not out:
            nursery.cancel_scope.cancel()
            return ("hung", None)
    return out[0]


# -- the state machine --------------------------------------------------------------------------

STRATEGIES = [afa.OneForOne, afa.OneForAll, afa.RestForOne]
restarts = st.sampled_from(list(afa.Restart))


@st.composite
def strategies(draw: st.DrawFn) -> afa.Strategy:
    kind = draw(st.sampled_from(STRATEGIES))
    return kind(max_restarts=draw(st.integers(0, 3)), within=draw(st.sampled_from([2.0, 10.0])))


@st.composite
def trees(draw: st.DrawFn) -> Node:
    top = Node("top", "top", afa.Restart.TEMPORARY, strategy=draw(strategies()))
    has_sub = draw(st.booleans())
    n_workers = draw(st.integers(1, 3))
    names = [f"w{i}" for i in range(n_workers)]
    position = draw(st.integers(0, n_workers)) if has_sub else -1
    for i in range(n_workers + (1 if has_sub else 0)):
        if i == position:
            sub = Node("sub", "top/sub", draw(restarts), strategy=draw(strategies()))
            for j in range(draw(st.integers(1, 3))):
                sub.blueprint.append(Node(f"x{j}", f"top/sub/x{j}", draw(restarts)))
            top.blueprint.append(sub)
        else:
            name = names.pop(0)
            top.blueprint.append(Node(name, f"top/{name}", draw(restarts)))
    return top


class SupervisionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.harness = Harness()
        self.model: Model | None = None

    @initialize(tree=trees())
    def build(self, tree: Node) -> None:
        self.model = Model(tree)
        self.model.start(tree)
        spec = tree.spec(self.harness.world)

        async def spawn() -> None:
            await self.harness.system.spawn(spec.factory, name="top")

        self.harness.run(spawn)
        self.check_log()

    # helpers

    def check_log(self) -> None:
        assert self.model is not None
        assert self.harness.world.log == self.model.log
        self.harness.world.log.clear()
        self.model.log.clear()

    def ref(self, node: Node) -> afa.ActorRef[Any]:
        ref = self.harness.system.whereis(node.path)
        assert ref is not None, f"{node.path} should be alive"
        return ref

    def workers(self) -> list[Node]:
        return [n for n in self.model.live() if not n.is_sup] if self.model else []

    def has_workers(self) -> bool:
        return bool(self.workers())

    def pick(self, data: st.DataObject, nodes: list[Node]) -> Node:
        return data.draw(st.sampled_from(sorted(nodes, key=lambda n: n.path)))

    # rules

    @precondition(has_workers)
    @rule(data=st.data())
    def crash_worker(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.workers())
        status, value = self.harness.run(ask_or_hang, self.ref(node), Crash())
        assert status == "crashed", (status, value)
        self.model.log.append(f"stop {node.path}")
        self.model.ended(node, crashed=True)
        self.check_log()

    @precondition(has_workers)
    @rule(data=st.data())
    def exit_worker(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.workers())

        async def send() -> None:
            await self.ref(node).send(Exit())

        self.harness.run(send)
        self.model.log.append(f"stop {node.path}")
        self.model.ended(node, crashed=False)
        self.check_log()

    @precondition(lambda self: self.model is not None and len(self.model.live()) > 1)
    @rule(data=st.data())
    def stop_actor(self, data: st.DataObject) -> None:
        assert self.model is not None
        node = self.pick(data, self.model.live()[1:])  # not the top
        ref = self.ref(node)
        self.harness.run(ref.stop)
        self.model.stop(node)
        self.model.remove(node)
        self.check_log()
        status, _ = (
            self.harness.run(ask_or_hang, ref, Get()) if not node.is_sup else ("crashed", None)
        )
        assert status == "crashed"

    @precondition(has_workers)
    @rule(data=st.data(), n=st.integers(1, 5))
    def tell_then_ask(self, data: st.DataObject, n: int) -> None:
        node = self.pick(data, self.workers())
        ref = self.ref(node)

        async def send() -> None:
            await ref.send(Add(n))

        self.harness.run(send)
        node.count += n
        status, value = self.harness.run(ask_or_hang, ref, Get())
        assert (status, value) == ("ok", node.count)

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
            return await ref.ask(Seqs())

        seqs = self.harness.run(burst)
        for sender in range(2):
            assert seqs[sender][-n:] == list(range(n))

    @rule(dt=st.sampled_from([0.5, 3.0, 11.0]))
    def advance_time(self, dt: float) -> None:
        assert self.model is not None

        async def jump() -> None:
            self.harness.clock.jump(dt)

        self.harness.run(jump)
        self.model.now += dt

    # invariants

    @invariant()
    def live_actors_match_the_model(self) -> None:
        if self.model is None:
            return
        live = {n.path: n for n in self.model.live()}
        actual = {s.name: s for s in self.harness.system.statistics().actors}
        assert set(actual) == set(live)
        for path, node in live.items():
            assert actual[path].state is afa.ActorState.RUNNING, path
            assert actual[path].restarts == node.restarts, path

    @invariant()
    def no_helper_task_outlives_its_actor(self) -> None:
        if self.model is not None:
            assert self.harness.world.helpers == {n.path for n in self.workers()}

    def teardown(self) -> None:
        self.harness.close()
        if self.model is not None:
            if self.model.top is not None:
                self.model.stop(self.model.top)
            assert self.harness.world.log == self.model.log  # the system stops in reverse
            assert self.harness.world.helpers == set()


SupervisionMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)
TestSupervision = SupervisionMachine.TestCase

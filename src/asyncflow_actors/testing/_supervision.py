"""A plain-Python model of OTP supervision, and a hypothesis strategy of supervision trees.

``SupervisionModel`` predicts, for a tree of supervisors and workers, the exact lifecycle log
(every ``start``/``stop``, in order), each actor's restart count and which actors are alive,
after crashes, normal exits, explicit stops and the passing of time (restart intensity). It
states the semantics of ``docs/actors.md`` in a hundred lines; ``SupervisionMachine`` checks the
runtime against it, and a user who writes a ``Supervisor`` subclass can check theirs.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from ..actors import OneForAll, OneForOne, Restart, RestForOne, Strategy


@attrs.define(eq=False)
class ModelNode:
    """One actor of the model: a blueprint (for restarts) plus its live state.

    ``strategy is None`` for a worker. ``children`` are the live children of the current
    incarnation, ``blueprint`` what each (re)start creates. ``shutdown`` is a worker's grace
    (``None``: the system's), ``stuck`` whether its current incarnation is busy for good.
    """

    name: str
    path: str
    restart: Restart
    strategy: Strategy | None = None
    blueprint: list[ModelNode] = attrs.Factory(list)
    children: list[ModelNode] = attrs.Factory(list)
    parent: ModelNode | None = attrs.field(default=None, repr=False)
    restarts: int = 0
    count: int = 0  # a worker's counter (reset by a restart)
    times: list[float] = attrs.Factory(list)  # a supervisor's recent restarts
    shutdown: float | None = None
    stuck: bool = False

    @property
    def is_supervisor(self) -> bool:
        return self.strategy is not None


class SupervisionModel:
    """The expected behaviour of a supervision tree (``docs/actors.md``, *Supervision*).

    ``log`` accumulates the expected ``"start <path>"``/``"stop <path>"`` lines and ``killed``
    the paths killed on the way; compare them with what the actors logged and clear both.
    ``now`` is the virtual time (restart intensity); stopping stuck workers moves it by their
    graces (``default_grace`` for a worker without one), so an operation takes ``now`` after
    minus ``now`` before.
    """

    def __init__(self, top: ModelNode, *, default_grace: float = 5.0) -> None:
        self.top: ModelNode | None = top
        self.default_grace = default_grace
        self.now = 0.0
        self.log: list[str] = []
        self.killed: list[str] = []

    def fresh(self, node: ModelNode) -> None:
        """A new incarnation: a worker's count resets, it is not stuck; a supervisor gets new
        children."""
        node.count = 0
        node.times = []
        node.stuck = False
        node.children = []
        for child in node.blueprint:
            copy = attrs.evolve(child, children=[], restarts=0, count=0, times=[], stuck=False)
            copy.parent = node
            node.children.append(copy)

    def start(self, node: ModelNode) -> None:
        """``node`` starts: it, then its children in order."""
        self.fresh(node)
        self.log.append(f"start {node.path}")
        for child in node.children:
            self.start(child)

    def stop(self, node: ModelNode) -> None:
        """``node`` stops: its children in reverse order, then it (a stuck worker after its
        grace, killed; its ``on_stop`` still runs)."""
        for child in reversed(node.children):
            self.stop(child)
        if node.stuck:
            self.now += node.shutdown if node.shutdown is not None else self.default_grace
            self.killed.append(node.path)
        self.log.append(f"stop {node.path}")

    def live(self) -> list[ModelNode]:
        """Every live actor, depth first from the top."""
        out: list[ModelNode] = []

        def walk(node: ModelNode) -> None:
            out.append(node)
            for child in node.children:
                walk(child)

        if self.top is not None:
            walk(self.top)
        return out

    def workers(self) -> list[ModelNode]:
        return [n for n in self.live() if not n.is_supervisor]

    def responsive(self) -> list[ModelNode]:
        """The live workers that are not stuck."""
        return [n for n in self.workers() if not n.stuck]

    def remove(self, node: ModelNode) -> None:
        """``node`` was stopped for good (``ref.stop()``): it is gone, nobody restarts it."""
        if node.parent is None:
            self.top = None
        else:
            node.parent.children.remove(node)

    def stopped_for_good(self, node: ModelNode) -> None:
        """``ref.stop()`` of ``node``: log its stop (children first) and remove it."""
        self.stop(node)
        self.remove(node)

    def hung(self, node: ModelNode) -> None:
        """A worker got stuck in a handler: it answers nothing until it is stopped."""
        node.stuck = True

    def crashed(self, node: ModelNode) -> None:
        """A worker crashed: log its stop and apply its parent's supervision."""
        self.log.append(f"stop {node.path}")
        self.ended(node, crashed=True)

    def exited(self, node: ModelNode) -> None:
        """A worker exited normally (``ctx.stop_self()``)."""
        self.log.append(f"stop {node.path}")
        self.ended(node, crashed=False)

    def ended(self, node: ModelNode, crashed: bool) -> None:
        """``node`` has already logged its stop; apply its parent's supervision."""
        sup = node.parent
        if sup is None:  # the top is TEMPORARY under the root
            self.top = None
            return
        assert sup.strategy is not None
        if node.restart is Restart.TEMPORARY or (node.restart is Restart.TRANSIENT and not crashed):
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
        if isinstance(sup.strategy, OneForAll):
            affected = list(sup.children)
        elif isinstance(sup.strategy, RestForOne):
            affected = sup.children[index:]
        else:
            affected = [node]
        for other in reversed(affected):
            if other is not node:
                self.stop(other)
        for other in affected:
            other.restarts += 1
            self.start(other)

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- strategies ---------------------------------------------------------------------------------

STRATEGY_KINDS: tuple[type[Strategy], ...] = (OneForOne, OneForAll, RestForOne)


@st.composite
def supervisor_strategies(draw: st.DrawFn) -> Strategy:
    """A random strategy with a small restart intensity (0 to 3 restarts within 2 or 10 s)."""
    kind = draw(st.sampled_from(STRATEGY_KINDS))
    return kind(max_restarts=draw(st.integers(0, 3)), within=draw(st.sampled_from([2.0, 10.0])))


@st.composite
def supervision_trees(draw: st.DrawFn, *, max_workers: int = 3) -> ModelNode:
    """A top supervisor (``"top"``, TEMPORARY under the root) with 1..``max_workers`` workers
    ``w0, w1...`` and maybe a nested supervisor ``sub`` (with workers ``x0...``) among them, at a
    random position; random strategies, intensities, restart types and workers' shutdown graces
    (the system's, 1 s or 2 s)."""
    restarts = st.sampled_from(list(Restart))
    graces = st.sampled_from([None, 1.0, 2.0])
    top = ModelNode("top", "top", Restart.TEMPORARY, strategy=draw(supervisor_strategies()))
    has_sub = draw(st.booleans())
    n_workers = draw(st.integers(1, max_workers))
    names = [f"w{i}" for i in range(n_workers)]
    position = draw(st.integers(0, n_workers)) if has_sub else -1
    for i in range(n_workers + (1 if has_sub else 0)):
        if i == position:
            sub = ModelNode(
                "sub", "top/sub", draw(restarts), strategy=draw(supervisor_strategies())
            )
            for j in range(draw(st.integers(1, max_workers))):
                sub.blueprint.append(
                    ModelNode(f"x{j}", f"top/sub/x{j}", draw(restarts), shutdown=draw(graces))
                )
            top.blueprint.append(sub)
        else:
            name = names.pop(0)
            top.blueprint.append(
                ModelNode(name, f"top/{name}", draw(restarts), shutdown=draw(graces))
            )
    return top

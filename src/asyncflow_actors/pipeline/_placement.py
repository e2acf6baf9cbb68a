"""Placement: the processes of a run and the role actors in them.

A role instance runs in this process (``"driver"``), in a local node process started for the run
(``system.start_node``), or on a node started by hand and reached by address
(``system.connect_node``). Every node first spawns ``Preload`` (its roles' modules, torch and
the run's transformers classes imported in a worker thread), then its roles; the nodes start
while this process loads its own roles (``start_soon``), and a role spawned on a node waits
for that node only. Moving a role between processes is a change of configuration only:
the role receives the same kwargs (its ``RunSpec`` and refs) wherever it runs.

With ``train.auto_resume`` the node that hosts the Trainer is supervised apart (a supervisor of
its own, ``trainer-node.<run>``, restarting it without limit, with a backoff): the resumer's
``train.auto_resume_retries`` bound the Trainer's deaths, and the root supervisor's restart
intensity (3 in 5 s by default), which counts the restarts of every node of the system, no
longer ends the run with ``SupervisorFailed`` when the Trainer is killed in quick succession.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import trio

from ..actors import (
    Actor,
    ActorContext,
    ActorCrashed,
    ActorRef,
    Backoff,
    OneForOne,
    Restart,
    StartChild,
    Supervisor,
    Terminated,
    root_error,
)
from ..actors.remote import (
    ConnectLauncher,
    GetNode,
    Launcher,
    Node,
    NodeSystem,
    SubprocessLauncher,
    node_spec,
)
from ..roles.preload import Preload
from ._config import DRIVER, PipelineConfig

ALLOW = ("asyncflow_actors",)
# the roles that load the policy model (a node hosting one preloads its transformers classes)
_MODEL_ROLES = frozenset({"rollout", "actor_fwd", "ref_fwd", "trainer"})
# the Trainer's node under auto-resume: restarted whatever the rate (the resumer's retries are
# the limit), after a pause that grows while it keeps dying (a node that cannot start does not
# spin)
_TRAINER_NODE = OneForOne(max_restarts=sys.maxsize, within=5.0, backoff=Backoff())


class RunFailed(RuntimeError):
    """A role of the run terminated for good: ``role`` (its worker name), ``error`` (also
    ``__cause__``): the exception behind it as its author raised it (``root_error``: not
    trio's group of one, not the supervisor's wrapper); ``None`` if it stopped."""

    def __init__(self, role: str, error: BaseException | None) -> None:
        self.role = role
        self.error = None if error is None else root_error(error)
        what = "stopped" if self.error is None else f"{type(self.error).__name__}: {self.error}"
        super().__init__(f"role {role!r} terminated: {what}")
        self.__cause__ = self.error

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.role, self.error))


class Watcher(Actor[Terminated]):
    """Watches the roles of a run; the first one to terminate for good fails the run."""

    def __init__(
        self, refs: list[ActorRef[Any]], failed: trio.Event, errors: list[BaseException]
    ) -> None:
        self.refs = refs
        self.failed = failed
        self.errors = errors

    async def on_start(self, ctx: ActorContext[Terminated]) -> None:
        for ref in self.refs:
            ctx.watch(ref)

    async def receive(self, msg: Terminated, ctx: ActorContext[Terminated]) -> None:
        await trio.lowlevel.checkpoint()
        # "rollout-0.<run>/rollout-0.<run>" (a node's actor): the worker's name
        error = RunFailed(msg.ref.name.rpartition("/")[2].partition(".")[0], msg.error)
        self.errors.append(error)
        self.failed.set()


class Placement:
    """The nodes of one run, and spawning role actors wherever the config puts them."""

    def __init__(self, system: NodeSystem, config: PipelineConfig, suffix: str) -> None:
        self.system = system
        self.config = config
        self.suffix = suffix
        self.nodes: dict[str, Node] = {}
        self.local: list[str] = []  # names of actors spawned in this process, in order
        self._ready: dict[str, trio.Event] = {}
        self._supervisors: list[ActorRef[Any]] = []  # the nodes supervised apart (stopped last)
        # called with each node once it is up, before any role is spawned on it (the observer
        # attaches there, so that it sees every span of the node's roles)
        self.on_node_up: Callable[[Node], Awaitable[object]] | None = None
        # set by ``observe``: nodes started before the run's observer exists wait for it
        self._observed: trio.Event | None = None
        self._stopped = False  # the nodes were stopped (``stop``)

    def node_names(self) -> list[str]:
        names: list[str] = []
        for role, worker in self.config.instances():
            where = self.config.placement_of(role, worker)
            if where != DRIVER and where not in names:
                names.append(where)
        return names

    def node_env(self) -> tuple[tuple[str, ...], dict[str, str] | None]:
        """The allowlist of the run's local nodes, and their environment: the run's reward
        modules are allowed, and the folders this process imports them from are on the nodes'
        ``PYTHONPATH`` (a script's own folder is not the node's)."""
        from ..tasks._functions import import_roots, module_prefixes

        paths = self.config.task.reward
        allow = ALLOW + tuple(p for p in module_prefixes(paths) if p not in ALLOW)
        roots = import_roots(paths)
        if not roots:
            return allow, None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [*roots, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        )
        return allow, env

    def hosts(self, node: str, roles: Collection[str]) -> bool:
        """Whether ``node`` hosts an instance of one of ``roles``."""
        return any(
            role in roles and self.config.placement_of(role, worker) == node
            for role, worker in self.config.instances()
        )

    def preload_modules(self, node: str, modules: Mapping[str, str]) -> tuple[str, ...]:
        """What ``node``'s ``Preload`` imports: the module of each role placed there
        (``modules``: role -> module) and the stations' compute module."""
        out = ["asyncflow_actors.roles._compute"]
        for role, worker in self.config.instances():
            module = modules.get(role)
            if self.config.placement_of(role, worker) == node and module and module not in out:
                out.append(module)
        return tuple(out)

    def hf_model_of(self, node: str) -> str | None:
        """The Hugging Face folder whose classes ``node`` (or ``DRIVER``) imports before its
        roles start: ``model.hf`` where it hosts a role that loads the policy with transformers
        (not a vLLM rollout: vLLM loads its own), else ``None``."""
        roles = _MODEL_ROLES - {"rollout"} if self.config.rollout.engine == "vllm" else _MODEL_ROLES
        model = self.config.model
        return model.hf if model.transformers and self.hosts(node, roles) else None

    def start_soon(
        self, nursery: trio.Nursery, modules: Mapping[str, str], *, observe_later: bool = False
    ) -> None:
        """Start ``start`` in ``nursery``: ``spawn`` on a node waits for that node.
        ``observe_later``: the nodes start before the run knows its observer; each, once up,
        waits for ``observe`` before its roles may spawn."""
        for name in self.node_names():
            self._ready.setdefault(name, trio.Event())
        if observe_later:
            self._observed = trio.Event()
        nursery.start_soon(self.start, modules)

    def observe(self, on_node_up: Callable[[Node], Awaitable[object]] | None) -> None:
        """Call ``on_node_up`` with each node once it is up, before any role spawns on it
        (``None``: nothing to call); releases the nodes ``start_soon(observe_later=True)``
        holds."""
        self.on_node_up = on_node_up
        if self._observed is not None:
            self._observed.set()

    async def start(self, modules: Mapping[str, str] | None = None) -> None:
        """Start or connect every node, concurrently, and preload on each the modules of its
        roles (``modules``: role -> module; torch and the compute module without)."""
        place = self.config.placement
        allow, env = self.node_env()

        async def one(name: str) -> None:
            alias = f"{name}.{self.suffix}"
            address = place.nodes.get(name)
            # shielded: a start cancelled half way (a failed check beside it) would leave a
            # node that ``stop`` does not know; this way it is known, and stopped
            with trio.CancelScope(shield=True):
                if self.supervised_apart(name):
                    launcher: Launcher = (
                        ConnectLauncher(address)
                        if address is not None
                        else SubprocessLauncher(allow, transport=place.transport, env=env)
                    )
                    node = await self._start_apart(alias, launcher)
                elif address is not None:
                    node = await self.system.connect_node(address, name=alias)
                else:
                    node = await self.system.start_node(
                        alias, allow=allow, transport=place.transport, env=env
                    )
                self.nodes[name] = node  # stopped by ``stop`` from now on
            preload = {
                "modules": self.preload_modules(name, modules or {}),
                "hf_model": self.hf_model_of(name),
            }
            await node.spawn(Preload, name=f"preload.{self.suffix}", kwargs=preload)
            if self._observed is not None:
                await self._observed.wait()
            if self.on_node_up is not None:
                await self.on_node_up(node)
            self._ready.setdefault(name, trio.Event()).set()

        async with trio.open_nursery() as nursery:
            for name in self.node_names():
                nursery.start_soon(one, name)

    def supervised_apart(self, node: str) -> bool:
        """Whether ``node`` has a supervisor of its own (it hosts the Trainer, and the run
        resumes a Trainer that dies: see the module docstring)."""
        return self.config.train.auto_resume and self.hosts(node, ("trainer",))

    async def _start_apart(self, alias: str, launcher: Launcher) -> Node:
        sup = await self.system.spawn(
            lambda: Supervisor((), _TRAINER_NODE), name=f"trainer-node.{self.suffix}"
        )
        self._supervisors.append(sup)
        ref = await sup.ask(StartChild(node_spec(alias, launcher, mesh=self.system.mesh)))
        node: Node = await ref.ask(GetNode())
        return node

    async def spawn(
        self,
        cls: type[Actor[Any]],
        *,
        role: str,
        worker: str,
        kwargs: Mapping[str, Any],
        restart: Restart,
        name: str | None = None,
    ) -> ActorRef[Any]:
        """``cls`` where ``role``'s ``worker`` runs, named ``worker.<run>`` unless ``name``."""
        where = self.config.placement_of(role, worker)
        name = name or f"{worker}.{self.suffix}"
        if where == DRIVER:
            values = dict(kwargs)
            ref = await self.system.spawn(lambda: cls(**values), name=name, restart=restart)
            self.local.append(name)
            return ref
        target = f"{cls.__module__}:{cls.__qualname__}"
        ready = self._ready.get(where)
        if ready is not None:
            await ready.wait()
        return await self.nodes[where].spawn(target, name=name, kwargs=kwargs, restart=restart)

    async def stop(
        self,
        refs: list[ActorRef[Any]],
        before_nodes: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Stop the roles (in reverse start order), await ``before_nodes`` (the observer's last
        pull: the nodes' agents answer only while their processes live), then stop the nodes
        (together: each takes a second or more to exit; once: a later call stops none);
        shielded, bounded."""

        async def stop_node(node: Node) -> None:
            with trio.move_on_after(15):
                try:
                    await node.stop()
                except ActorCrashed:
                    pass

        with trio.CancelScope(shield=True):
            for ref in reversed(refs):
                with trio.move_on_after(10):
                    try:
                        await ref.stop()
                    except ActorCrashed:
                        pass  # gone already
            if before_nodes is not None:
                await before_nodes()
            nodes, self._stopped = ([] if self._stopped else list(self.nodes.values())), True
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    nursery.start_soon(stop_node, node)
            for sup in self._supervisors:  # empty by now
                with trio.move_on_after(5):
                    try:
                        await sup.stop()
                    except ActorCrashed:
                        pass

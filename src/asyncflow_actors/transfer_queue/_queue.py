"""``open_transfer_queue``: the TransferQueue as a supervised actor tree.

::

    tq  (Supervisor, OneForOne)
    ├── unit-0 … unit-{N-1}   StorageUnit actors, here or each in a node process ("node-i")
    └── controller            Controller (restarts rebuild its state from the units)

A storage unit that crashes (or whose node dies) is restarted empty; the controller notices and
reports its samples lost, with their groups. The controller itself restarts by rebuilding from
the units' inventories.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from . import _shm
from ._errors import SchemaError
from ._runtime import (
    ActorRef,
    ActorSystem,
    ChildSpec,
    GetNode,
    NodeOptions,
    OneForOne,
    StartChild,
    StartChildren,
    SubprocessLauncher,
    Supervisor,
    node_spec,
)
from ._spec import TopicSpec, topic_specs_from_dict
from .client import TransferQueueClient
from .controller import Controller, ControllerShared
from .storage import StorageUnit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _specs(value: Any) -> tuple[TopicSpec, ...]:
    if isinstance(value, Mapping):
        return tuple(topic_specs_from_dict(value))
    return tuple(value)


@attrs.frozen
class TransferQueueConfig:
    """How to build a TransferQueue.

    ``units``: number of storage units; ``placement``: ``"local"`` (actors in this process) or
    ``"process"`` (each unit in its own node process, over ``transport``). ``unit_check_interval``:
    how often the controller checks that units are alive (and detects a restarted, empty one).
    ``shm``: clients on a unit's host pass tensor bodies of at least ``shm_min_bytes`` through
    shared memory (``/dev/shm``) instead of the socket; a segment a writer created but never
    handed over (it died) is removed after ``shm_orphan_age`` seconds; each unit keeps up to
    ``shm_pool_bytes`` of freed segments for writers to fill again (pages that exist already:
    no allocation, zeroing or unlinking per put). ``unit_timeout``: the controller's bound on
    its own requests to units; ``io_timeout``: a client's bound on a store or fetch.
    """

    topics: tuple[TopicSpec, ...] = attrs.field(default=(), converter=_specs)
    units: int = attrs.field(default=2)
    placement: Literal["local", "process"] = "local"
    transport: Literal["ipc", "tcp"] = "ipc"
    unit_check_interval: float = 0.5
    unit_timeout: float = 5.0
    io_timeout: float = 60.0
    shm: bool = True
    shm_min_bytes: int = 64 << 10
    shm_orphan_age: float = 60.0
    shm_pool_bytes: int = 256 << 20
    name: str = "tq"
    max_restarts: int = 10
    restart_window: float = 60.0

    @units.validator
    def _check_units(self, _: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise SchemaError(f"units must be an int >= 1, got {value!r}")

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> TransferQueueConfig:
        """From a parsed TOML table: ``units``, ``placement``, ``transport``, ... and ``[topics.*]``."""
        known = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(table) - known)
        if extra:
            raise SchemaError(
                f"transfer queue config: unknown keys {extra} (known: {sorted(known)})"
            )
        return cls(**dict(table))

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], *, table: str | None = None
    ) -> TransferQueueConfig:
        """Load from a TOML file (``table``: a dotted key holding the config, else the root)."""
        with open(path, "rb") as f:
            data: Any = tomllib.load(f)
        for key in table.split(".") if table else ():
            data = data[key]
        return cls.from_dict(data)


def node_name(queue: str, unit: str) -> str:
    """The name of the node process that hosts ``unit`` (``placement="process"``): unique in
    the run (it names a system of the mesh), so several queues may run side by side."""
    return f"{queue}-{unit}"


class TransferQueue:
    """A running TransferQueue: make clients, inspect it. From ``open_transfer_queue``."""

    def __init__(
        self,
        system: ActorSystem,
        controller: ActorRef[Any],
        shared: ControllerShared,
        namespace: str = "",
        name: str = "tq",
    ) -> None:
        self.system = system
        self.controller = controller
        self.shared = shared
        self.namespace = namespace  # names of this queue's shared-memory segments start so
        self.name = name

    @property
    def units(self) -> dict[str, ActorRef[Any]]:
        return dict(self.shared.units)

    async def client(self, holder: str | None = None) -> TransferQueueClient:
        """A new client; ``holder`` names it in leases and writes (default: a unique name).
        Clients sharing a holder share its fate: ``aclose`` of one returns the leases of all."""
        return await TransferQueueClient.connect(self.controller, holder=holder)

    async def unit_pids(self) -> dict[str, int | None]:
        """The process id of each unit's node process (``None``: the unit is in this process,
        or its node is restarting)."""
        out: dict[str, int | None] = {}
        for unit in self.shared.units:
            ref = self.system.whereis(f"{self.name}/{node_name(self.name, unit)}")
            out[unit] = None if ref is None else (await ref.ask(GetNode())).pid
        return out


@asynccontextmanager
async def open_transfer_queue(
    system: ActorSystem,
    config: TransferQueueConfig | None = None,
    *,
    options: NodeOptions | None = None,
) -> AsyncIterator[TransferQueue]:
    """Start the TransferQueue tree under ``system``'s root; stop it when the block exits.

    ``options`` tune the unit nodes (``placement="process"``).
    """
    cfg = config if config is not None else TransferQueueConfig()
    names = [f"unit-{i}" for i in range(cfg.units)]
    namespace = f"afa-{os.urandom(4).hex()}-"  # this queue's shared-memory segments
    strategy = OneForOne(max_restarts=cfg.max_restarts, within=cfg.restart_window)
    sup = await system.spawn(lambda: Supervisor((), strategy), name=cfg.name)
    try:
        units: dict[str, ActorRef[Any]] = {}
        if cfg.placement == "local":
            for unit in names:
                spec = ChildSpec(lambda unit=unit: StorageUnit(unit), unit)  # type: ignore[misc]
                units[unit] = await sup.ask(StartChild(spec))
        else:
            shm = namespace if cfg.shm and _shm.available() else ""
            await _start_unit_nodes(system, sup, cfg, names, units, options, shm)
        shared = ControllerShared(
            {t.name: t for t in cfg.topics},
            units,
            unit_check_interval=cfg.unit_check_interval,
            unit_timeout=cfg.unit_timeout,
            io_timeout=cfg.io_timeout,
            shm_min_bytes=cfg.shm_min_bytes if cfg.shm else None,
        )
        controller = await sup.ask(StartChild(ChildSpec(lambda: Controller(shared), "controller")))
        yield TransferQueue(system, controller, shared, namespace, cfg.name)
    finally:
        try:
            with trio.CancelScope(shield=True):
                await sup.stop()
        finally:
            if _shm.available():
                _shm.sweep(namespace)  # what units killed with their node left behind


async def _start_unit_nodes(
    system: ActorSystem,
    sup: ActorRef[Any],
    cfg: TransferQueueConfig,
    names: list[str],
    units: dict[str, ActorRef[Any]],
    options: NodeOptions | None,
    shm: str,
) -> None:
    """One node process per unit, launched concurrently (startup is dominated by process start).
    ``shm``: the queue's segment namespace (empty: no shared memory)."""
    allow = ("asyncflow_actors.transfer_queue",)
    launcher = SubprocessLauncher(allow, transport=cfg.transport)
    specs = tuple(
        node_spec(node_name(cfg.name, unit), launcher, mesh=system.mesh, options=options)
        for unit in names
    )
    refs = await sup.ask(StartChildren(specs))
    node_refs = dict(zip(names, refs, strict=True))

    async def spawn(unit: str) -> None:
        node = await node_refs[unit].ask(GetNode())
        kwargs = {
            "name": unit,
            "shm": f"{shm}{unit}-" if shm else "",
            "orphan_age": cfg.shm_orphan_age,
            "pool_bytes": cfg.shm_pool_bytes,
        }
        units[unit] = await node.spawn(StorageUnit, name=unit, kwargs=kwargs)

    async with trio.open_nursery() as nursery:
        for unit in names:
            nursery.start_soon(spawn, unit)
    for unit in names:  # keep the order of the names
        units[unit] = units.pop(unit)

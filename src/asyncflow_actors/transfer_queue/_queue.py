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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from . import _shm
from ._config import TransferQueueConfig
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
    mesh_of,
    node_spec,
)
from .client import TransferQueueClient
from .controller import Controller, ControllerShared
from .storage import StorageUnit


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
        node_spec(node_name(cfg.name, unit), launcher, mesh=mesh_of(system), options=options)
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

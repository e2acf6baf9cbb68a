"""The start of a run: its node processes launch beside the slower half of the checks.

A node process spends its first seconds importing torch (and transformers, for a Hugging Face
model); ``preflight``'s second half (``check_contents``: the model's config through
transformers, the task and its dataset) and this process's own import of its roles' modules
(torch, not imported before: ``_role_classes``) take about as long. They run together here:
the nodes start once the quick half (``check_paths``) passed, and a failed check stops them
before any role is spawned on them and raises its ``PipelineConfigError`` as such (not inside
a group).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import trio

from ..roles._gc import gc_paused
from ..roles.preload import warm_hf_classes
from ._config import DRIVER, PipelineConfig, PipelineConfigError
from ._placement import Placement
from ._preflight import check_contents
from ._role_classes import DRIVER_MODULE


@asynccontextmanager
async def open_nodes_beside_checks(
    place: Placement,
    config: PipelineConfig,
    checkpoint: str | None,
    modules: Mapping[str, str],
    *,
    checked: bool,
) -> AsyncIterator[None]:
    """Start ``place``'s nodes in the background (each, once up, waits for ``place.observe``
    before its roles may spawn) while ``check_contents`` (unless ``checked``: it passed
    already) and this process's imports (``own_modules``: torch; the policy's transformers
    classes where a model role runs here) run in a worker thread, the garbage collector paused
    (``roles._gc``); then the block runs. The nodes are stopped on the way out unless the block
    stopped them (``Placement.stop``)."""
    failed: list[PipelineConfigError] = []
    own = own_modules(place, modules)
    try:
        async with trio.open_nursery() as nursery:
            place.start_soon(nursery, modules, observe_later=True)
            try:
                # torch loads in a worker thread: this event loop serves the nodes and the run
                await trio.to_thread.run_sync(_prepare, place, config, checkpoint, checked, own)
            except PipelineConfigError as exc:
                failed.append(exc)
                nursery.cancel_scope.cancel()
            if not failed:
                yield
                nursery.cancel_scope.cancel()  # a node still starting: the run is over
    finally:
        await place.stop([])
    if failed:
        raise failed[0]


def own_modules(place: Placement, modules: Mapping[str, str]) -> tuple[str, ...]:
    """What this process imports before its roles start: the stations' compute module, the
    Driver's and the module of each role placed here (``modules``: role -> module)."""
    return (*place.preload_modules(DRIVER, modules), DRIVER_MODULE)


def _prepare(
    place: Placement,
    config: PipelineConfig,
    checkpoint: str | None,
    checked: bool,
    modules: tuple[str, ...],
) -> None:
    """``check_contents`` (unless ``checked``), then this process's imports (``modules``, and the
    policy's transformers classes where it hosts a model role), the collector paused."""
    with gc_paused():
        if not checked:
            check_contents(config, checkpoint)
        for name in modules:
            importlib.import_module(name)
        hf = place.hf_model_of(DRIVER)
        if hf is not None:
            warm_hf_classes(hf)

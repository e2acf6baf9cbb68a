"""``TransferQueueConfig``: how to build a TransferQueue (frozen, loadable from TOML)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ._errors import SchemaError
from ._spec import TopicSpec, topic_specs_from_dict

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

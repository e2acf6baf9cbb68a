"""What a checkpoint keeps of the Driver (``driver.json``): read by the Driver, a resume and
the auto-resume's rollback."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from ._settings import DRIVER_FILE


@attrs.frozen
class DriverState:
    """What a checkpoint keeps of the Driver: the version, the next prompt index, the prompts
    injected but not yet trained, and the run's ``[model]`` settings (a resume checks them)."""

    version: int
    cursor: int
    pending: tuple[int, ...]
    model: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)

    @classmethod
    def read(cls, directory: str) -> DriverState:
        with open(os.path.join(directory, DRIVER_FILE), encoding="utf-8") as f:
            raw = json.load(f)
        pending = tuple(int(i) for i in raw["pending"])
        return cls(int(raw["version"]), int(raw["cursor"]), pending, raw.get("model", {}))

    def write(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, DRIVER_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(attrs.asdict(self), f)
        os.replace(path + ".tmp", path)

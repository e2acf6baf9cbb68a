"""Argument checks shared by the core's public methods (raise :class:`InvalidArgument`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .._errors import InvalidArgument


def int_at_least(name: str, value: object, low: int) -> int:
    """``value`` if it is an int (not a bool) ``>= low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgument(f"{name} must be an int >= {low}, got {value!r}")
    return value


def finite_time(value: object) -> float:
    """``value`` as seconds if it is a finite real number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgument(f"now must be a finite number (seconds), got {value!r}")
    return float(value)


def holder_name(value: object) -> str:
    """``value`` if it is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"holder must be a non-empty string, got {value!r}")
    return value


def byte_sizes(column: str, value: int | Sequence[int], n: int) -> int | npt.NDArray[np.int64]:
    """Per-sample byte sizes of ``column``: one int for all ``n`` samples, or one each."""
    if isinstance(value, int):
        if value >= 0 and not isinstance(value, bool):
            return value  # the common case, without formatting a name for no error
        return int_at_least(f"nbytes of {column!r}", value, 0)
    sizes = np.array([int_at_least(f"nbytes of {column!r}", x, 0) for x in value], np.int64)
    if len(sizes) != n:
        raise InvalidArgument(f"nbytes of {column!r} has {len(sizes)} entries, expected {n}")
    return sizes

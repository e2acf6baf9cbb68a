"""Errors of the RL layer."""

from __future__ import annotations

__all__ = ["RLInputError", "TaskError"]


class RLInputError(ValueError):
    """Tensors given to an RL function have the wrong shape, dtype or values, or a
    configuration value is out of range. The message names the argument and what was expected."""


class TaskError(ValueError):
    """A task was built or used with invalid data (bad record, unknown option, bad score)."""

"""Typed errors of weight sync.

Receivers answer bad input with these (``ctx.reply_error``), and they cross the wire as their
own type (this package's errors are known to every node), so each takes its message alone.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointError(Exception):
    """Base class of weight-sync errors."""


class ManifestError(CheckpointError, ValueError):
    """Weights that cannot be synced as given, or a manifest a receiver refuses.

    Duplicate or empty names, no tensor left after the filter, a dtype the transport cannot
    carry, or a tensor whose dtype/shape differs from what the receiver expects.
    """


class UnknownChecksum(ManifestError):
    """The sender named a checksum algorithm this receiver cannot compute (it refuses the
    sync at prepare, before any byte moves)."""


class ChecksumMismatch(CheckpointError):
    """The bytes a receiver got for a bucket differ from the bytes the sender packed."""


class IncompleteSync(CheckpointError):
    """A receiver was asked to finalize a sync for which it lacks buckets."""


class StaleSync(CheckpointError):
    """A message names a sync the receiver is not part of (any more), or an older version."""


class SyncFailed(CheckpointError):
    """A weight sync did not complete; ``__cause__`` is what failed.

    ``phase`` is where it failed (``pause``, ``prepare``, ``topology``, ``broadcast``,
    ``finalize``, ``resume``); ``committed`` is true only when every receiver had verified the
    new weights and was told to switch (a failure then is in the resume phase). ``receiver``
    names the receiver at fault, if one was. ``timings`` holds the phases measured so far.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str = "",
        version: int = -1,
        receiver: str | None = None,
        committed: bool = False,
        timings: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.version = version
        self.receiver = receiver
        self.committed = committed
        self.timings = dict(timings or {})

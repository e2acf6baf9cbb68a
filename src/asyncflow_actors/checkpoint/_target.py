"""What a weight sync talks to: the pause modes and the ``SyncTarget`` protocol.

A *sync target* is anything that holds policy weights and receives new ones from the trainer: a
rollout engine (``asyncflow_actors.rollout``) or a forward worker. The sync protocol
(``docs/weight_sync.md``) pauses every target, broadcasts, lets each load, and resumes them.

The contract a target promises, which the protocol relies on:

- ``pause(mode)`` returns only once the target *acknowledges* that nothing runs on the old
  weights any more (under ``KEEP``: nothing advances until the swap). It is idempotent.
- ``load_weights(weights, version)`` switches the model whole or not at all: after it returns the
  target holds exactly ``version``; if it raises, the target still holds its old, complete
  weights. A target never produces a token from a mix of two versions. The tensors it is given
  (host memory) are its own from then on: the receiver never writes them again, so it may keep
  them instead of copying. A lazy receiver calls it from the target's own batch boundary
  (``WeightReceiver.apply_pending``), an eager one while the target is paused.
- ``resume()`` undoes ``pause`` (idempotent; a no-op when not paused). The protocol calls it in a
  ``finally``, whatever happened, so a target is never left paused.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch


class PauseMode(enum.Enum):
    """How a rollout engine pauses for a weight sync (forward workers treat all alike).

    - ``DRAIN``: finish the requests in flight, then pause; nothing is lost, the sync waits for
      the longest request.
    - ``ABORT``: stop now; the requests in flight come back ``aborted`` with their prefix (tokens,
      logprobs, per-token versions) so they can resume later from it (partial rollout).
    - ``KEEP``: freeze the requests in flight between two decode steps and continue them under
      the new weights after the swap (PipelineRL style); their tokens carry the version that
      produced each of them.
    - ``WAIT_BATCH``: pause at the end of the current batch (the requests already admitted
      finish; queued ones wait).
    """

    DRAIN = "drain"
    ABORT = "abort"
    KEEP = "keep"
    WAIT_BATCH = "wait_batch"


@attrs.frozen
class PauseAck:
    """A target's acknowledgement that it is paused: nothing runs on the old weights.

    ``version`` is the weight version it holds; ``in_flight`` the requests it holds frozen
    (``KEEP``) and ``aborted`` those it returned as partial (``ABORT``).
    """

    mode: PauseMode
    version: int
    in_flight: int = 0
    aborted: int = 0


@runtime_checkable
class SyncTarget(Protocol):
    """A holder of policy weights that a weight sync pauses, loads and resumes."""

    @property
    def version(self) -> int:
        """The version of the weights held now (``-1``: none loaded yet)."""
        ...

    async def pause(self, mode: PauseMode) -> PauseAck:
        """Pause (see ``PauseMode``); return once nothing runs on the old weights."""
        ...

    async def resume(self) -> None:
        """Continue after a pause; a no-op when not paused."""
        ...

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Switch to ``weights`` (all of them or any named subset) tagged ``version``, atomically."""
        ...

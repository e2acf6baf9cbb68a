"""Weight sync from the trainer to rollout engines and forward workers (``docs/weight_sync.md``).

This layer defines what a sync talks to (``SyncTarget``, ``PauseMode``) and, as it lands, the
``CheckpointEngine``: buckets, transports, host cache with lazy load, and the
pause → metadata → topology → broadcast → finalize → load + resume protocol.
"""

from __future__ import annotations

from ._target import PauseAck as PauseAck
from ._target import PauseMode as PauseMode
from ._target import SyncTarget as SyncTarget

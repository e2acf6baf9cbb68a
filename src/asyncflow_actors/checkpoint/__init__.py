"""Weight sync from the trainer to rollout engines and forward workers (``docs/weight_sync.md``).

``CheckpointEngine`` (the sender: ``await engine.sync(version, state_dict)``) runs the
pause → prepare → topology → broadcast → finalize → resume protocol with every target (weights in
one small bucket: one fused round, then the resume); each target hosts a ``WeightReceiver`` (or
is a ``SyncTargetActor``) around a ``SyncTarget``. Buckets
with a manifest and checksums, double buffering, transports (in-process and zmq by actor
messages, ``torch.distributed`` gloo/nccl/hccl, safetensors files), LoRA-only filtering, and a
host cache loaded lazily at the receiver's next batch boundary.
"""

from __future__ import annotations

from ._buckets import BucketSource as BucketSource
from ._buckets import HostCache as HostCache
from ._collective import CollectiveTransport as CollectiveTransport
from ._config import LORA_PATTERNS as LORA_PATTERNS
from ._config import CheckpointConfig as CheckpointConfig
from ._config import PhaseDeadlines as PhaseDeadlines
from ._config import TensorFilter as TensorFilter
from ._engine import CheckpointEngine as CheckpointEngine
from ._engine import CheckpointEngineStatistics as CheckpointEngineStatistics
from ._engine import SyncResult as SyncResult
from ._engine import make_transport as make_transport
from ._errors import CheckpointError as CheckpointError
from ._errors import ChecksumMismatch as ChecksumMismatch
from ._errors import IncompleteSync as IncompleteSync
from ._errors import ManifestError as ManifestError
from ._errors import StaleSync as StaleSync
from ._errors import SyncFailed as SyncFailed
from ._errors import UnknownChecksum as UnknownChecksum
from ._file import FileTransport as FileTransport
from ._file import read_weights as read_weights
from ._manifest import BucketSpec as BucketSpec
from ._manifest import Manifest as Manifest
from ._manifest import Piece as Piece
from ._manifest import TensorSpec as TensorSpec
from ._manifest import plan_buckets as plan_buckets
from ._messages import SYNC_MESSAGES as SYNC_MESSAGES
from ._messages import FusedAck as FusedAck
from ._messages import GetReceiverStatistics as GetReceiverStatistics
from ._messages import JoinGroup as JoinGroup
from ._messages import PutBucket as PutBucket
from ._messages import ReadShard as ReadShard
from ._messages import ReceiveBroadcast as ReceiveBroadcast
from ._messages import ReceiverStatistics as ReceiverStatistics
from ._messages import Resumed as Resumed
from ._messages import SyncFinalize as SyncFinalize
from ._messages import SyncFused as SyncFused
from ._messages import SyncMessage as SyncMessage
from ._messages import SyncPause as SyncPause
from ._messages import SyncPrepare as SyncPrepare
from ._messages import SyncResume as SyncResume
from ._receiver import LoadMode as LoadMode
from ._receiver import SyncTargetActor as SyncTargetActor
from ._receiver import WeightReceiver as WeightReceiver
from ._target import PauseAck as PauseAck
from ._target import PauseMode as PauseMode
from ._target import SyncTarget as SyncTarget
from ._transport import ActorTransport as ActorTransport
from ._transport import SyncSession as SyncSession
from ._transport import Transport as Transport

"""TransferQueue: the data hub every role talks through (``docs/transfer_queue.md``).

``open_transfer_queue`` starts a supervised tree (a controller and storage units, here or in
node processes); clients put and get through it. The sans-I/O control plane
(:class:`ControllerState`) and the :class:`FlowControl` admission primitive are public too.
"""

from __future__ import annotations

from ._config import TransferQueueConfig as TransferQueueConfig
from ._errors import CapacityError as CapacityError
from ._errors import ControllerUnavailable as ControllerUnavailable
from ._errors import FlowControlError as FlowControlError
from ._errors import GroupError as GroupError
from ._errors import InvalidArgument as InvalidArgument
from ._errors import InventoryError as InventoryError
from ._errors import SchemaError as SchemaError
from ._errors import ShareMismatch as ShareMismatch
from ._errors import StaleVersionError as StaleVersionError
from ._errors import StorageUnavailable as StorageUnavailable
from ._errors import TransferQueueError as TransferQueueError
from ._errors import UnknownColumn as UnknownColumn
from ._errors import UnknownConsumer as UnknownConsumer
from ._errors import UnknownGroup as UnknownGroup
from ._errors import UnknownLease as UnknownLease
from ._errors import UnknownSample as UnknownSample
from ._errors import UnknownTopic as UnknownTopic
from ._errors import UnknownUnit as UnknownUnit
from ._flow_control import FlowControl as FlowControl
from ._flow_control import FlowControlStatistics as FlowControlStatistics
from ._messages import ControllerStatistics as ControllerStatistics
from ._messages import EventBatch as EventBatch
from ._messages import TQEvent as TQEvent
from ._queue import TransferQueue as TransferQueue
from ._queue import open_transfer_queue as open_transfer_queue
from ._results import STALE as STALE
from ._results import Abandoned as Abandoned
from ._results import Allocation as Allocation
from ._results import Eviction as Eviction
from ._results import GroupSlot as GroupSlot
from ._results import Lease as Lease
from ._results import Loss as Loss
from ._results import LostSamples as LostSamples
from ._results import Release as Release
from ._results import Update as Update
from ._samplers import FIFO as FIFO
from ._samplers import WHOLE_GROUPS as WHOLE_GROUPS
from ._samplers import Balanced as Balanced
from ._samplers import Fifo as Fifo
from ._samplers import Sampler as Sampler
from ._samplers import WholeGroups as WholeGroups
from ._spec import ColumnSpec as ColumnSpec
from ._spec import TopicSpec as TopicSpec
from ._spec import topic_specs_from_dict as topic_specs_from_dict
from ._stats import ConsumerStatistics as ConsumerStatistics
from ._stats import HolderStatistics as HolderStatistics
from ._stats import StateStatistics as StateStatistics
from ._stats import TopicStatistics as TopicStatistics
from ._stats import ViewStatistics as ViewStatistics
from ._unit_messages import IncarnationMismatch as IncarnationMismatch
from ._unit_messages import StorageStatistics as StorageStatistics
from ._unit_messages import UnitError as UnitError
from .client import Batch as Batch
from .client import TransferQueueClient as TransferQueueClient
from .client import TransferQueueStatistics as TransferQueueStatistics
from .controller import Controller as Controller
from .state import ControllerState as ControllerState
from .state import GroupRecord as GroupRecord
from .state import Inventory as Inventory
from .state import SampleRecord as SampleRecord
from .state import TopicRecord as TopicRecord
from .storage import StorageUnit as StorageUnit

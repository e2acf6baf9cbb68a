"""The TransferQueue's client: puts, gets, located reads and the I/O to storage units.

It speaks the controller's and the units' protocols (``_messages``, ``_unit_messages``) and
knows neither's internals.
"""

from ._batch import Batch as Batch
from ._client import TransferQueueClient as TransferQueueClient
from ._client import TransferQueueStatistics as TransferQueueStatistics
from ._rows import LeaseView as LeaseView
from ._rows import fetch_rows as fetch_rows
from ._unit_io import UnitIO as UnitIO

"""The TransferQueue's control state: pure, deterministic, sans-I/O.

Tables, topics, leases, writes and samplers' selection, the rebuild from inventories and the
statistics: everything the controller decides, with no actor, no clock of its own and no I/O
(time is an argument). It imports only the shared value modules at the package root.
"""

from ._inventory import GroupRecord as GroupRecord
from ._inventory import Inventory as Inventory
from ._inventory import SampleRecord as SampleRecord
from ._inventory import TopicRecord as TopicRecord
from ._state import ControllerState as ControllerState

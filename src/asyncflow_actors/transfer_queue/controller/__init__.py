"""The controller actor: the TransferQueue's control plane around ``state.ControllerState``.

It parks puts and claims until they can be answered, delivers bookkeeping to the storage units,
watches them, and rebuilds its state when restarted. It imports the state and the shared
modules; never the client or the storage units' internals.
"""

from ._controller import Controller as Controller
from ._shared import ControllerShared as ControllerShared

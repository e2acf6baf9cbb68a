"""The TransferQueue's data plane: storage units holding the tensors, with shared memory.

A unit knows its own protocol (``_unit_messages``) and nothing of the controller or the client.
"""

from ._unit import StorageUnit as StorageUnit

"""Every name the TransferQueue takes from the actor runtime, imported in one place.

The runtime's layout is moving (refs that travel, a remote subpackage); the TransferQueue imports
these names from here only, so that it follows with a change to this file.
"""

from __future__ import annotations

import functools

from ..actors import Actor as Actor
from ..actors import ActorContext as ActorContext
from ..actors import ActorCrashed as ActorCrashed
from ..actors import ActorRef as ActorRef
from ..actors import ActorState as ActorState
from ..actors import ActorSystem as ActorSystem
from ..actors import ChildSpec as ChildSpec
from ..actors import OneForOne as OneForOne
from ..actors import Reply as Reply
from ..actors import Request as Request
from ..actors import StartChild as StartChild
from ..actors import StartChildren as StartChildren
from ..actors import Supervisor as Supervisor
from ..actors.remote import GetNode as GetNode
from ..actors.remote import NodeOptions as NodeOptions
from ..actors.remote import RawTensor as RawTensor
from ..actors.remote import SubprocessLauncher as SubprocessLauncher
from ..actors.remote import mesh_of as mesh_of
from ..actors.remote import node_spec as node_spec


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes per element of a wire dtype name; raises ``KeyError`` for an unknown one (cached:
    building the probe costs microseconds, and every shared-memory body asks)."""
    return RawTensor(dtype, (0, 1), memoryview(b"")).row_bytes

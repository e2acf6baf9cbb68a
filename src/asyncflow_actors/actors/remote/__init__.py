"""The remote half of the runtime: nodes, links, the wire format, trio over pyzmq.

User code mostly needs ``system.start_node``/``connect_node``, ``Node`` and ``RemoteActorRef``
(exported by :mod:`asyncflow_actors.actors`). This namespace holds the pieces below them, for
launchers of one's own, benchmarks and tools: ``serve_node``, node specs and launchers (among
them ``RayLauncher``: nodes as Ray actors, the ``ray`` extra), the ``TrioSocket`` wrapper of
pyzmq, and the codec (``encode``/``decode``, ``MessageRegistry``).
See ``docs/remote.md``.
"""

from ._address import ActorAddress as ActorAddress
from ._curve import open_zap_authenticator as open_zap_authenticator
from ._hosting import NotAuthorized as NotAuthorized
from ._launch import ConnectLauncher as ConnectLauncher
from ._launch import InProcessLauncher as InProcessLauncher
from ._launch import Launched as Launched
from ._launch import Launcher as Launcher
from ._launch import SubprocessLauncher as SubprocessLauncher
from ._link import NodeLink as NodeLink
from ._mesh import LinkStatistics as LinkStatistics
from ._mesh import Mesh as Mesh
from ._mesh import MeshStatistics as MeshStatistics
from ._node import GetNode as GetNode
from ._node import NodeActor as NodeActor
from ._node import SpawnRemote as SpawnRemote
from ._node import node_spec as node_spec
from ._node import serve_node as serve_node
from ._protocol import MessageRejected as MessageRejected
from ._protocol import protocol_registry as protocol_registry
from ._raw_tensor import RawTensor as RawTensor
from ._ray import RayLauncher as RayLauncher
from ._server import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
from ._server import NodeServerStatistics as NodeServerStatistics
from ._wire import MalformedMessage as MalformedMessage
from ._wire import MessageRegistry as MessageRegistry
from ._wire import MessageTooLarge as MessageTooLarge
from ._wire import UnknownType as UnknownType
from ._wire import UnsupportedValue as UnsupportedValue
from ._wire import decode as decode
from ._wire import encode as encode
from ._zmq import SendTracker as SendTracker
from ._zmq import TrioSocket as TrioSocket
from ._zmq import open_zmq_socket as open_zmq_socket

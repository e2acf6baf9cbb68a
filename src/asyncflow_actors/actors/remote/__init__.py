"""The remote half of the runtime: nodes, links, the wire format, trio over pyzmq.

It implements the local runtime's ``Transport`` (:mod:`asyncflow_actors.actors`) with its
``Mesh``, and composes both halves: ``open_actor_system`` runs a ``NodeSystem``, an
``ActorSystem`` with the mesh as its transport that starts and connects nodes
(``start_node``/``connect_node``/``launch_node``/``listen``). User code mostly needs those,
``Node`` and ``RemoteActorRef`` (also exported by ``asyncflow_actors``). Below them, for
launchers of one's own, benchmarks and tools: ``serve_node``, node specs and launchers (among
them ``RayLauncher``: nodes as Ray actors, the ``ray`` extra), the ``TrioSocket`` wrapper of
pyzmq, and the codec (``encode``/``decode``, ``MessageRegistry``). See ``docs/remote.md``.
"""

from .._errors import RemoteError as RemoteError
from ._address import ActorAddress as ActorAddress
from ._curve import CurveClient as CurveClient
from ._curve import CurveKeypair as CurveKeypair
from ._curve import CurveServer as CurveServer
from ._curve import KeyBindings as KeyBindings
from ._curve import KeyModel as KeyModel
from ._curve import curve_keypair as curve_keypair
from ._curve import open_zap_authenticator as open_zap_authenticator
from ._hosting import NotAuthorized as NotAuthorized
from ._hosting import SpawnRefused as SpawnRefused
from ._launch import ConnectLauncher as ConnectLauncher
from ._launch import Launched as Launched
from ._launch import Launcher as Launcher
from ._launch import NodeOptions as NodeOptions
from ._launch import SubprocessLauncher as SubprocessLauncher
from ._link import NodeLink as NodeLink
from ._mesh import LinkStatistics as LinkStatistics
from ._mesh import Mesh as Mesh
from ._mesh import MeshStatistics as MeshStatistics
from ._node import GetNode as GetNode
from ._node import Node as Node
from ._node import NodeActor as NodeActor
from ._node import SpawnRemote as SpawnRemote
from ._node import node_spec as node_spec
from ._protocol import MessageRejected as MessageRejected
from ._protocol import NodeLost as NodeLost
from ._protocol import protocol_registry as protocol_registry
from ._protocol import register_error as register_error
from ._raw_tensor import RawTensor as RawTensor
from ._ray import RayLauncher as RayLauncher
from ._ref import RemoteActorRef as RemoteActorRef
from ._server import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
from ._server import NodeServerStatistics as NodeServerStatistics
from ._system import InProcessLauncher as InProcessLauncher
from ._system import NodeSystem as NodeSystem
from ._system import mesh_of as mesh_of
from ._system import open_actor_system as open_actor_system
from ._system import serve_node as serve_node
from ._typeinfo import register_types as register_types
from ._wire import MalformedMessage as MalformedMessage
from ._wire import MessageRegistry as MessageRegistry
from ._wire import MessageTooLarge as MessageTooLarge
from ._wire import UnknownType as UnknownType
from ._wire import UnsupportedValue as UnsupportedValue
from ._wire import WireError as WireError
from ._wire import decode as decode
from ._wire import encode as encode
from ._wire_check import Check as Check
from ._wire_check import compile_check as compile_check
from ._zmq import SendTracker as SendTracker
from ._zmq import TrioSocket as TrioSocket
from ._zmq import open_zmq_socket as open_zmq_socket

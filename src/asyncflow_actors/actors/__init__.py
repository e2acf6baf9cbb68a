"""The actor runtime: typed mailboxes, ask/tell, OTP supervision, nodes (``docs/actors.md``).

Two halves: the local runtime (this package's modules: actors, refs, cells, supervision, the
system) and the remote half in :mod:`asyncflow_actors.actors.remote` (nodes, links, the wire
format, trio over pyzmq). This namespace exports what user code is written against; the remote
subpackage exports the lower-level pieces (launchers, sockets, the codec).
"""

from ._actor import Actor as Actor
from ._actor import ActorContext as ActorContext
from ._cell import ActorState as ActorState
from ._cell import ActorStatistics as ActorStatistics
from ._cell import Reply as Reply
from ._compute import ComputeLane as ComputeLane
from ._compute import ComputeStatistics as ComputeStatistics
from ._errors import ActorCrashed as ActorCrashed
from ._errors import ActorError as ActorError
from ._errors import ActorKilled as ActorKilled
from ._errors import MessageTypeError as MessageTypeError
from ._errors import NameTakenError as NameTakenError
from ._errors import SupervisorFailed as SupervisorFailed
from ._errors import root_error as root_error
from ._message import Request as Request
from ._message import Terminated as Terminated
from ._ref import ActorRef as ActorRef
from ._ref import Tracker as Tracker
from ._supervisor import Backoff as Backoff
from ._supervisor import ChildInfo as ChildInfo
from ._supervisor import ChildSpec as ChildSpec
from ._supervisor import OneForAll as OneForAll
from ._supervisor import OneForOne as OneForOne
from ._supervisor import Restart as Restart
from ._supervisor import RestForOne as RestForOne
from ._supervisor import StartChild as StartChild
from ._supervisor import StartChildren as StartChildren
from ._supervisor import StopChild as StopChild
from ._supervisor import Strategy as Strategy
from ._supervisor import Supervisor as Supervisor
from ._supervisor import WhichChildren as WhichChildren
from ._system import ActorSystem as ActorSystem
from ._system import SystemStatistics as SystemStatistics
from ._system import open_actor_system as open_actor_system
from .remote._curve import CurveClient as CurveClient
from .remote._curve import CurveKeypair as CurveKeypair
from .remote._curve import CurveServer as CurveServer
from .remote._curve import curve_keypair as curve_keypair
from .remote._hosting import NotAuthorized as NotAuthorized
from .remote._hosting import SpawnRefused as SpawnRefused
from .remote._launch import NodeOptions as NodeOptions
from .remote._node import Node as Node
from .remote._protocol import MessageRejected as MessageRejected
from .remote._protocol import NodeLost as NodeLost
from .remote._protocol import RemoteError as RemoteError
from .remote._protocol import register_error as register_error
from .remote._ref import RemoteActorRef as RemoteActorRef
from .remote._typeinfo import register_types as register_types
from .remote._wire import WireError as WireError

"""The actor runtime: typed mailboxes, ask/tell, OTP supervision (``docs/actors.md``).

Two halves: the local runtime (this package's modules: actors, refs, cells, supervision, the
system, and the ``Transport`` interface a system is given) and the remote half in
:mod:`asyncflow_actors.actors.remote` (nodes, links, the wire format, trio over pyzmq), which
implements the transport. This package imports nothing from the remote half; the names that
compose both (``open_actor_system``, ``Node``, ``RemoteActorRef``...) are exported by
:mod:`asyncflow_actors.actors.remote` and by ``asyncflow_actors`` itself.
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
from ._errors import RemoteError as RemoteError
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
from ._system import open_local_actor_system as open_local_actor_system
from ._transport import Transport as Transport

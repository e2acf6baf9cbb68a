"""asyncflow_actors: asynchronous, streaming RL post-training as an actor-model library on trio.

``import asyncflow_actors as afa``. The layers (``docs/index.md``) import downward only; their
public names are re-exported here.
"""

from __future__ import annotations

from . import actors as actors
from .actors import Actor as Actor
from .actors import ActorContext as ActorContext
from .actors import ActorCrashed as ActorCrashed
from .actors import ActorError as ActorError
from .actors import ActorKilled as ActorKilled
from .actors import ActorRef as ActorRef
from .actors import ActorState as ActorState
from .actors import ActorStatistics as ActorStatistics
from .actors import ActorSystem as ActorSystem
from .actors import Backoff as Backoff
from .actors import ChildInfo as ChildInfo
from .actors import ChildSpec as ChildSpec
from .actors import ComputeLane as ComputeLane
from .actors import MessageTypeError as MessageTypeError
from .actors import NameTakenError as NameTakenError
from .actors import OneForAll as OneForAll
from .actors import OneForOne as OneForOne
from .actors import RemoteError as RemoteError
from .actors import Reply as Reply
from .actors import Request as Request
from .actors import Restart as Restart
from .actors import RestForOne as RestForOne
from .actors import StartChild as StartChild
from .actors import StartChildren as StartChildren
from .actors import StopChild as StopChild
from .actors import Strategy as Strategy
from .actors import Supervisor as Supervisor
from .actors import SupervisorFailed as SupervisorFailed
from .actors import SystemStatistics as SystemStatistics
from .actors import Terminated as Terminated
from .actors import Tracker as Tracker
from .actors import WhichChildren as WhichChildren
from .actors.remote import MessageRejected as MessageRejected
from .actors.remote import Node as Node
from .actors.remote import NodeLost as NodeLost
from .actors.remote import NodeOptions as NodeOptions
from .actors.remote import NodeSystem as NodeSystem
from .actors.remote import NotAuthorized as NotAuthorized
from .actors.remote import RemoteActorRef as RemoteActorRef
from .actors.remote import SpawnRefused as SpawnRefused
from .actors.remote import WireError as WireError
from .actors.remote import open_actor_system as open_actor_system
from .actors.remote import register_error as register_error

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> object:
    # The torch-backed layers load on first use, so that processes that only move bytes
    # (nodes hosting storage units) start without importing torch; so does the testing kit.
    if name in ("checkpoint", "models", "rl", "rollout", "testing"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

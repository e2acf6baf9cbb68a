"""The node protocol: envelope kinds, its own message classes, and errors across the wire.

Every actor system of a run listens on a ROUTER socket (its *server*) and talks to each other
system it needs through one DEALER socket (a *link*), opened lazily. Every message is one wire
message (``_wire``): the envelope is the ``meta`` map (``k`` kind, ``c`` correlation id, ``t``
target actor path, ``n`` a count, ``tok`` a stop capability), the payload the user's message.
Requests go link → server; replies, credits and notices come back on the same connection.

========== =========================================================================
kind       meaning (link → server unless noted)
========== =========================================================================
hello      open a session: ``Hello`` (who we are); reply ``ok`` with ``NodeInfo``
ping/pong  an application-level round trip (liveness itself is ZMTP heartbeats)
spawn      ``SpawnRequest``; reply ``ok`` with ``ActorInfo``
resolve    actor ``t`` by path: reply ``ok`` with ``ActorInfo`` (the sender's credit window)
tell       a message for actor ``t`` (consumes one credit of this sender)
ask        a request for actor ``t`` (consumes one credit); reply ``ok``/``err``
stop       stop actor ``t`` for good (its spawner, the node's owner, or ``tok``); reply ``ok``
stats      statistics of actor ``t``; reply ``ok``
peers      ``PeerUpdate`` (the supervisor of a node tells the others where it is now, and its key)
shutdown   stop every actor and exit (the node's owner only); reply ``ok`` first
credit     server → link: ``n`` more messages may be sent to actor ``t``
reject     server → link: a tell to ``t`` was refused (payload ``ErrorInfo``); ``n`` credits back
gone       server → link: actor ``t`` terminated (payload ``ErrorInfo`` or None)
ok / err   server → link: the reply to request ``c`` (``err`` carries an ``ErrorInfo``)
========== =========================================================================
"""

from __future__ import annotations

import builtins
import importlib
import traceback
from typing import Any, Final

import attrs

from .._cell import ActorState, ActorStatistics
from .._errors import ActorCrashed, ActorError, RemoteError, ungroup
from ._wire import MessageRegistry

HELLO: Final = "hello"
WELCOME: Final = "welcome"
PING: Final = "ping"
PONG: Final = "pong"
SPAWN: Final = "spawn"
TELL: Final = "tell"
ASK: Final = "ask"
STOP: Final = "stop"
STATS: Final = "stats"
RESOLVE: Final = "resolve"
PEERS: Final = "peers"
REJECT: Final = "reject"
CREDIT: Final = "credit"
GONE: Final = "gone"
SHUTDOWN: Final = "shutdown"
OK: Final = "ok"
ERR: Final = "err"

PROTOCOL_VERSION: Final = 2


class NodeLost(ActorError):
    """A node process exited, stopped answering heartbeats, or its connection failed."""


class MessageRejected(ActorError):
    """A node refused messages told to one of its actors (undecodable, or past the credits).

    A ``send`` cannot wait for the verdict, so it is raised by the next ``send``/``ask`` on a ref
    to the same actor (and logged, and counted); the credits the messages used came back.
    ``count`` is how many were refused since the last time it was raised (the message is the
    first one's reason).
    """

    def __init__(self, message: str, count: int = 1) -> None:
        super().__init__(
            message if count == 1 else f"{count} messages refused; the first: {message}"
        )
        self.reason = message
        self.count = count

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason, self.count))


@attrs.frozen
class Hello:
    """Who opens a connection: its system's name, incarnation, endpoints and session."""

    name: str
    incarnation: int
    endpoints: tuple[str, ...]
    session: str  # the connecting system's session id (one per ``open_actor_system``)
    owner_token: str = ""  # proves the sender started this node (shutdown rights)


@attrs.frozen
class NodeInfo:
    name: str
    pid: int
    protocol: int
    actors: tuple[str, ...]
    incarnation: int = 0
    endpoints: tuple[str, ...] = ()


@attrs.frozen
class SpawnRequest:
    target: str  # "package.module:ActorClass"
    name: str
    kwargs: dict[str, Any]
    mailbox_size: int | None
    restart: str  # a Restart value: the node's own supervisor restarts the actor accordingly
    adopt: bool = False  # a reconnecting session takes back the actor it spawned, if it is there


@attrs.frozen
class ActorInfo:
    """What a sender needs to talk to an actor: its path, accepted types, credit window, token."""

    name: str
    accepts: tuple[str, ...]  # wire names of the accepted message types; () = anything
    capacity: int  # this sender's credit window: the mailbox capacity
    token: str = ""  # the stop capability carried by refs to it


@attrs.frozen
class PeerUpdate:
    """Where a node of the run is now (sent by its supervisor to the other nodes it knows)."""

    name: str
    incarnation: int
    endpoints: tuple[str, ...]
    up: bool
    # the actors the new incarnation hosts again (respawned by the supervisor): a watched actor
    # of an older incarnation not among them (nor under one of them) died with its process
    actors: tuple[str, ...] = ()
    # the node's CURVE public key (Z85), which its name is bound to ("" without one); an
    # update with a key and no endpoints binds the name only (a restarted node's new key,
    # before its actors are back and before anyone is told where it listens)
    key: str = ""


@attrs.frozen
class ErrorInfo:
    """An exception on the wire. ``crashed``: the actor crashed (client raises ``ActorCrashed``)."""

    type_name: str
    message: str
    actor: str
    crashed: bool
    stopped: bool
    traceback: str


@attrs.frozen
class RemoteStatistics:
    name: str
    state: str
    mailbox_depth: int
    mailbox_capacity: int
    senders_waiting: int
    processed: int
    restarts: int
    dead_letters: int
    replies_outstanding: int

    @classmethod
    def of(cls, stats: ActorStatistics) -> RemoteStatistics:
        capacity = stats.mailbox_capacity
        return cls(
            stats.name,
            stats.state.value,
            stats.mailbox_depth,
            int(capacity) if capacity != float("inf") else -1,
            stats.senders_waiting,
            stats.processed,
            stats.restarts,
            stats.dead_letters,
            stats.replies_outstanding,
        )

    def local(self, name: str) -> ActorStatistics:
        return ActorStatistics(
            name=name,
            state=ActorState(self.state),
            mailbox_depth=self.mailbox_depth,
            mailbox_capacity=self.mailbox_capacity if self.mailbox_capacity >= 0 else float("inf"),
            senders_waiting=self.senders_waiting,
            processed=self.processed,
            restarts=self.restarts,
            dead_letters=self.dead_letters,
            replies_outstanding=self.replies_outstanding,
        )


PROTOCOL_TYPES: Final = (
    Hello,
    NodeInfo,
    SpawnRequest,
    ActorInfo,
    PeerUpdate,
    ErrorInfo,
    RemoteStatistics,
)


def protocol_registry() -> MessageRegistry:
    """A registry holding the protocol's own classes (each side adds the users' types); every
    field of a protocol message is checked against its annotation when it is received."""
    registry = MessageRegistry()
    for cls in PROTOCOL_TYPES:
        registry.register(cls, checked=True)
    return registry


def type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def error_info(error: BaseException, actor: str) -> ErrorInfo:
    """Describe ``error`` for the wire; an ``ActorCrashed`` is described by its cause."""
    crashed = isinstance(error, ActorCrashed)
    cause = error.error if isinstance(error, ActorCrashed) else None
    stopped = crashed and cause is None
    inner: BaseException = ungroup(cause) if cause is not None else error
    trace = "".join(traceback.format_exception(type(inner), inner, inner.__traceback__))
    message = str(inner) if not stopped else str(error)
    return ErrorInfo(type_name(type(inner)), message, actor, crashed, stopped, trace[-8000:])


_ERROR_TYPES: dict[str, type[BaseException]] = {}


def register_error(cls: type[BaseException]) -> type[BaseException]:
    """Let errors of ``cls`` raised on a node be re-raised as ``cls`` here (else ``RemoteError``).

    ``cls(message)`` must build it. Builtin exceptions and this library's errors are known.
    """
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise TypeError(f"register_error() takes an exception class, got {cls!r}")
    _ERROR_TYPES[type_name(cls)] = cls
    return cls


def _resolve_error_type(name: str) -> type[BaseException] | None:
    known = _ERROR_TYPES.get(name)
    if known is not None:
        return known
    module, _, qualname = name.partition(":")
    candidate: object = None
    if module == "builtins":
        candidate = getattr(builtins, qualname, None)
    elif module == "asyncflow_actors" or module.startswith("asyncflow_actors."):
        try:  # our own package: importing it is safe
            candidate = importlib.import_module(module)
            for part in qualname.split("."):
                candidate = getattr(candidate, part, None)
        except ImportError:
            candidate = None
    if isinstance(candidate, type) and issubclass(candidate, Exception):
        return candidate
    return None


def error_from_info(info: ErrorInfo, local_name: str) -> BaseException:
    """Rebuild the exception an ``ErrorInfo`` describes, as the caller of ``ask`` sees it."""
    inner: BaseException
    cls = _resolve_error_type(info.type_name)
    try:
        inner = cls(info.message) if cls is not None else RemoteError(info.type_name, info.message)
        if cls is not None and str(inner) != info.message:
            # a constructor that formats its argument (UnknownType(name)): keep the message
            inner = cls.__new__(cls)
            BaseException.__init__(inner, info.message)
    except Exception:
        inner = RemoteError(info.type_name, info.message)
    if cls is not None:
        add_note = getattr(inner, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            add_note(f"raised on the node by {info.actor}; remote traceback:\n{info.traceback}")
    else:
        assert isinstance(inner, RemoteError)
        inner.remote_traceback = info.traceback
    if info.crashed:
        return ActorCrashed(local_name, None if info.stopped else inner, detail="remote")
    return inner

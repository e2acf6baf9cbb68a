"""Typed errors of the actor runtime.

Every error a caller of the runtime can see is one of these (or the application's own exception,
delivered to an asker through ``ctx.reply_error``). Messages name the actor and the offending value.
"""

from __future__ import annotations

from collections.abc import Sequence


class ActorError(Exception):
    """Base class of the runtime's errors."""


class ActorCrashed(ActorError):
    """The actor a message was meant for crashed or stopped before it answered.

    ``error`` is the exception that ended the actor (``None`` when it was stopped, not crashed).
    Raised by ``ask`` for every pending and queued request of that actor, and by ``send`` to an
    actor that has terminated for good. It is chained (``__cause__``) to ``error``.
    """

    def __init__(self, name: str, error: BaseException | None, *, detail: str = "") -> None:
        self.name = name
        self.error = error
        if error is None:
            what = f"actor {name!r} stopped"
        else:
            inner = ungroup(error)
            what = f"actor {name!r} crashed: {type(inner).__name__}: {inner}"
        super().__init__(f"{what}{' (' + detail + ')' if detail else ''}")
        self.__cause__ = error

    def __reduce__(self) -> tuple[object, ...]:  # keep copy/deepcopy working with kw-only args
        return (type(self), (self.name, self.error))


class ActorKilled(ActorError):
    """An actor did not stop within its grace and was cancelled (``on_stop`` still ran, briefly).

    The exit error of an incarnation killed during a stop: watchers see it in ``Terminated`` and
    it is logged. ``grace`` is the budget, in seconds, that ran out.
    """

    def __init__(self, name: str, grace: float) -> None:
        self.name = name
        self.grace = grace
        super().__init__(f"actor {name!r} did not stop within its grace of {grace:.3g}s: killed")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.grace))


class MessageTypeError(ActorError, TypeError):
    """A message of a type the actor does not accept, or an ``ask`` of a non-``Request``."""


class NameTakenError(ActorError, ValueError):
    """Two live actors of one system were given the same name."""


class SupervisorFailed(ActorError):
    """A supervisor exceeded its restart intensity (or could not start a child) and gave up.

    ``failures`` holds the children's errors that led to it, oldest first; ``__cause__`` is the
    last one. The supervisor's own parent decides what happens next.
    """

    def __init__(self, name: str, reason: str, failures: Sequence[BaseException]) -> None:
        self.name = name
        self.reason = reason
        self.failures = tuple(failures)
        lines = [f"supervisor {name!r} failed: {reason}"]
        inner = [ungroup(f) for f in self.failures[-8:]]
        lines += [f"  - {type(f).__name__}: {f}" for f in inner]
        super().__init__("\n".join(lines))
        if self.failures:
            self.__cause__ = self.failures[-1]

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.reason, self.failures))


class RemoteError(ActorError):
    """An exception raised in another system (a node) whose type this process does not know (or
    cannot build); the transport raises it where that exception would be.

    ``type_name`` is the remote ``module:qualname``; ``remote_traceback`` the formatted trace.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(f"{type_name}: {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.type_name, self.message, self.remote_traceback))


def ungroup(error: BaseException) -> BaseException:
    """``error`` without trio's groups of one around it."""
    while True:
        group = getattr(error, "exceptions", None)  # a BaseExceptionGroup (3.10: a backport)
        if not (isinstance(group, tuple) and len(group) == 1):
            return error
        if not isinstance(group[0], BaseException):
            return error
        error = group[0]


def root_error(error: BaseException) -> BaseException:
    """The exception behind ``error``, as its author raised it: trio's groups of one unwrapped,
    an ``ActorCrashed`` or ``SupervisorFailed`` followed to its cause."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        error = ungroup(error)
        if isinstance(error, (ActorCrashed, SupervisorFailed)) and error.__cause__ is not None:
            error = error.__cause__
    return error

"""Message base types: ``Request[R]`` (an ask that returns ``R``) and ``Terminated``.

Messages are frozen attrs classes. A request declares its reply type as a type parameter so that
``await ref.ask(GetCount())`` is typed ``int`` when ``class GetCount(Request[int])``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

if TYPE_CHECKING:
    from ._ref import ActorRef

R = TypeVar("R", covariant=True)


class Request(Generic[R]):
    """Base class of messages that expect a reply of type ``R``.

    Subclass it with a frozen attrs class: ``@attrs.frozen class Ping(Request[Pong]): ...``.
    """

    __slots__ = ()


@attrs.frozen
class Terminated:
    """Delivered to a watcher when a watched actor has terminated for good.

    ``error`` is ``None`` for a normal stop. An actor that watches others must accept
    ``Terminated`` in its message type.
    """

    ref: ActorRef[Any]
    error: BaseException | None = attrs.field(eq=False)

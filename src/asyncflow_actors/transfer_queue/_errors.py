"""Typed errors of the TransferQueue.

Every error raised by the control-plane core or by :class:`FlowControl` derives from
:class:`TransferQueueError`, so a caller can catch the whole family; the subclasses say what was
wrong. A call that raises leaves the state it was called on unchanged (everything is checked
before anything is mutated).
"""

from __future__ import annotations

from collections.abc import Iterable


def _preview(values: Iterable[object], limit: int = 8) -> str:
    items = list(values)
    shown = ", ".join(repr(v) for v in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


class TransferQueueError(Exception):
    """Base class of every TransferQueue error. ``group_id``: the group the error is about,
    where it is about one group (an unknown, full or stale group in an allocation: a put of
    several groups' rows names the one that failed, so a caller can put the others again);
    else ``None``. It survives pickling (it lives in the instance's ``__dict__``)."""

    group_id: int | None = None


def about_group(exc: TransferQueueError, group_id: int) -> TransferQueueError:
    """``exc`` naming ``group_id`` as the group that failed (returned, to ``raise``)."""
    exc.group_id = group_id
    return exc


def unexpected(msg: object, exc: BaseException) -> TransferQueueError:
    """The error an actor of the queue answers ``msg`` with when handling it raised ``exc``,
    an exception no check foresaw (the actor goes on: one bad request must not cost the
    leases or the samples it holds)."""
    return TransferQueueError(f"{type(msg).__name__} failed: {type(exc).__name__}: {exc}")


class SchemaError(TransferQueueError, ValueError):
    """A spec, a configuration table, an inventory or a column write does not fit the schema."""


class InvalidArgument(TransferQueueError, ValueError):
    """An argument is out of its domain (a count that is not positive, a bad length...)."""


class UnknownTopic(TransferQueueError, LookupError):
    """The topic name is not declared."""


class UnknownColumn(TransferQueueError, LookupError):
    """A column name is not declared for the topic."""


class UnknownConsumer(TransferQueueError, LookupError):
    """A consumer name is not declared for the topic."""


class UnknownUnit(TransferQueueError, LookupError):
    """A storage-unit id is not one the state was given."""


class UnknownSample(TransferQueueError, LookupError):
    """Some sample indexes are not live (never allocated, or already freed, evicted or lost).

    ``indexes`` holds the offending indexes, so a writer can retry with the others.
    """

    topic: str = ""  # rebuilt from the wire (``cls(message)``), it knows its message only
    indexes: tuple[int, ...] = ()

    def __init__(self, topic: str, indexes: Iterable[int] = (), *, detail: str = "") -> None:
        self.topic = topic
        self.indexes = tuple(indexes)
        which = f"samples {_preview(self.indexes)}" if self.indexes or not detail else "samples"
        super().__init__(
            f"{which} of topic {topic!r} are not live "
            f"({detail or 'expected indexes allocated and not yet freed, evicted or lost'})"
        )


class UnknownGroup(TransferQueueError, LookupError):
    """The group id is not live in the topic (never opened, or already freed, evicted or lost)."""


class UnknownLease(TransferQueueError, LookupError):
    """The lease id is not outstanding (never issued, already acked, returned or expired)."""


class GroupError(TransferQueueError, ValueError):
    """A group operation does not fit the group (more members than free slots...)."""


class CapacityError(TransferQueueError):
    """A request exceeds a capacity: it does not fit now, or could never fit."""


class StaleVersionError(TransferQueueError, ValueError):
    """A version is outside what is allowed: below the staleness window, or a version moving back."""


class ShareMismatch(TransferQueueError, ValueError):
    """A rank-shared claim does not match the lease already created under its ``share_key``."""


class InventoryError(TransferQueueError, ValueError):
    """Inventory records are inconsistent (duplicate indexes, a member without its group...)."""


class StorageUnavailable(TransferQueueError):
    """A storage unit did not take or return data (it crashed, restarted, or its node is down).

    A failed ``put`` stored nothing (its samples were discarded): put again. A failed ``get``
    returned its lease (the samples that survive go out again; the lost ones are reported as a
    ``lost`` event). ``unit``: the unit that failed, where the raiser knows it.
    """

    unit: str | None = None


class ControllerUnavailable(TransferQueueError):
    """The controller did not answer: it stopped for good, or crashed again on every retry."""


class FlowControlError(TransferQueueError):
    """A :class:`FlowControl` call does not fit its state (releasing more than is in flight)."""

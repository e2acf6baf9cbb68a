"""What a failed group put means to the Rollout: a put whose samples were evicted or lost before
it committed is dropped (the queue reports them and the Driver re-injects the prompt), whether
the controller refused the commit or the client reports it as ``StorageUnavailable``."""

from __future__ import annotations

import sys
from typing import Any

import attrs
import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors.roles._group_writing import _put_outcome, _vanished
from asyncflow_actors.transfer_queue import (
    GroupError,
    StaleVersionError,
    StorageUnavailable,
    UnknownGroup,
    UnknownSample,
)

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


def dropped_before_commit() -> StorageUnavailable:
    try:
        try:
            raise UnknownSample("rollout", [152, 153])
        except UnknownSample as exc:
            raise StorageUnavailable("dropped before it committed") from exc
    except StorageUnavailable as exc:
        return exc


def test_a_put_dropped_before_its_commit_is_gone_not_a_crash() -> None:
    assert _put_outcome(UnknownSample("rollout", [1])) == "gone"
    assert _put_outcome(dropped_before_commit()) == "gone"


def test_a_unit_that_stays_unavailable_is_a_real_error() -> None:
    assert _put_outcome(StorageUnavailable("unit 'unit-0' did not answer")) is None
    assert _put_outcome(ValueError("bad shape")) is None


class EvictedGroup(UnknownGroup):
    """A subclass of the queue's error, with a name of its own."""


def test_a_failure_is_classified_by_its_type_not_its_name() -> None:
    assert _put_outcome(EvictedGroup("group 7 was evicted")) == "gone"
    assert _vanished(EvictedGroup("group 7 was evicted"))
    # errors of other origins whose class names match the queue's
    for name in ("StaleVersionError", "UnknownGroup", "UnknownSample", "GroupError"):
        lookalike = type(name, (Exception,), {})
        assert _put_outcome(lookalike("not the queue's")) is None
        assert not _vanished(lookalike("not the queue's"))


def test_refusals_in_an_exception_group_are_classified_together() -> None:
    stale = StaleVersionError("version 3 is below the window")
    assert _put_outcome(ExceptionGroup("puts", [stale, StaleVersionError("again")])) == "stale"
    mixed = ExceptionGroup("puts", [stale, ExceptionGroup("inner", [EvictedGroup("7")])])
    assert _put_outcome(mixed) == "gone" and _vanished(mixed)
    assert _put_outcome(ExceptionGroup("puts", [stale, ValueError("bad shape")])) is None


@attrs.frozen
class Refuse(afa.Request[None]):
    """Answer with the queue's refusal ``kind``."""

    kind: str


class Refuser(afa.Actor[Refuse]):
    """Refuses every put as a TQ controller in another process would."""

    async def receive(self, msg: Refuse, ctx: afa.ActorContext[Refuse]) -> Any:
        refusals = {
            "unknown sample": UnknownSample("rollout", [152, 153]),
            "stale": StaleVersionError("version 3 is below the window [4, 5]"),
            "full": GroupError("group 7 has no free slot"),
        }
        ctx.reply_error(refusals[msg.kind])


async def test_the_queue_s_refusals_cross_the_wire_as_their_types() -> None:
    """A controller in another process: its refusals reach the rollout as the queue's error
    types (``UnknownSample`` included, whose constructor takes more than a message)."""
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=["tests.roles"], transport="inproc")
        ref = await node.spawn(Refuser, name="controller")
        with trio.fail_after(30):
            with pytest.raises(UnknownSample) as unknown:
                await ref.ask(Refuse("unknown sample"))
            with pytest.raises(StaleVersionError) as stale:
                await ref.ask(Refuse("stale"))
            with pytest.raises(GroupError) as full:
                await ref.ask(Refuse("full"))
            await ref.stop()
    assert _put_outcome(unknown.value) == "gone" and _vanished(unknown.value)
    assert _put_outcome(stale.value) == "stale"
    assert _put_outcome(full.value) == "gone" and not _vanished(full.value)

"""Malformed messages: every request type of the controller and the storage units, with field
values of random (mostly wrong) types. Decoded from the wire they are refused there
(``WireError``, never another exception); delivered anyway (as a bug in a client would build
them) to the real actors, each is answered, with a typed error when it is wrong, and no actor
crashes (a crashed unit loses its samples, a crashed controller its leases)."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncflow_actors as afa
from asyncflow_actors import transfer_queue as tq
from asyncflow_actors.actors.remote._wire import encode
from asyncflow_actors.actors.remote._wire_decode import decode
from asyncflow_actors.actors.remote._wire_registry import MessageRegistry, WireError
from asyncflow_actors.transfer_queue import _messages as M
from asyncflow_actors.transfer_queue import _unit_messages as U
from asyncflow_actors.transfer_queue._checks import _fields_of, check_fields

PLAIN = tq.TopicSpec.from_dict(
    {"consumers": ["trainer"], "columns": {"x": {"dtype": "float32", "shape": [3]}}},
    name="plain",
)
INTERNAL = (M.Located, M.ShmBody, M.OpenedGroups)  # named in the union, never sent alone
CONTROLLER = [c for c in typing.get_args(M.ControllerMessage) if c not in INTERNAL]
UNIT = list(typing.get_args(U.StorageMessage))

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-2, 3) | st.text(max_size=2) | st.none(), max_size=3),
    st.tuples(st.integers(-2, 3), st.text(max_size=2)),
    st.dictionaries(st.text(max_size=2) | st.integers(-2, 3), st.integers(-2, 3), max_size=2),
)
PLAUSIBLE_STR = st.sampled_from(["plain", "trainer", "x", "unit-0", "", "nope"])


def plausible(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the annotated type (so that some messages get past the checks and into the
    handlers), with the usual names; anything else for forms it does not know."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return st.integers(-3, 2**40)
    if hint is str:
        return PLAUSIBLE_STR
    if hint is bool:
        return st.booleans()
    if hint is float:
        return st.floats(-1, 1e6)
    if hint is type(None):
        return st.none()
    if origin is Union or origin is types.UnionType:
        return st.one_of([plausible(a) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(plausible(args[0]), max_size=3).map(tuple)
    if origin is list:
        return st.lists(plausible(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(plausible(args[0]), plausible(args[1]), max_size=2)
    return WRONG


def message(cls: type) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` whose fields each hold a plausible or a random value, built past
    the checks (as a decoder without them, or a buggy sender, would hand them over)."""
    fields = _fields_of(cls)

    def build(values: list[Any]) -> Any:
        obj = object.__new__(cls)
        for name, value in zip([f[0] for f in fields], values, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    return st.tuples(*[st.one_of(WRONG, plausible(hint)) for _, hint, _ in fields]).map(
        lambda values: build(list(values))
    )


REGISTRY = MessageRegistry()
for _cls in [*CONTROLLER, *UNIT, *INTERNAL]:
    REGISTRY.register(_cls)


@pytest.mark.parametrize("cls", CONTROLLER + UNIT, ids=lambda c: c.__name__)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_malformed_message_is_refused_at_decode_never_passed_on(
    cls: type, data: st.DataObject
) -> None:
    msg = data.draw(message(cls))
    try:
        frames = encode({}, msg, registry=REGISTRY, auto_register=True)
    except WireError:
        return  # not even sendable (an int beyond 64 bits, ...)
    try:
        _, got = decode(frames, registry=REGISTRY, max_message_bytes=1 << 20)
    except WireError:
        return  # refused at decode: what a node answers the sender with
    assert type(got) is type(msg)
    check_fields(got)  # accepted: every field matches its annotation


def sends(classes: list[type]) -> st.SearchStrategy[list[Any]]:
    """One message of every class in ``classes``, in a random order."""
    return st.tuples(*[message(c) for c in classes]).flatmap(st.permutations)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sends(CONTROLLER), sends(UNIT))
def test_the_actors_answer_every_malformed_request_and_never_crash(
    to_controller: list[Any], to_unit: list[Any]
) -> None:
    async def main() -> None:
        config = tq.TransferQueueConfig(topics=(PLAIN,), units=1, unit_check_interval=3600.0)
        async with afa.open_actor_system() as system, tq.open_transfer_queue(system, config) as q:
            client = await q.client()
            await client.put("plain", {"x": trio_rows()}, version=0)
            (unit,) = q.units.values()
            for ref, batch in ((q.controller, to_controller), (unit, to_unit)):
                for msg in batch:
                    await deliver(ref, msg)
                    assert ref.statistics().restarts == 0, f"{type(msg).__name__} crashed it"
            assert await q.controller.ask(M.CheckInvariants()) == ()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def deliver(ref: Any, msg: Any) -> None:
    """Send ``msg``; a request must be answered (a value, or a ``TransferQueueError``) unless
    it is one that waits (a claim, a put for capacity, a wait for events or stores)."""
    if not isinstance(msg, afa.Request):
        await ref.send(msg)
        return
    with trio.move_on_after(1.0):
        try:
            await ref.ask(msg)
        except tq.TransferQueueError:
            pass
        return
    assert isinstance(msg, (M.Claim, M.Allocate, M.OpenGroups, M.WaitEvents, M.AwaitStores))


def trio_rows() -> Any:
    import torch

    return torch.zeros(2, 3)


def test_every_message_class_is_checked() -> None:
    for cls in [*CONTROLLER, *UNIT, *INTERNAL]:
        assert attrs.has(cls) and _fields_of(cls) is not None

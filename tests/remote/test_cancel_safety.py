"""Cancel safety of the remote runtime (issue #8 §4): credits, rejections, trackers, types."""

from __future__ import annotations

import gc
import typing

import attrs
import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import MessageRegistry
from asyncflow_actors.actors.remote._typeinfo import register_types
from tests.remote.mesh_actors import Block, Busy, Count, Nap, Sink

ALLOW = ["tests.remote"]


def credits_left(ref: afa.ActorRef[typing.Any]) -> int:
    stats = ref.statistics()
    return int(stats.mailbox_capacity) - stats.mailbox_depth


async def test_a_rejected_tell_returns_its_credit_and_the_sender_learns() -> None:
    @attrs.frozen
    class Unknown:  # defined here: no node can import it, so its node rejects it
        n: int

    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        sink = await node.spawn(Sink, name="sink")  # a mailbox of 1: one credit
        assert await sink.ask(Count()) == 1
        sent = 0
        verdicts: list[str] = []
        with trio.fail_after(10):  # without its credit back, the second send would hang
            for _ in range(3):  # more than the window
                try:
                    await sink.send(Unknown(1))
                    sent += 1
                except afa.MessageRejected as exc:  # an earlier one's verdict
                    verdicts.append(str(exc))
            while credits_left(sink) != 1:  # every verdict came back with its credit
                await trio.sleep(0.01)
        link = next(s for s in system.mesh.statistics().links if s.peer == "n")
        assert link.rejected == sent >= 2
        with pytest.raises(afa.MessageRejected):  # a verdict not yet raised is raised now
            await sink.send(Count())
        # nothing leaked: the window is whole and good messages flow
        with trio.fail_after(10):
            for _ in range(5):
                await sink.send(Count())
            assert await sink.ask(Count()) == 7
        assert verdicts and all("Unknown" in v for v in verdicts)


async def test_an_ask_keeps_its_credit_when_it_cannot_be_sent_or_is_cancelled() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        busy = await node.spawn(Busy, name="busy", mailbox_size=1)
        assert await busy.ask(Count()) == 1
        assert credits_left(busy) == 1
        with pytest.raises(afa.WireError):
            await busy.ask(Block(lambda: 1))  # type: ignore[arg-type]  # cannot be encoded
        assert credits_left(busy) == 1
        async with trio.open_nursery() as nursery:
            # one nap runs, one waits in the mailbox, one waits on the node: no credit is left
            for _ in range(3):
                nursery.start_soon(busy.ask, Nap(0.5))
                await trio.sleep(0.1)
            assert credits_left(busy) == 0
            with trio.move_on_after(0.2) as scope:
                await busy.ask(Count())  # waits for a credit, and is cancelled meanwhile
            assert scope.cancelled_caught
        with trio.fail_after(10):
            while credits_left(busy) != 1:
                await trio.sleep(0.01)
        assert await busy.ask(Count()) == 5  # the cancelled ask never left


async def test_send_tracked_says_when_buffers_may_be_reused() -> None:
    big = torch.ones(1 << 20)  # 4 MiB: leaves zero-copy
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        sink = await node.spawn(Sink, name="sink")
        tracker = await sink.send_tracked({"weights": big})
        with trio.fail_after(10):
            await tracker.wait()
        assert tracker.done
        big.fill_(2.0)  # safe now: libzmq no longer reads it
        local = await system.spawn(Sink, name="local")
        tracker = await local.send_tracked({"weights": big})
        with trio.fail_after(10):
            await tracker.wait()  # done once the local actor handled the message
        assert local.statistics().processed == 1


# -- type registration is deterministic -----------------------------------------------------------

N_PAIRS = 60
_classes: dict[str, type] = {}
for _i in range(N_PAIRS):
    # B_i is reachable from A_i only through ``list["B_i"]``: an alias that get_type_hints
    # builds anew on every call and frees right after
    _classes[f"B{_i}"] = attrs.make_class(f"B{_i}", {"x": attrs.field(type=int)}, frozen=True)
    _classes[f"A{_i}"] = attrs.make_class(
        f"A{_i}", {"items": attrs.field(type=f"list[B{_i}]")}, frozen=True
    )
for _name, _cls in _classes.items():
    _cls.__module__ = __name__
globals().update(_classes)


def test_types_reachable_only_through_freed_aliases_are_all_registered() -> None:
    gc.collect()
    registry = MessageRegistry()
    register_types(registry, *(_classes[f"A{i}"] for i in range(N_PAIRS)))
    missing = [f"B{i}" for i in range(N_PAIRS) if _classes[f"B{i}"] not in registry]
    assert missing == []

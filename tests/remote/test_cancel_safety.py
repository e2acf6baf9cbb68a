"""Cancel safety of the remote runtime (issue #8 §4): credits, rejections, trackers, types."""

from __future__ import annotations

import typing
from pathlib import Path

import attrs
import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import MessageRegistry
from asyncflow_actors.actors.remote._typeinfo import register_types
from tests.remote.mesh_actors import Block, Busy, Count, Gate, Sink

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
        refused: list[afa.MessageRejected] = []
        with trio.fail_after(10):  # without its credit back, the second send would hang
            for _ in range(3):  # more than the window
                try:
                    await sink.send(Unknown(1))
                    sent += 1
                except afa.MessageRejected as exc:  # earlier ones' verdicts
                    refused.append(exc)
            while credits_left(sink) != 1:  # every verdict came back with its credit
                await trio.sleep(0.01)
        link = next(s for s in system.mesh.statistics().links if s.peer == "n")
        assert link.rejected == sent >= 2
        counted = 1  # the first ask
        try:  # the verdicts not raised yet are raised by the next send, once
            await sink.send(Count())
            counted += 1
        except afa.MessageRejected as exc:
            refused.append(exc)
        assert sum(exc.count for exc in refused) == sent  # every refusal reached the sender
        assert all("Unknown" in str(exc) for exc in refused)
        # nothing leaked: the window is whole and good messages flow
        with trio.fail_after(10):
            for _ in range(5):
                await sink.send(Count())
            assert await sink.ask(Count()) == counted + 5 + 1


async def test_an_ask_keeps_its_credit_when_it_cannot_be_sent_or_is_cancelled(
    tmp_path: Path,
) -> None:
    gate = str(tmp_path / "open")
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        busy = await node.spawn(Busy, name="busy", mailbox_size=1)
        assert await busy.ask(Count()) == 1
        assert credits_left(busy) == 1
        with pytest.raises(afa.WireError):
            await busy.ask(Block(lambda: 1))  # type: ignore[arg-type]  # cannot be encoded
        assert credits_left(busy) == 1
        async with trio.open_nursery() as nursery:
            # one waits at the gate, one in the mailbox, one on the node: no credit is left
            for _ in range(3):
                nursery.start_soon(busy.ask, Gate(gate))
            with trio.fail_after(10):
                while credits_left(busy) != 0:
                    await trio.sleep(0.01)
            with trio.move_on_after(0.2) as scope:
                await busy.ask(Count())  # waits for a credit, and is cancelled meanwhile
            assert scope.cancelled_caught
            Path(gate).touch()
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


def test_types_reachable_only_through_freed_aliases_are_all_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 20
    b = [attrs.make_class(f"B{i}", {"x": attrs.field(type=int)}, frozen=True) for i in range(n)]
    a = [attrs.make_class(f"A{i}", {"y": attrs.field(type=int)}, frozen=True) for i in range(n)]
    target = dict(zip(a, b, strict=True))
    real = typing.get_type_hints
    returned: list[int] = []

    def fresh_aliases(tp: object, *args: object, **kwargs: object) -> dict[str, object]:
        if tp not in target:
            return real(tp, *args, **kwargs)  # type: ignore[arg-type]
        # B_i is reachable from A_i only through ``list[B_i]``, an alias that get_type_hints
        # builds anew on every call (string annotations). Place it where an alias returned
        # earlier lived, if that one was freed: what the allocator does by chance under load.
        spare = []
        alias = list[target[tp]]  # type: ignore[index]
        for _ in range(2000):
            if id(alias) in returned:
                break
            spare.append(alias)
            alias = list[target[tp]]  # type: ignore[index]
        del spare
        returned.append(id(alias))
        return {"y": alias}

    monkeypatch.setattr(typing, "get_type_hints", fresh_aliases)
    registry = MessageRegistry()
    register_types(registry, *a)
    assert [cls.__name__ for cls in b if cls not in registry] == []

"""Actors the Ray launcher tests place on Ray nodes (importable by the Ray workers; no torch)."""

from __future__ import annotations

import os
from typing import Any

import attrs

import asyncflow_actors as afa


@attrs.frozen
class Said:
    text: str


@attrs.frozen
class Heard(afa.Request[tuple[str, ...]]):
    pass


class Ear(afa.Actor[Said | Heard]):
    """Collects what it is told (it lives in the driver)."""

    def __init__(self) -> None:
        self.heard: list[str] = []

    async def receive(self, msg: Said | Heard, ctx: afa.ActorContext[Any]) -> Any:
        if isinstance(msg, Said):
            self.heard.append(msg.text)
            return None
        return tuple(self.heard)


@attrs.frozen
class Where(afa.Request[tuple[int, str, str]]):
    """This actor's process: (pid, Ray node id, Ray placement group id or "")."""


@attrs.frozen
class AskPeer(afa.Request[tuple[int, str, str]]):
    """Ask ``peer`` where it is (an actor on another node: node to node over our links)."""

    peer: afa.ActorRef[Where]


@attrs.frozen
class Size(afa.Request[int]):
    """The length of ``data`` (a large message: it travels as its own zmq frame)."""

    data: bytes


@attrs.frozen
class Env(afa.Request[str]):
    """An environment variable of this actor's process ("" if unset)."""

    name: str


class Placed(afa.Actor[Where | AskPeer | Size | Env]):
    """Says where Ray placed it; tells ``ear`` when it starts and when it stops."""

    def __init__(self, ear: afa.ActorRef[Said]) -> None:
        self.ear = ear

    async def on_start(self, ctx: afa.ActorContext[Any]) -> None:
        await self.ear.send(Said(f"{ctx.name} started"))

    async def on_stop(self, ctx: afa.ActorContext[Any], error: BaseException | None) -> None:
        await self.ear.send(Said(f"{ctx.name} stopped"))

    async def receive(self, msg: Where | AskPeer | Size | Env, ctx: afa.ActorContext[Any]) -> Any:
        if isinstance(msg, Size):
            return len(msg.data)
        if isinstance(msg, Env):
            return os.environ.get(msg.name, "")
        if isinstance(msg, AskPeer):
            return await msg.peer.ask(Where())
        import ray

        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), context.get_placement_group_id() or ""

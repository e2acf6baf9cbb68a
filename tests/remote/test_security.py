"""A wire that bounds and authorizes (issue #8 §5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
import zmq

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import (
    ActorAddress,
    MessageTooLarge,
    curve_keypair,
    decode,
    encode,
    open_zmq_socket,
    protocol_registry,
)
from asyncflow_actors.actors.remote import _protocol as P
from tests.remote.mesh_actors import Busy, Count, Sink

ALLOW = ["tests.remote"]
SMALL = afa.NodeOptions(max_message_bytes=1 << 20)  # 1 MiB


async def _raw_request(address: str, frames: list[bytes]) -> tuple[dict[str, object], object]:
    ctx = zmq.Context.instance()
    async with open_zmq_socket(ctx, zmq.DEALER, connect=address) as sock:
        await sock.send_multipart(frames)
        with trio.fail_after(10):
            reply = await sock.recv_multipart()
    return decode(reply, registry=protocol_registry(), max_message_bytes=1 << 20)


async def test_an_oversized_message_is_refused_before_it_is_buffered() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport="tcp", options=SMALL)
        sink = await node.spawn(Sink, name="sink")
        big = torch.zeros(1 << 19)  # 2 MiB
        with pytest.raises(MessageTooLarge):
            await sink.send(big)  # refused on this side: it would cost the link
        # a peer that sends it anyway is disconnected by zmq (MAXMSGSIZE) before buffering
        ctx = zmq.Context.instance()
        async with open_zmq_socket(ctx, zmq.DEALER, connect=node.address) as rogue:
            await rogue.send_multipart([b"x" * (2 << 20)])
            await trio.sleep(0.5)
        assert await sink.ask(Count()) == 1  # the node and our link are fine
        assert node.ref.statistics().restarts == 0


async def test_a_peer_that_ignores_its_credits_is_refused_not_buffered() -> None:
    registry = protocol_registry()
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport="tcp")
        busy = await node.spawn(Busy, name="busy", mailbox_size=2)
        assert await busy.ask(Count()) == 1
        ctx = zmq.Context.instance()
        async with open_zmq_socket(ctx, zmq.DEALER, connect=node.address) as rogue:
            hello = P.Hello("rogue", 1, (), "rogue-session")
            await rogue.send_multipart(encode({"k": P.HELLO, "c": 1}, hello, registry=registry))
            await rogue.send_multipart(
                encode({"k": P.RESOLVE, "c": 2, "t": "busy"}, None, registry=registry)
            )
            from tests.remote.mesh_actors import Nap

            registry.register(Nap)
            for _ in range(20):  # a window of 2: most of these must be refused
                await rogue.send_multipart(
                    encode({"k": P.TELL, "t": "busy"}, Nap(1.0), registry=registry)
                )
            rejected = 0
            # in: one in the actor, two in its mailbox, a window of two held by the node
            admitted = 1 + 2 + 2
            with trio.move_on_after(5):
                while rejected < 20 - admitted:
                    meta, _ = decode(
                        await rogue.recv_multipart(), registry=registry, max_message_bytes=1 << 20
                    )
                    rejected += meta.get("k") == P.REJECT
        assert rejected == 20 - admitted  # the node holds no more than the window


async def test_only_the_spawner_a_ref_holder_or_the_owner_may_stop_an_actor() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        busy = await node.spawn(Busy, name="busy")
        async with afa.open_actor_system(name="other") as other:
            # another system that only guesses the address (no stop token in it)
            guessed = other.mesh.resolve(ActorAddress(node.ref.name, "busy", busy._node.endpoints))
            assert await guessed.ask(Count()) == 1  # it may talk to it
            with pytest.raises(afa.NotAuthorized):
                await guessed.stop()
            # a ref that travelled (it carries the token) may stop it
            real = other.mesh.resolve(system.mesh.address_of(busy))
            await real.stop()
        with pytest.raises(afa.ActorCrashed):
            await busy.ask(Count())


async def test_only_the_owner_may_shut_a_node_down() -> None:
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW, transport="tcp")
        hello = P.Hello("stranger", 1, (), "s")
        ctx = zmq.Context.instance()
        registry = protocol_registry()
        async with open_zmq_socket(ctx, zmq.DEALER, connect=node.address) as sock:
            await sock.send_multipart(encode({"k": P.HELLO, "c": 1}, hello, registry=registry))
            with trio.fail_after(10):
                await sock.recv_multipart()
            await sock.send_multipart(encode({"k": P.SHUTDOWN, "c": 2}, None, registry=registry))
            with trio.fail_after(10):
                meta, payload = decode(
                    await sock.recv_multipart(), registry=registry, max_message_bytes=1 << 20
                )
        assert meta["k"] == P.ERR
        assert isinstance(payload, P.ErrorInfo) and "NotAuthorized" in payload.type_name
        pid = node.pid
        await trio.sleep(0.2)
        assert node.pid == pid and node.ref.statistics().restarts == 0


def _node_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "asyncflow_actors.node", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=os.getcwd())


def test_curve_without_authorized_keys_and_public_binds_without_curve_are_refused(
    tmp_path: Path,
) -> None:
    server = curve_keypair()
    keys = tmp_path / "server.keys"
    keys.write_text(f"{server.public.decode()} {server.secret.decode()}\n")
    refused = _node_cli("--bind", "tcp://127.0.0.1:*", "--curve-keys", str(keys))
    assert refused.returncode == 2 and "--authorized-keys" in refused.stderr
    public = _node_cli("--bind", "tcp://0.0.0.0:*")
    assert public.returncode == 2 and "insecure" in public.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncflow_actors.node", "--bind", "tcp://0.0.0.0:*", "--insecure"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline())["endpoints"]
        assert "WITHOUT authentication" in proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()

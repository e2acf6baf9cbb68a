"""Per-node CURVE keys: with CURVE, names are bound to keys (issue #27 §1 item 2, last clause).

Each node gets a keypair of its own; its supervisor binds its name to its key and tells the
other nodes, so a node can neither speak as another nor say where another listens, a restarted
node's new key is bound by its supervisor only, and unknown keys are refused. Real node
processes over real sockets.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors import testing as aft
from asyncflow_actors.actors.remote import (
    CurveClient,
    CurveKeypair,
    CurveServer,
    curve_keypair,
)
from asyncflow_actors.actors.remote import _protocol as P
from tests.remote.curve_actors import (
    BOGUS,
    NEWEST,
    BoundKey,
    Claim,
    Impostor,
    Keys,
    Unauthorized,
    speak,
)
from tests.remote.light_actors import Forward, Forwarder, Hello, Hi
from tests.remote.test_node_faults import _killed

ALLOW = ["tests.remote"]
REFUSED = ("NotAuthorized", "NotAuthorized")


@asynccontextmanager
async def open_keyed_system() -> AsyncIterator[afa.NodeSystem]:
    """A driver listening with CURVE in the node key model (its own key; its nodes get theirs)."""
    async with afa.open_actor_system() as system:
        await system.listen(
            "tcp://127.0.0.1:*", curve=CurveServer(curve_keypair()), key_model="node"
        )
        yield system


def _key(system: afa.NodeSystem, node: str) -> str:
    return system.mesh.peers[node].key


def _driver_key(system: afa.NodeSystem) -> str:
    assert system.mesh.keys is not None
    return system.mesh.keys.keypair.public.decode()


async def test_nodes_get_keys_of_their_own_and_the_mesh_works_across_restarts() -> None:
    async with open_keyed_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        keys = {_key(system, "a"), _key(system, "b"), _driver_key(system)}
        assert len(keys) == 3 and "" not in keys  # three systems, three keys
        assert (a.key, b.key) == (_key(system, "a"), _key(system, "b"))
        forwarder = await a.spawn(Forwarder, name="forwarder")
        hello = await b.spawn(Hello, name="hello")
        here = await system.spawn(Hello, name="here")
        assert await forwarder.ask(Forward(hello, "0")) == "hello:0"  # node -> node
        assert await forwarder.ask(Forward(here, "1")) == "here:1"  # node -> driver
        seer = await a.spawn(Impostor, name="seer")
        assert await seer.ask(BoundKey("b")) == _key(system, "b")
        old = _key(system, "b")
        for i in range(2, 4):
            with trio.fail_after(20):
                await _killed(b)
                # the restarted process has a new key, bound on A by the supervisor: A's ref
                # to B's actor reaches it on the new process
                assert await forwarder.ask(Forward(hello, str(i))) == f"hello:{i}"
            assert b.key == _key(system, "b") not in ("", old)
            assert await seer.ask(BoundKey("b")) == _key(system, "b")
            old = _key(system, "b")
        assert await seer.ask(Unauthorized()) == 0


async def test_a_node_cannot_speak_as_another_or_say_where_another_listens() -> None:
    async with open_keyed_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        c = await system.start_node("c", allow=ALLOW)
        forwarder = await a.spawn(Forwarder, name="forwarder")
        hello = await c.spawn(Hello, name="hello")
        assert await forwarder.ask(Forward(hello, "0")) == "hello:0"  # A's link to C is up
        impostor = await b.spawn(Impostor, name="impostor")
        seer = await a.spawn(Impostor, name="seer")
        # B, with its own key, says hello to A as C, then tells A that C moved: refused
        assert await impostor.ask(Claim(a.address, _key(system, "a"), "c")) == REFUSED
        # the same to the driver, as A
        driver = next(e for e in system.mesh.endpoints if e.startswith("tcp://"))
        assert await impostor.ask(Claim(driver, _driver_key(system), "a")) == REFUSED
        # as itself, B's hello is fine, but where B listens is not B's to say either
        claim = await impostor.ask(Claim(a.address, _key(system, "a"), "b"))
        assert claim == ("ok", "NotAuthorized")
        assert await seer.ask(Unauthorized()) == 3  # each refusal counted
        assert system.mesh.server is not None
        assert system.mesh.server.statistics().unauthorized == 2
        # nothing moved: A still reaches C where C is, and A still binds C to C's key
        assert await forwarder.ask(Forward(hello, "1")) == "hello:1"
        assert await seer.ask(BoundKey("c")) == _key(system, "c")
        assert system.mesh.peers["c"].endpoints != BOGUS
        assert a.ref.statistics().restarts == 0


async def test_a_restarted_nodes_new_key_is_bound_by_its_supervisor_only() -> None:
    async with open_keyed_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        seer = await b.spawn(Impostor, name="seer")
        public, secret = await seer.ask(Keys())
        old = CurveKeypair(public, secret)
        as_b = CurveClient(_key(system, "a"), old)
        hello = P.Hello("b", NEWEST, BOGUS, "old-b")
        # B's key speaks as B to A (a hello is hearsay: it moves nothing)
        assert await speak(a.address, as_b, [(P.HELLO, hello)]) == ("ok",)
        with trio.fail_after(20):
            await _killed(b)
            # B's old key is no longer B's: A no longer lets it in at all
            with pytest.raises(trio.TooSlowError):
                await speak(a.address, as_b, [(P.HELLO, hello)], within=1.0)
        # the new process's key is, bound on A by the supervisor before B's actors came back
        assert await seer.ask(Keys()) != (public, secret)
        watcher = await a.spawn(Impostor, name="watcher")
        assert await watcher.ask(BoundKey("b")) == _key(system, "b") != public
        assert await seer.ask(Claim(a.address, _key(system, "a"), "b")) == ("ok", "NotAuthorized")


async def test_a_routing_id_another_key_used_inherits_nothing_of_it() -> None:
    """A client chooses its connection's routing id: a key that takes over the id a node's
    key used (once that connection closed) is judged by its own key, not the one before."""
    async with open_keyed_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        c = await system.start_node("c", allow=ALLOW)
        keys_a = CurveKeypair(*await (await a.spawn(Impostor, name="seer")).ask(Keys()))
        keys_c = CurveKeypair(*await (await c.spawn(Impostor, name="seer")).ask(Keys()))
        server_b = _key(system, "b")
        rid = b"taken-over"
        hello_a = [(P.HELLO, P.Hello("a", NEWEST, BOGUS, "as-a"))]
        assert await speak(b.address, CurveClient(server_b, keys_a), hello_a, routing_id=rid) == (
            "ok",
        )
        # C's key, on the id A's key used: until B let go of the old connection, libzmq refuses
        # the duplicate id outright (no answer); once it has, the answer is C's key's own
        with trio.fail_after(20):
            while True:
                try:
                    got = await speak(
                        b.address, CurveClient(server_b, keys_c), hello_a, within=0.5,
                        routing_id=rid,
                    )  # fmt: skip
                    break
                except trio.TooSlowError:
                    continue
        assert got == ("NotAuthorized",)


async def test_unknown_keys_and_plain_clients_are_refused() -> None:
    async with open_keyed_system() as system:
        a = await system.start_node("a", allow=ALLOW)
        driver = next(e for e in system.mesh.endpoints if e.startswith("tcp://"))
        hello = P.Hello("stranger", 1, (), "s")
        for address, server_key in [(a.address, _key(system, "a")), (driver, _driver_key(system))]:
            for curve in (CurveClient(server_key, curve_keypair()), None):
                with pytest.raises(trio.TooSlowError):
                    await speak(address, curve, [(P.HELLO, hello)], within=0.5)
        # a node's own key is let in where its name is bound, and nowhere else
        hello_a = await a.spawn(Hello, name="hello")
        assert await hello_a.ask(Hi("still")) == "hello:still"


async def test_the_cluster_key_model_still_works_for_nodes_the_driver_starts() -> None:
    """One keypair shared by the driver and its nodes, set up by hand: every node listens with
    it, and any member may say where nodes listen (names are not bound to keys in this model)."""
    key = curve_keypair()
    async with afa.open_actor_system() as system:
        await system.listen(
            "tcp://127.0.0.1:*", curve=CurveServer(key), authorized_keys=[key.public]
        )
        a = await system.start_node("a", allow=ALLOW)
        b = await system.start_node("b", allow=ALLOW)
        assert _key(system, "a") == _key(system, "b") == key.public.decode()
        forwarder = await a.spawn(Forwarder, name="forwarder")
        hello = await b.spawn(Hello, name="hello")
        here = await system.spawn(Hello, name="here")
        assert await forwarder.ask(Forward(hello, "0")) == "hello:0"
        assert await forwarder.ask(Forward(here, "1")) == "here:1"
        with trio.fail_after(20):
            await _killed(b)
            assert await forwarder.ask(Forward(hello, "2")) == "hello:2"


async def test_a_node_started_by_hand_in_the_node_key_model(tmp_path: Path) -> None:
    own, supervisor, stranger = curve_keypair(), curve_keypair(), curve_keypair()
    (tmp_path / "node.keys").write_text(f"{own.public.decode()} {own.secret.decode()}\n")
    (tmp_path / "supervisors").write_text(supervisor.public.decode() + "\n")
    args = ["--curve-keys", str(tmp_path / "node.keys")]
    args += ["--supervisor-keys", str(tmp_path / "supervisors")]
    async with (
        aft.open_node_process(allow=ALLOW, name="h", args=args) as proc,
        afa.open_actor_system() as system,
    ):
        good = CurveClient(own.public, supervisor)
        node = await system.connect_node(proc.address, name="h", curve=good)
        ref = await node.spawn(Hello, name="hello")
        assert await ref.ask(Hi("x")) == "hello:x"
        # a key nobody bound is not let in
        impostor = CurveClient(own.public, stranger)
        with pytest.raises(trio.TooSlowError):
            await speak(proc.address, impostor, [(P.HELLO, P.Hello("y", 1, (), "s"))], within=1)
        # a supervisor binds names to keys (and says where they listen): that key is let in
        update = P.PeerUpdate("z", 1, BOGUS, True, key=stranger.public.decode())
        assert await speak(proc.address, good, [(P.PEERS, update)]) == ("ok",)
        # as a member it may not speak as the supervisor, nor say where others listen
        claims: list[tuple[str, object]] = [
            (P.HELLO, P.Hello(system.name, 1, (), "s")),
            (P.HELLO, P.Hello("z", 1, (), "s")),
            (P.PEERS, update),
        ]
        refused = ("NotAuthorized", "ok", "NotAuthorized")
        assert await speak(proc.address, impostor, claims) == refused
        assert await ref.ask(Hi("y")) == "hello:y"


def test_supervisor_keys_need_curve() -> None:
    cmd = [sys.executable, "-m", "asyncflow_actors.node", "--bind", "tcp://127.0.0.1:*"]
    done = subprocess.run(
        [*cmd, "--supervisor-keys", "/dev/null"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--supervisor-keys needs CURVE" in done.stderr

"""A node server survives any request (issue #27 §1 item 3): hypothesis sends every request kind
of the node protocol, with fields and envelope values of the wrong types, over a real socket;
the server answers each one it can address and keeps serving (0 crashes)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import (
    MessageRegistry,
    WireError,
    decode,
    encode,
    open_zmq_socket,
    protocol_registry,
)
from asyncflow_actors.actors.remote import _protocol as P
from tests.remote.light_actors import Hi

OWNER = "owner-token"
TARGET = "tests.remote.light_actors:Hello"
KINDS = (P.HELLO, P.PING, P.SPAWN, P.RESOLVE, P.TELL, P.ASK, P.STOP, P.STATS, P.PEERS, P.SHUTDOWN)
KINDS_ANSWERED = frozenset(KINDS) - {P.TELL}

_real = protocol_registry()
_real.register(Hi)
# Mirrors of the protocol's classes under the same wire names, with untyped fields: what a
# peer that sends wrong values puts on the wire.
_ROGUE = MessageRegistry()
MIRRORS: dict[type, type] = {}
for _cls in P.PROTOCOL_TYPES:
    _fields = {f.name: attrs.field() for f in attrs.fields(_cls) if f.init}
    MIRRORS[_cls] = _ROGUE.register(
        attrs.make_class(f"Rogue{_cls.__name__}", _fields, frozen=True),
        name=_real.name_of(_cls),
    )

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.one_of(st.integers(), st.text(max_size=4)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.none()), max_size=3),
)
# values of the right type, so that requests get past the checks into the handlers
plausible = st.sampled_from(
    [
        "hello",
        "fuzzed",
        OWNER,
        TARGET,
        "permanent",
        "temporary",
        "bogus:Class",
        0,
        1,
        64,
        -1,
        True,
        False,
        (),
        ("tcp://127.0.0.1:9",),
        {},
        {"x": 1},
    ]
)
value = st.one_of(plausible, junk)


def fields_of(cls: type) -> st.SearchStrategy[object]:
    """An instance of the protocol class ``cls`` with any values: well typed when the class
    accepts them (it only lies in its values), else its untyped mirror (wrong types)."""

    @st.composite
    def build(draw: st.DrawFn) -> object:
        fields = {f.name: draw(value) for f in attrs.fields(cls) if f.init}
        if draw(st.booleans()):
            try:
                return cls(**fields)
            except Exception:
                pass
        return MIRRORS[cls](**fields)

    return build()


PAYLOADS: dict[str, st.SearchStrategy[object]] = {
    P.HELLO: fields_of(P.Hello),
    P.SPAWN: fields_of(P.SpawnRequest),
    P.PEERS: fields_of(P.PeerUpdate),
    P.TELL: st.one_of(st.builds(Hi, value), value),
    P.ASK: st.one_of(st.builds(Hi, value), value),
}
meta = st.fixed_dictionaries(
    {"c": st.one_of(st.integers(0, 1 << 20), junk)},
    optional={
        "t": st.one_of(st.sampled_from(["hello", "fuzzed", "", "a/b"]), junk),
        "tok": value,
        "n": value,
        "cls": value,
    },
)


def requests(kind: str) -> st.SearchStrategy[list[tuple[object, dict[str, Any], object]]]:
    """Mostly requests of ``kind`` (with its payload class, well or badly typed), some of any."""
    payload = PAYLOADS.get(
        kind,
        st.one_of(
            st.sampled_from(list(PAYLOADS.values())).flatmap(lambda strategy: strategy), value
        ),
    )
    one = st.one_of(
        st.tuples(st.just(kind), meta, payload),
        st.tuples(st.one_of(st.sampled_from(KINDS), junk), meta, st.one_of(payload, value)),
    )
    return st.lists(one, min_size=1, max_size=10)


async def _replay(
    batch: list[tuple[object, dict[str, Any], object]], owner: bool, spawned: bool
) -> None:
    async with afa.open_actor_system(name="fuzzed", handle_signals=False) as system:
        [endpoint] = await system.mesh.listen(
            "tcp://127.0.0.1:*", allow=["tests.remote"], owner_token=OWNER
        )
        server = system.mesh.server
        assert server is not None
        prelude: list[tuple[object, dict[str, Any], object]] = [
            (P.HELLO, {"c": 1}, P.Hello("rogue", 1, (), "s", OWNER if owner else ""))
        ]
        if spawned:  # an actor the requests can name ("hello")
            prelude.append((P.SPAWN, {"c": 2}, P.SpawnRequest(TARGET, "hello", {}, 4, "permanent")))
        ctx = zmq.Context.instance()
        async with open_zmq_socket(ctx, zmq.DEALER, connect=endpoint) as sock:
            for kind, envelope, payload in [*prelude, *batch]:
                registry = _ROGUE if type(payload) in MIRRORS.values() else _real
                try:
                    frames = encode({**envelope, "k": kind}, payload, registry=registry)
                except WireError:
                    continue  # not a message our encoder writes (the decoder's fuzz has those)
                await sock.send_multipart(frames)
            await sock.send_multipart(encode({"k": P.PING}, None, registry=_real))
            with trio.fail_after(5):  # the server still answers: it did not crash
                while True:
                    reply, _ = decode(
                        await sock.recv_multipart(), registry=_real, max_message_bytes=1 << 24
                    )
                    if reply.get("k") == P.PONG:
                        break
        assert not server.statistics().failed_requests, server.statistics()


@pytest.mark.parametrize("kind", KINDS)
def test_no_request_of_any_kind_crashes_the_node_server(kind: str) -> None:
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests(kind), st.booleans(), st.booleans())
    def fuzz(
        batch: list[tuple[object, dict[str, Any], object]], owner: bool, spawned: bool
    ) -> None:
        trio.run(_replay, batch, owner, spawned)

    fuzz()

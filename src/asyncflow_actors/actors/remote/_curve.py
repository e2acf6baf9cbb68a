"""CURVE security for the runtime's sockets: keypairs, server and client settings, ZAP, and
the binding of system names to keys.

ZMQ CURVE encrypts a connection and authenticates the server by its public key; a ZAP handler
(:func:`open_zap_authenticator`) decides which clients a server lets in, by their public keys,
and tags each accepted connection's messages with the client's key (``User-Id``). A mesh that
listens with CURVE keeps a :class:`KeyBindings`: which key each system name is bound to, and
which keys may say where other systems listen (``docs/remote.md``, security).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio
import zmq
import zmq.utils.z85

from ._zmq import ZAP_ENDPOINT, TrioSocket, open_zmq_socket

# ------------------------------------------------------------------------------------- CURVE


def _z85_key(value: bytes) -> bytes:
    if len(value) == 32:
        return zmq.utils.z85.encode(value)
    if len(value) == 40:
        zmq.utils.z85.decode(value)  # validates the alphabet
        return value
    raise ValueError(f"a CURVE key is 40 bytes of Z85 or 32 raw bytes, got {len(value)} bytes")


def _key_converter(value: bytes | str) -> bytes:
    return _z85_key(value.encode("ascii") if isinstance(value, str) else bytes(value))


@attrs.frozen
class CurveKeypair:
    """A CURVE keypair as Z85 text (40 bytes each); the secret never appears in ``repr``."""

    public: bytes = attrs.field(converter=_key_converter)
    secret: bytes = attrs.field(converter=_key_converter, repr=False)


def curve_keypair() -> CurveKeypair:
    """Generate a new CURVE keypair (requires libzmq built with CURVE, as pyzmq wheels are)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support")
    public, secret = zmq.curve_keypair()
    return CurveKeypair(public, secret)


@attrs.frozen
class CurveServer:
    """CURVE on a server (usually binding) socket: encrypted, and clients authenticated by ZAP.

    The socket asks the ZAP handler of its context about every client, in ``domain``, and refuses
    connections when there is no handler (``ZAP_ENFORCE_DOMAIN``): run
    :func:`open_zap_authenticator` and ``allow(domain, keys)`` first (``keys=None`` accepts any
    client that knows the server key: encryption without client authentication).
    """

    keypair: CurveKeypair
    domain: str = "asyncflow"

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, self.domain)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


@attrs.frozen
class CurveClient:
    """CURVE on a client (usually connecting) socket: the server's public key and our keypair."""

    server_public: bytes = attrs.field(converter=_key_converter)
    keypair: CurveKeypair

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keypair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keypair.secret)


# --------------------------------------------------------------------------------------- ZAP


class ZapAuthenticator:
    """Answers ZAP requests (RFC 27) of one context from a trio task; see
    :func:`open_zap_authenticator`.

    Policy per ZAP domain: CURVE clients are accepted when their public key is allowed in the
    socket's domain (or the domain allows any key); unknown domains and other mechanisms than
    CURVE are refused, except NULL in domains without a policy (NULL authenticates nobody, and
    libzmq only asks about it when a socket sets a ZAP domain). An accepted client's Z85 public
    key becomes its ZMQ ``User-Id`` (``frame.get("User-Id")`` on received frames).
    """

    def __init__(self) -> None:
        self._policies: dict[str, frozenset[bytes] | None] = {}
        self.accepted = 0
        self.refused = 0

    def allow(self, domain: str, client_keys: Iterable[bytes | str] | None) -> None:
        """Set the clients accepted in ``domain`` (Z85 or raw public keys; ``None``: any key)."""
        self._policies[domain] = (
            None if client_keys is None else frozenset(map(_key_converter, client_keys))
        )

    def revoke(self, domain: str) -> None:
        """Drop the policy of ``domain``: its CURVE clients are refused from now on."""
        self._policies.pop(domain, None)

    def _decide(self, request: list[bytes]) -> tuple[bytes, bytes, bytes]:
        """(status code, status text, user id) for a well-formed request."""
        domain = request[2].decode("utf-8", "replace")
        mechanism = request[5]
        if mechanism == b"CURVE" and len(request) == 7 and len(request[6]) == 32:
            key = zmq.utils.z85.encode(request[6])
            if domain not in self._policies:
                return b"400", b"no policy for this ZAP domain", b""
            allowed = self._policies[domain]
            if allowed is not None and key not in allowed:
                return b"400", b"client key not allowed", b""
            return b"200", b"OK", key
        if mechanism == b"NULL" and domain not in self._policies:
            return b"200", b"OK", b""
        return b"400", b"mechanism not allowed", b""

    def _reply(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != b"1.0":
            self.refused += 1
            request_id = request[1] if len(request) > 1 else b""
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        status, text, user_id = self._decide(request)
        if status == b"200":
            self.accepted += 1
        else:
            self.refused += 1
        return [b"1.0", request[1], status, text, user_id, b""]

    async def _serve(self, sock: TrioSocket, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart(self._reply([f.bytes for f in frames]))


@asynccontextmanager
async def open_zap_authenticator(ctx: zmq.Context[Any]) -> AsyncIterator[ZapAuthenticator]:
    """Serve ZAP for ``ctx`` from a trio task while the block runs (one per context).

    Enter it before opening :class:`CurveServer` sockets in the same context. Raises
    ``zmq.ZMQError`` (``EADDRINUSE``) if the context already has a ZAP handler.
    """
    auth = ZapAuthenticator()
    async with (
        open_zmq_socket(ctx, zmq.REP, bind=ZAP_ENDPOINT) as sock,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(auth._serve, sock)
        try:
            yield auth
        finally:
            nursery.cancel_scope.cancel()


def user_id(frame: zmq.Frame) -> bytes:
    """The Z85 public key a CURVE connection authenticated with, from one of its received
    frames (ZAP's ``User-Id``); ``b""`` without CURVE (or before ZAP set one)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: a NULL connection, an inproc pipe
        return b""
    return value.encode("ascii") if isinstance(value, str) else b""


# ---------------------------------------------------------------------------------- bindings

KeyModel = Literal["cluster", "node"]
"""How the systems of a CURVE mesh are keyed. ``"cluster"``: they share one keypair (set up by
hand); any authorized key may say where systems listen, and names are not bound to keys.
``"node"``: each system has a keypair of its own; a name is bound to its system's key by the
supervisor (or the owner), and only the owner and the ``supervisor_keys`` say where systems
listen."""


class KeyBindings:
    """A CURVE mesh's view of who is who: this system's keypair, the key each name is bound
    to, and the ZAP policy that follows (the keys let in are the authorized ones, the
    supervisors', and every bound one; a key a name is no longer bound to is let in no more).

    ``bind`` is for authoritative sources only (a supervisor's launch or ``PEERS`` update, the
    owner's or a supervisor's hello); ``hear`` records the key a system proved in its own hello
    when nobody authoritative bound its name (so that this side can reach it back).
    """

    def __init__(
        self,
        keypair: CurveKeypair,
        model: KeyModel,
        *,
        authorized: Iterable[bytes | str] = (),
        supervisors: Iterable[bytes | str] = (),
        domain: str = "asyncflow",
        zap: ZapAuthenticator | None = None,
    ) -> None:
        if model not in ("cluster", "node"):
            raise ValueError(f"key_model is 'cluster' or 'node', got {model!r}")
        self.keypair = keypair
        self.model: KeyModel = model
        self.authorized = frozenset(map(_key_converter, authorized))
        self.supervisors = frozenset(map(_key_converter, supervisors))
        self.domain = domain
        self.zap = zap
        self.bound: dict[str, bytes] = {}
        self.heard: dict[str, bytes] = {}
        self._changed = trio.Event()  # set (and replaced) whenever a key becomes known
        self._refresh()

    def directs(self, key: bytes) -> bool:
        """Whether a connection proving ``key`` may say where other systems listen."""
        chosen = self.authorized if self.model == "cluster" else self.supervisors
        return bool(key) and key in chosen

    def bound_key(self, name: str, own_name: str) -> bytes | None:
        """The key ``name`` is bound to (this system's own name: its own key), else ``None``."""
        if name == own_name:
            return self.keypair.public
        return self.bound.get(name)

    def claim_refused(self, name: str, own_name: str, key: bytes) -> bool:
        """Whether a connection proving ``key`` may not speak as ``name``: the name is bound
        to another key (in the cluster model every member holds the same one)."""
        bound = self.bound_key(name, own_name)
        return bound is not None and bound != key

    def bind(self, name: str, key: bytes | str) -> bool:
        """Bind ``name`` to ``key`` (authoritative); True if that changed the binding."""
        value = _key_converter(key)
        if self.bound.get(name) == value:
            return False
        self.bound[name] = value
        self.heard.pop(name, None)
        self._refresh()
        self._learned()
        return True

    def hear(self, name: str, key: bytes) -> None:
        """``name`` proved ``key`` in its own hello; kept only while its name is not bound."""
        if key and name not in self.bound:
            self.heard[name] = key
            self._learned()

    def _learned(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_key(self, name: str, deadline: float) -> bool:
        """Whether the key of ``name`` is known, waiting for it until ``deadline``: a ref to a
        node (and where it listens) can reach this system before the supervisor's ``PEERS``
        update binding its key does, as when nodes start together. Always a checkpoint."""
        await trio.lowlevel.checkpoint()
        while self.key_of(name) is None:
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()
            if not changed.is_set():
                return False
        return True

    def key_of(self, name: str) -> bytes | None:
        """The server key to expect from ``name`` (the cluster model: the cluster key)."""
        key = self.bound.get(name) or self.heard.get(name)
        if key is None and self.model == "cluster":
            return self.keypair.public
        return key

    def client(self, name: str) -> CurveClient | None:
        """CURVE for a link to ``name`` (``None``: its key is not known here)."""
        key = self.key_of(name)
        return CurveClient(key, self.keypair) if key is not None else None

    def _refresh(self) -> None:
        if self.zap is not None:
            # our own key too: only this system and the processes it handed its key to (a
            # trainer's ranks, ``roles/_rank_keys``) can prove it
            admitted = self.authorized | self.supervisors | {self.keypair.public}
            admitted |= set(self.bound.values())
            self.zap.allow(self.domain, list(admitted))


PROCESS_KEYS: list[KeyBindings] = []
"""The keys of this process's systems listening with CURVE, oldest first (``Mesh.listen``)."""


def process_keys() -> KeyBindings | None:
    """The keys of this process's (first) system listening with CURVE, if any: the identity a
    process this one starts to act under its authority gets (a trainer's ranks,
    ``roles/_rank_keys``)."""
    return PROCESS_KEYS[0] if PROCESS_KEYS else None

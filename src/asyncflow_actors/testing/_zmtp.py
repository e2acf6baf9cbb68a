"""Cutting a ZMTP byte stream into whole units, so the link proxy can act on them.

A zmq connection over tcp or ipc carries ZMTP 3 (rfc.zeromq.org specs 23 and 37): a 64-byte
greeting, then frames. A frame is a flags byte (``MORE`` 1, ``LONG`` 2, ``COMMAND`` 4), a size (one
byte, or eight big-endian bytes when ``LONG``) and a body. Commands carry the handshake (``READY``,
or CURVE's ``HELLO``/``WELCOME``/``INITIATE``) and the heartbeats (``PING``/``PONG``); a message is
the frames up to one without ``MORE``. ``ZmtpReader`` yields the stream as greeting bytes,
commands and messages, byte-exact: whatever whole units the proxy forwards, drops, holds or
repeats, each side still reads valid ZMTP (the NULL mechanism has no sequence numbers or MACs).
A stream that does not start with a ZMTP 3 greeting is passed on as opaque ``raw`` chunks.
"""

from __future__ import annotations

from typing import Literal

import attrs
import trio

_GREETING = 64
_MORE, _LONG, _COMMAND = 1, 2, 4
_RECEIVE = 64 * 1024
HEARTBEATS = frozenset({"PING", "PONG"})


@attrs.define(eq=False, slots=True)
class Unit:
    """A whole piece of the stream: ``parts`` are its exact bytes, in order."""

    kind: Literal["greeting", "command", "message", "raw"]
    parts: list[bytes]
    name: str = ""  # a command's name ("READY", "PING", ...)
    header: bytes = b""  # a message's first frame

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


class ZmtpReader:
    """Reads one direction of a connection; ``await next()`` is the next unit, ``None`` at EOF.

    A stream that ends inside a unit yields what arrived of it as a ``raw`` unit first, so the
    other side sees the same truncated stream a direct connection would have shown it.
    """

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._pos = 0
        self._greeting_left = _GREETING
        self._signature = bytearray()
        self._raw = False
        self._eof = False
        self._partial: list[bytes] = []

    async def next(self) -> Unit | None:
        if self._eof:
            return None
        try:
            if self._raw or self._greeting_left:
                return await self._chunk()
            return await self._unit()
        except EOFError:
            self._eof = True
            rest = b"".join(self._partial) + bytes(self._buf[self._pos :])
            self._partial = []
            return Unit("raw", [rest]) if rest else None

    async def _chunk(self) -> Unit:
        """Greeting bytes as they come (libzmq sends them in steps and waits for the peer's)."""
        if self._pos == len(self._buf):
            await self._fill(1)
        end = len(self._buf) if self._raw else min(len(self._buf), self._pos + self._greeting_left)
        data = bytes(self._buf[self._pos : end])
        self._pos = end
        if self._raw:
            return Unit("raw", [data])
        self._greeting_left -= len(data)
        if len(self._signature) < 11:
            self._signature += data[: 11 - len(self._signature)]
            # 0xFF, 8 padding bytes, 0x7F, then the major version: 3 or later frames as above
            sig = self._signature
            self._raw = (
                sig[0] != 0xFF
                or (len(sig) >= 10 and sig[9] != 0x7F)
                or (len(sig) == 11 and sig[10] < 3)
            )
        return Unit("raw" if self._raw else "greeting", [data])

    async def _unit(self) -> Unit:
        self._partial = parts = list[bytes]()  # every piece taken from now on belongs to this unit
        header: bytes | None = None
        while True:
            flags = (await self._take(1))[0]
            size = int.from_bytes(await self._take(8 if flags & _LONG else 1), "big")
            body = await self._take(size)
            if flags & _COMMAND:
                if len(parts) == 3:
                    self._partial = []
                    name = body[1 : 1 + body[0]].decode("ascii", "replace") if body else ""
                    return Unit("command", parts, name=name)
                continue  # libzmq sends commands between messages only; keep it in place
            if header is None:
                header = body
            if not flags & _MORE:
                self._partial = []
                return Unit("message", parts, header=header)

    async def _take(self, n: int) -> bytes:
        if len(self._buf) - self._pos < n:
            await self._fill(n)
        data = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        self._partial.append(data)
        return data

    async def _fill(self, n: int) -> None:
        """Receive until ``n`` bytes are buffered; ``EOFError`` if the stream ends first."""
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        while len(self._buf) < n:
            data = await self._stream.receive_some(max(_RECEIVE, min(n - len(self._buf), 1 << 20)))
            if not data:
                raise EOFError
            self._buf += data

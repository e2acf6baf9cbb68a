"""trio integration for pyzmq: non-blocking ZMQ sockets driven by trio's I/O loop.

trio has no zmq support and ``zmq.asyncio`` is asyncio-only, so :class:`TrioSocket` drives a plain
``zmq.Socket`` with ``NOBLOCK`` operations and parks on ``trio.lowlevel.wait_readable(zmq.FD)``.
No thread ever makes a blocking zmq call. (pyzmq itself runs one internal thread that releases
zero-copy buffers once libzmq is done with them; that is what completes a :class:`SendTracker`.)

How waiting works
-----------------
``zmq.FD`` is *edge-triggered*: it becomes readable when libzmq has internal commands to
process, which means only "``zmq.EVENTS`` may have changed". Any ``send``/``recv`` or read of
``EVENTS`` processes those commands and may consume the edge, so the rules are:

- before waiting on the FD, a task must have seen the wanted flag missing from ``EVENTS`` *after*
  libzmq processed its commands (a wait without that can sleep forever). A receiver reads
  ``EVENTS`` first and calls ``recv`` only when it shows ``POLLIN``; right after a wake-up it calls
  ``recv`` at once, and a failed ``NOBLOCK`` ``recv`` has processed the commands itself (libzmq
  does so, unthrottled, before it returns ``EAGAIN``), so no second read is needed. A sender tries
  first and reads ``EVENTS`` on ``EAGAIN`` (a ``send`` processes commands only now and then);
- after every operation, one that failed included (a send refused with ``EHOSTUNREACH`` has
  processed commands first), if other tasks are parked, re-read ``EVENTS`` (or reuse the value
  the operation just read) and wake them when it shows what they wait for: the operation may
  have consumed the edge they were sleeping on;
- a task that gets what it wants returns one message; callers drain by calling again, which is a
  pure ``NOBLOCK`` attempt until the socket is empty (no waiting while messages are queued).

Python costs count here (a remote ask pays them several times): ``recv`` reads parts with
``Frame.more`` rather than ``RCVMORE`` (one ``getsockopt`` and enum conversion a part less), an
empty socket is detected without raising ``zmq.Again``, and a task with nobody else parked
reads ``EVENTS`` only where the rules above need it.

trio allows only one task in ``wait_readable`` per FD (else ``BusyResourceError``), yet a sender
and a receiver may both need to wait. So the first parked task becomes the *FD watcher* (it calls
``wait_readable``); the others park on a ``ParkingLot``. When the FD fires, or an operation in
another task reveals a relevant change, everyone is woken and each re-checks; one of them becomes
the next watcher. A watcher that is cancelled wakes the others so the FD never goes unwatched.
:meth:`TrioSocket.wake` does the same on demand, for a task that receives on behalf of others
while it waits for something that may happen without a message
(:meth:`TrioSocket.recv_multipart_until`).

Another task wakes the watcher with ``trio.lowlevel.notify_closing(fd)``, which makes its
``wait_readable`` raise ``ClosedResourceError`` and drops trio's registration of the FD (the next
``wait_readable`` registers it again); the watcher tells such a *nudge* from a real close by the
socket's own closed flag and re-checks as if the FD had fired. A nudge that races with the FD
firing finds no registered waiter and wakes nobody (the watcher returns normally, and the next
wait registers the FD anew); a task nudged while being cancelled re-checks like any woken task,
and the cancellation lands at its next park or checkpoint, so no message is lost. The
alternative, a cancel scope around every wait, costs more than the rest of a park on the path of
every remote ask (two per round trip), while a nudge is only needed when tasks actually share
the socket.

Cancellation semantics are those of ``trio.MemorySendChannel.send``: ``checkpoint_if_cancelled``,
then the ``NOBLOCK`` attempt, then ``cancel_shielded_checkpoint`` on success; otherwise park (a
full checkpoint) and retry, returning as soon as a retry succeeds. A cancel can only land before
the attempt or while parked, when nothing has been sent or received, so a cancelled
``recv_multipart`` never drops a message (the next call gets it) and a cancelled
``send_multipart`` sent nothing.

Multipart atomicity: the whole message is pushed by consecutive ``NOBLOCK`` sends with no await in
between. Only the first part can fail with ``EAGAIN``: libzmq counts the high-water mark in whole
messages (``pipe_t::write`` increments ``msgs_written`` on the last part only, and ``lb_t::has_out``
is true mid-message), and if a later part still failed libzmq rolls the partial message back, so
either way nothing was sent and the whole message is retried. Receiving is atomic too: libzmq
delivers all parts of a message together, so once the first part is read the rest are there.
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import trio
import zmq
import zmq.utils.z85
from trio.lowlevel import (
    ParkingLot,
    cancel_shielded_checkpoint,
    checkpoint,
    checkpoint_if_cancelled,
    notify_closing,
    wait_readable,
)

from .._ref import Tracker

if TYPE_CHECKING:
    from ._curve import CurveClient, CurveServer

__all__ = [
    "DEFAULT_COPY_THRESHOLD",
    "ZAP_ENDPOINT",
    "SendTracker",
    "TrioSocket",
    "open_monitor_socket",
    "open_zmq_socket",
]

DEFAULT_COPY_THRESHOLD: Final = 512 * 1024
"""Frames of at least this many bytes are sent zero-copy; smaller ones are copied.

A zero-copy frame costs a fixed ~30-80 µs (a tracked ``zmq.Frame`` and the release callback
through pyzmq's release thread, which must take the GIL); copying is cheaper up to 256 KiB and
dearer from 1 MiB, over tcp and inproc alike (``zmq_zero_copy_*`` in ``benchmarks/bench_wire.py``).
"""
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"

_T = TypeVar("_T")
# Plain ints: pyzmq's flags are enums, and enum arithmetic on the hot path is measurable.
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_SNDMORE: Final = int(zmq.SNDMORE)
_EVENTS: Final = int(zmq.EVENTS)


class SendTracker(Tracker):
    """Tells when libzmq has released every zero-copy frame of one sent message.

    Until ``done``, the buffers passed to ``send_multipart`` (tensor storage, arrays) may still be
    read by libzmq and must be neither modified nor reused; e.g. a double-buffered weight sender
    waits on the tracker of bucket k before refilling its buffer. Over ``inproc://`` the receiver
    holds the sender's buffer itself, so ``done`` waits until the receiver dropped the frames (and
    every tensor decoded from them). libzmq offers no FD for this, so :meth:`wait` polls with
    exponential backoff from 50 µs to 5 ms.
    """

    __slots__ = ("_trackers",)

    def __init__(self, trackers: Sequence[zmq.MessageTracker] = ()) -> None:
        self._trackers = list(trackers)

    @property
    def done(self) -> bool:
        """True once libzmq holds none of the message's zero-copy buffers."""
        while self._trackers and self._trackers[-1].done:
            self._trackers.pop()
        return not self._trackers

    async def wait(self) -> None:
        """Wait until :attr:`done`; a checkpoint even when already done."""
        await checkpoint()
        delay = 50e-6
        while not self.done:
            await trio.sleep(delay)
            delay = min(delay * 2, 5e-3)


_SENT: Final = SendTracker()  # returned by every send without zero-copy frames: always done


class TrioSocket:
    """A ``zmq.Socket`` usable from trio tasks; owns the socket and closes it in :meth:`aclose`.

    Any number of tasks may send and receive concurrently (each message is sent or received
    atomically). Operations on a closed socket, and operations parked when it is closed, raise
    ``trio.ClosedResourceError``. Errors from libzmq itself (``EHOSTUNREACH`` with
    ``ROUTER_MANDATORY``, ``ETERM``...) propagate as ``zmq.ZMQError``.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        if sock.closed:
            raise trio.ClosedResourceError("the zmq socket is already closed")
        self._sock = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        # Copying is decided per frame by send_multipart's copy_threshold, not by pyzmq.
        sock.copy_threshold = 0
        self._closed = False
        self._lot = ParkingLot()
        self._watching = False  # a task waits in wait_readable(self._fd) (see _park)
        self._nudged = False  # wake() has woken that task already
        self._parked_in = 0
        self._parked_out = 0
        self._seen = 0  # EVENTS as the last failed attempt left them (see _run)
        self.bound_endpoints: list[str] = []
        """Resolved endpoints of :meth:`bind` calls (``tcp://127.0.0.1:41234`` for ``:*``)."""
        self._ipc_files: list[tuple[str, int, int]] = []

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The wrapped socket, for options and introspection; never call blocking methods on it."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, addr: str) -> str:
        """Bind to ``addr`` and return the resolved endpoint (also kept in ``bound_endpoints``).

        The socket file of an ``ipc://`` path is removed by :meth:`aclose` (libzmq removes only
        those it created for ``ipc://*``, which live in ``$TMPDIR``, else the working directory).
        """
        self._check_open()
        self._sock.bind(addr)
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound_endpoints.append(endpoint)
        path = addr.removeprefix("ipc://")
        if addr.startswith("ipc://") and not addr.endswith("*") and not path.startswith("@"):
            try:
                st = os.stat(path)
            except OSError:
                pass
            else:
                self._ipc_files.append((path, st.st_dev, st.st_ino))
        return endpoint

    def connect(self, addr: str) -> None:
        """Connect to ``addr`` (libzmq connects in the background and reconnects as needed)."""
        self._check_open()
        self._sock.connect(addr)

    # ------------------------------------------------------------------------------ receive

    def recv_multipart_nowait(self) -> list[zmq.Frame]:
        """Receive one whole message without waiting, as zero-copy frames.

        Raises ``trio.WouldBlock`` if no message is queued.
        """
        self._check_open()
        frames = self._try_recv(False)
        if frames is None:
            raise trio.WouldBlock
        return frames

    async def recv_multipart(self) -> list[zmq.Frame]:
        """Receive one whole message as zero-copy frames (``zmq.Frame``; ``memoryview(f)``)."""
        self._check_open()
        frames = await self._run(self._try_recv, _POLLIN)
        assert frames is not None
        return frames

    async def recv_multipart_until(self, done: Callable[[], bool]) -> list[zmq.Frame] | None:
        """Like :meth:`recv_multipart`, but give up (return ``None``, nothing received) once
        ``done()`` is true when the task wakes up; :meth:`wake` makes parked tasks re-check.

        For a task that waits for one thing while receiving on behalf of others, and must also
        notice when that thing happens without a message (a link that closes fails its
        requests). ``done`` is checked after each wait, not before the first attempt.
        """
        self._check_open()
        return await self._run(self._try_recv, _POLLIN, done)

    def wake(self) -> None:
        """Make every task parked on the socket re-check (see :meth:`recv_multipart_until`)."""
        if self._lot:
            self._lot.unpark_all()
        if self._watching and not self._nudged:
            # The FD watcher sleeps in wait_readable; this wakes it with ClosedResourceError,
            # which _park tells apart from a real close (module docstring).
            self._nudged = True
            notify_closing(self._fd)

    # --------------------------------------------------------------------------------- send

    def send_multipart_nowait(
        self,
        frames: Sequence[zmq.Frame | bytes | bytearray | memoryview],
        *,
        copy_threshold: int = DEFAULT_COPY_THRESHOLD,
    ) -> SendTracker:
        """Queue one whole message without waiting; raises ``trio.WouldBlock`` if it cannot.

        Buffers of at least ``copy_threshold`` bytes are sent zero-copy and tracked by the
        returned :class:`SendTracker` (see there for when they may be reused); smaller ones are
        copied. Either every part is queued or none is (``WouldBlock``, ``TypeError``).
        """
        self._check_open()
        tracker = self._try_send(frames, copy_threshold)
        if tracker is None:
            raise trio.WouldBlock
        return tracker

    async def send_multipart(
        self,
        frames: Sequence[zmq.Frame | bytes | bytearray | memoryview],
        *,
        copy_threshold: int = DEFAULT_COPY_THRESHOLD,
    ) -> SendTracker:
        """Send one whole message, waiting while the socket cannot take it (high-water mark).

        Returns a :class:`SendTracker` for its zero-copy frames (already done if there were
        none). If cancelled, nothing was sent.
        """
        self._check_open()
        tracker = await self._run(lambda _: self._try_send(frames, copy_threshold), _POLLOUT)
        assert tracker is not None
        return tracker

    # -------------------------------------------------------------------------------- close

    async def aclose(self) -> None:
        """Close the socket (with its ``LINGER`` option) and remove its ipc socket files.

        Tasks parked on the socket get ``trio.ClosedResourceError``. Idempotent; closes even if
        cancelled.
        """
        if not self._closed:
            self._closed = True
            notify_closing(self._fd)
            self._lot.unpark_all()
            self._sock.close()
            for path, dev, ino in self._ipc_files:
                try:
                    st = os.stat(path)
                    # Only our own file: a later bind to the same path replaces it.
                    if (st.st_dev, st.st_ino) == (dev, ino) and stat.S_ISSOCK(st.st_mode):
                        os.unlink(path)
                except OSError:
                    pass
        await checkpoint()

    async def __aenter__(self) -> TrioSocket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------------------- internals

    def _events(self) -> int:
        return cast(int, self._sock.getsockopt(_EVENTS))

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the zmq socket was closed")

    def _try_recv(self, woken: bool) -> list[zmq.Frame] | None:
        """One whole message, or ``None`` with ``_seen`` set (see ``_run``).

        Right after a wake-up a message is likely queued, so it is tried at once; otherwise
        ``EVENTS`` is read first, which processes libzmq's commands like a failed ``recv`` but
        costs no ``zmq.Again`` (a Python exception) when the socket is empty, the usual case
        for a receive loop that just handled a message.
        """
        sock = self._sock
        events = -1
        if not woken:
            events = self._events()
            if not events & _POLLIN:
                self._seen = events
                self._after_op(events)
                return None
        try:
            frame = sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            # Either way libzmq processed its commands: a failed NOBLOCK recv does so before
            # giving up (unthrottled), so POLLIN is known to be false; but if EVENTS said POLLIN
            # and recv still failed, keep that answer so that _run polls instead of parking.
            self._seen = max(events, 0)
            self._after_op()
            return None
        except zmq.ZMQError:
            self._after_failure()  # as in _try_send: the failed call may have eaten the edge
            raise
        frames = [frame]
        while frame.more:  # the other parts are queued already: libzmq delivers whole messages
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame)
        self._after_op()
        return frames

    def _try_send(
        self, frames: Sequence[zmq.Frame | bytes | bytearray | memoryview], copy_threshold: int
    ) -> SendTracker | None:
        """Queue one whole message, or return ``None`` with ``_seen`` set (see ``_run``)."""
        if not frames:
            raise ValueError("a message needs at least one frame")
        zero_copy: list[bool | None] = []  # per frame: zero-copy? (None: a zmq.Frame as it is)
        for i, f in enumerate(frames):
            if type(f) is bytes:  # the usual small frame: no view needed for its size
                zero_copy.append(len(f) >= copy_threshold)
            elif isinstance(f, zmq.Frame):
                zero_copy.append(None)
            else:
                try:
                    zero_copy.append(memoryview(cast(Any, f)).nbytes >= copy_threshold)
                except TypeError:
                    raise TypeError(
                        f"frame {i} is a {type(f).__qualname__}: expected bytes, a buffer or "
                        "zmq.Frame"
                    ) from None
        sock = self._sock
        last = len(frames) - 1
        trackers: list[zmq.MessageTracker] = []
        try:
            for i, f in enumerate(frames):
                flags = _NOBLOCK if i == last else _NOBLOCK | _SNDMORE
                mode = zero_copy[i]
                if mode is None:
                    tracker = sock.send(f, flags, copy=False)
                    if tracker is not None and not tracker.done:
                        trackers.append(tracker)
                elif mode:
                    trackers.append(sock.send(f, flags, copy=False, track=True))
                else:
                    sock.send(f, flags)
        except zmq.Again:
            # Only the first part can block, and libzmq rolls back a partial message: nothing
            # was sent (module docstring). A send processes commands only now and then
            # (throttled), so EVENTS must be read before parking.
            self._seen = self._events()
            self._after_op(self._seen)
            return None
        except zmq.ZMQError:
            # Refused (EHOSTUNREACH with ROUTER_MANDATORY...) after libzmq may have processed its
            # commands, and with them the edge a parked receiver sleeps on.
            self._after_failure()
            raise
        self._after_op()
        return SendTracker(trackers) if trackers else _SENT

    async def _run(
        self,
        attempt: Callable[[bool], _T | None],
        flag: int,
        done: Callable[[], bool] | None = None,
    ) -> _T | None:
        """Run ``attempt`` (its argument: whether this task was just woken) until it succeeds,
        or until ``done()`` after a wait (then ``None``).

        An attempt that fails leaves in ``_seen`` what ``EVENTS`` says after it (libzmq's
        commands processed), which tells whether waiting on the FD is safe.
        """
        await checkpoint_if_cancelled()
        result = attempt(False)
        if result is not None:
            await cancel_shielded_checkpoint()
            return result
        # Slow path: each wait below is a full checkpoint, and a cancel can only land there,
        # before the operation happened; after a successful retry there is nothing to undo.
        spins = 0
        while True:
            if self._seen & flag:
                # EVENTS says ready but the operation would block (e.g. ROUTER_MANDATORY to a full
                # peer): no FD edge is due, so poll with backoff instead of spinning.
                spins += 1
                await trio.sleep(min(1e-5 * (1 << min(spins, 10)), 5e-3))
                self._check_open()
            else:
                spins = 0
                await self._park(flag)
            if done is not None and done():
                return None
            result = attempt(True)
            if result is not None:
                return result

    async def _park(self, flag: int) -> None:
        """Sleep until the FD fires or another task's operation may have changed ``EVENTS``."""
        if flag == _POLLIN:
            self._parked_in += 1
        else:
            self._parked_out += 1
        try:
            if not self._watching:
                self._watching = True
                self._nudged = False
                try:
                    await wait_readable(self._fd)
                except trio.ClosedResourceError:
                    if not self._nudged or self._closed:
                        raise
                    # woken by wake(): re-check, like after the FD fired
                finally:
                    self._watching = False
                    # Whether the FD fired or this watcher is leaving (cancel, close), the others
                    # must re-check and one must take over the watch.
                    if self._lot:
                        self._lot.unpark_all()
            else:
                await self._lot.park()
        finally:
            if flag == _POLLIN:
                self._parked_in -= 1
            else:
                self._parked_out -= 1
        self._check_open()

    def _after_failure(self) -> None:
        """``_after_op`` for an operation that raised; a socket libzmq no longer serves (ETERM)
        keeps the operation's own error."""
        try:
            self._after_op()
        except zmq.ZMQError:
            pass

    def _after_op(self, events: int = -1) -> None:
        """Wake parked tasks if ``EVENTS`` (read now unless given fresh) shows what they want."""
        if not (self._parked_in or self._parked_out):
            return
        if events < 0:
            events = self._events()
        if (events & _POLLIN and self._parked_in) or (events & _POLLOUT and self._parked_out):
            self.wake()


# -------------------------------------------------------------------------------- open socket


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


@asynccontextmanager
async def open_zmq_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    *,
    bind: str | Iterable[str] | None = None,
    connect: str | Iterable[str] | None = None,
    curve: CurveServer | CurveClient | None = None,
    linger: float | None = 0.0,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
    options: Mapping[int, int | bytes | str] | None = None,
) -> AsyncIterator[TrioSocket]:
    """Create a socket of ``socket_type``, configure, bind and connect it; close it on exit.

    Options are applied before any bind/connect: ``options`` (raw ``zmq`` option → value), the
    high-water marks (messages; zmq's default is 1000), then ``curve``. ``linger`` is how long,
    in seconds, unsent messages are kept after close (``None``: until delivered). It defaults to
    0 because with a positive linger ``Context.term()`` blocks the whole trio thread; protocols
    needing delivery should acknowledge instead. Bound endpoints (``tcp://127.0.0.1:*`` picks a
    free port) are listed in ``bound_endpoints``.
    """
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, -1 if linger is None else round(linger * 1000))
        for option, value in (options or {}).items():
            if isinstance(value, str):
                sock.setsockopt_string(option, value)
            else:
                sock.setsockopt(option, value)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if rcvhwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if curve is not None:
            curve.apply(sock)
        tsock = TrioSocket(sock)
        for addr in _as_list(bind):
            tsock.bind(addr)
        for addr in _as_list(connect):
            tsock.connect(addr)
    except BaseException:
        sock.close(linger=0)
        raise
    async with tsock:
        yield tsock


# ----------------------------------------------------------------------------------- monitor

_monitor_ids = itertools.count()


@asynccontextmanager
async def open_monitor_socket(sock: TrioSocket, events: int) -> AsyncIterator[TrioSocket]:
    """A PAIR socket receiving ``sock``'s monitor events (``zmq.utils.monitor`` parses them).

    Each monitor gets an inproc endpoint of its own: pyzmq's ``get_monitor_socket`` names it
    after the socket's file descriptor, and a new socket reusing the descriptor of one just
    closed (whose monitor endpoint libzmq releases asynchronously) then broke, silently.
    """
    addr = f"inproc://afa-monitor-{os.getpid()}-{next(_monitor_ids)}"
    raw = sock.socket
    raw.monitor(addr, events)
    pair = raw.context.socket(zmq.PAIR)
    try:
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(addr)
        tpair = TrioSocket(pair)
    except BaseException:
        pair.close(linger=0)
        raise
    try:
        yield tpair
    finally:
        # Stop the monitor while its PAIR is still connected: the other way round, libzmq's
        # goodbye event has nowhere to go and disable_monitor() blocks the thread.
        if not raw.closed:
            try:
                raw.disable_monitor()
            except zmq.ZMQError:
                pass
        await tpair.aclose()

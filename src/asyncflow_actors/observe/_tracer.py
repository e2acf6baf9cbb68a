"""Trace spans: what a worker did to which samples, when, at which policy version.

Each process has one :class:`Tracer` (``get_tracer()``), off until an observer (or its agent on a
node) turns it on. A span is a ``with`` block::

    with tracer.span("forward", role="actor_fwd", worker="fwd-0", samples=batch.indexes,
                     version=v):
        ...

When the tracer is off, ``span`` returns one shared no-op object: the cost is a method call and
an attribute test (``benchmarks/bench_observe.py`` measures it). When on, a span costs two
clock reads and one append to a bounded buffer; the observer drains the buffers of every process
and writes them as one Chrome/Perfetto trace (``_trace_json``).

Timestamps are ``time.perf_counter_ns()`` of the recording process; the observer maps each
process's clock onto its own (``_agent``), so spans from other hosts line up.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Final

clock_ns: Final = time.perf_counter_ns
"""The clock spans are stamped with (nanoseconds, monotonic, per process)."""

Ids = tuple[int | str, ...]
SpanRecord = tuple[str, str, str, int, int, "Ids | None", "Ids | None", "int | None", Any]
"""``(name, role, worker, start_ns, end_ns, samples, groups, version, args)`` as buffered."""


def _ids(value: int | str | Iterable[int | str] | None) -> Ids | None:
    # Hot path: a batch's indexes are already a tuple of ints (``Batch.indexes``).
    if value is None or type(value) is tuple:
        return value
    if isinstance(value, (int, str)):
        return (value,)
    return tuple(value)


class Span:
    """An open span (from ``Tracer.span``); ``set`` fills in what is known only later."""

    __slots__ = (
        "_tracer",
        "args",
        "groups",
        "name",
        "role",
        "samples",
        "start",
        "version",
        "worker",
    )

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        role: str,
        worker: str,
        samples: Ids | None,
        groups: Ids | None,
        version: int | None,
        args: dict[str, Any] | None,
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.role = role
        self.worker = worker
        self.samples = samples
        self.groups = groups
        self.version = version
        self.args = args
        self.start = 0

    def set(
        self,
        *,
        samples: int | str | Iterable[int | str] | None = None,
        group: int | str | Iterable[int | str] | None = None,
        version: int | None = None,
        **args: Any,
    ) -> None:
        """Add the samples, group(s), version or arguments learned inside the span."""
        if samples is not None:
            self.samples = _ids(samples)
        if group is not None:
            self.groups = _ids(group)
        if version is not None:
            self.version = version
        if args:
            self.args = {**(self.args or {}), **args}

    def __enter__(self) -> Span:
        self.start = clock_ns()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = clock_ns()
        args = self.args
        if exc_type is not None:
            args = {**(args or {}), "error": exc_type.__name__}
        self._tracer._append(
            (
                self.name,
                self.role,
                self.worker,
                self.start,
                end,
                self.samples,
                self.groups,
                self.version,
                args,
            )
        )


class _NoSpan:
    """What ``span`` returns while tracing is off: does nothing, as cheaply as possible."""

    __slots__ = ()

    def set(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *_: object) -> None:
        pass


NO_SPAN: Final = _NoSpan()


class Track:
    """A tracer bound to one role and worker: ``track.span("forward", samples=...)``."""

    __slots__ = ("role", "tracer", "worker")

    def __init__(self, tracer: Tracer, role: str, worker: str) -> None:
        self.tracer = tracer
        self.role = role
        self.worker = worker

    def span(
        self,
        name: str,
        *,
        samples: int | str | Iterable[int | str] | None = None,
        group: int | str | Iterable[int | str] | None = None,
        version: int | None = None,
        **args: Any,
    ) -> Span | _NoSpan:
        tracer = self.tracer
        if not tracer.enabled:
            return NO_SPAN
        return Span(
            tracer, name, self.role, self.worker, _ids(samples), _ids(group), version, args or None
        )


class Tracer:
    """The span buffer of one process (``get_tracer()``), off until ``enable``.

    The buffer holds at most ``capacity`` spans; when it is full the oldest span is dropped and
    counted in ``dropped`` (the observer drains it every collection interval, so this only
    happens when spans arrive faster than ``capacity`` per interval).
    """

    def __init__(self) -> None:
        self.enabled = False
        self.capacity = 200_000
        self._users = 0
        self.recorded = 0
        self.dropped = 0
        self._buffer: collections.deque[SpanRecord] = collections.deque()

    def enable(self, capacity: int | None = None) -> None:
        """Start recording. Calls nest: each ``enable`` is undone by one ``disable``, so an
        observer and an agent sharing a process do not turn each other's tracing off."""
        if capacity is not None:
            if not isinstance(capacity, int) or capacity < 1:
                raise ValueError(f"trace capacity must be an int >= 1, got {capacity!r}")
            self.capacity = max(capacity, self.capacity) if self._users else capacity
        if self._users == 0:
            self._buffer.clear()  # leftovers of an earlier session that nobody will collect
        self._users += 1
        self.enabled = True

    def disable(self) -> None:
        """Undo one ``enable``; spans already buffered stay until drained."""
        if self._users == 0:
            raise RuntimeError("Tracer.disable() without a matching enable()")
        self._users -= 1
        self.enabled = self._users > 0

    def span(
        self,
        name: str,
        *,
        role: str,
        worker: str,
        samples: int | str | Iterable[int | str] | None = None,
        group: int | str | Iterable[int | str] | None = None,
        version: int | None = None,
        **args: Any,
    ) -> Span | _NoSpan:
        """A span of ``name`` by ``worker`` of ``role`` over ``samples`` / ``group``.

        ``samples`` (TQ indexes) and ``group`` (group ids) may each be one id or several (a
        batch); they connect the spans of one sample across stations (flow arrows). Extra
        keyword arguments become the span's ``args`` (JSON values).
        """
        if not self.enabled:
            return NO_SPAN
        return Span(self, name, role, worker, _ids(samples), _ids(group), version, args or None)

    def track(self, role: str, worker: str) -> Track:
        return Track(self, role, worker)

    def record(
        self,
        name: str,
        *,
        role: str,
        worker: str,
        start_ns: int,
        end_ns: int,
        samples: int | str | Iterable[int | str] | None = None,
        group: int | str | Iterable[int | str] | None = None,
        version: int | None = None,
        **args: Any,
    ) -> None:
        """Record a span timed elsewhere (with ``clock_ns``), e.g. in a worker thread."""
        if self.enabled:
            self._append(
                (
                    name,
                    role,
                    worker,
                    start_ns,
                    end_ns,
                    _ids(samples),
                    _ids(group),
                    version,
                    args or None,
                )
            )

    def _append(self, record: SpanRecord) -> None:
        buffer = self._buffer
        if len(buffer) >= self.capacity:
            buffer.popleft()
            self.dropped += 1
        buffer.append(record)
        self.recorded += 1

    def drain(self, limit: int | None = None) -> list[SpanRecord]:
        """Take up to ``limit`` buffered spans, oldest first."""
        buffer = self._buffer
        n = len(buffer) if limit is None else min(limit, len(buffer))
        return [buffer.popleft() for _ in range(n)]

    def pending(self) -> int:
        return len(self._buffer)


_PROCESS_TRACER: Final = Tracer()


def get_tracer() -> Tracer:
    """This process's tracer (off until an observer or an ``ObserveAgent`` enables it)."""
    return _PROCESS_TRACER

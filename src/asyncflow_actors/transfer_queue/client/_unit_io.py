"""A client's data path to the storage units: stores and fetches, through shared memory when
the unit is on this host (and its ``/dev/shm`` is this process's), else through its socket.

Every request names the unit incarnation the controller placed the data on; a unit that
restarted refuses it. Whatever goes wrong on the way to a unit (it crashed, restarted, did not
answer in time, its segment is gone) surfaces as one :class:`StorageUnavailable`, never an
``ExceptionGroup`` of the units asked concurrently; the controller is told to check its units.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import trio

from .. import _shm
from .._errors import StorageUnavailable, TransferQueueError, UnknownSample
from .._located import Located, locate
from .._runtime import ActorCrashed, ActorRef, RawTensor, itemsize
from .._tensors import dtype_name, is_tensor, torch_module
from .._unit_messages import (
    Delete,
    Fetch,
    Fetched,
    FreeSegment,
    GetShm,
    IncarnationMismatch,
    MissingSamples,
    ShmBody,
    Store,
    Stored,
    StoreGroups,
    UnitError,
)
from ._batch import take
from ._filler import Filler

THREAD_BYTES = 1 << 20  # segments at least this big are written from a worker thread

# unit incarnation token -> its segment prefix if this process can map it (shared by clients)
_prefixes: dict[str, str | None] = {}
# segment prefix (a unit incarnation) -> free segments of its pool, as its last reply named them
_free: dict[str, list[FreeSegment]] = {}
_hinted: dict[str, tuple[FreeSegment, ...]] = {}  # prefix -> the free segments the controller
# named last (told stores get no reply: the controller passes on the units' lists)
filler = Filler()  # writes segments, keeping the mappings of those it refills (shared by clients)


class UnitIO:
    """Stores and fetches for one client. ``on_failure`` is called when a unit fails (the
    client tells the controller to check its units)."""

    def __init__(
        self,
        units: Mapping[str, ActorRef[Any]],
        *,
        shm_min_bytes: int | None,
        timeout: float,
        on_failure: Callable[[], None],
    ) -> None:
        self.units = dict(units)
        self.shm_min_bytes = shm_min_bytes
        self.timeout = timeout
        self.on_failure = on_failure
        self._nonce = os.urandom(4).hex()
        self._seq = itertools.count()
        self.direct = 0  # unit parts of leases mapped without asking their unit
        self._held: dict[str, Fill] = {}  # segments of told stores not committed yet, locked

    def close(self) -> None:
        """The client is closing: drop kept mappings of segments that are gone."""
        filler.prune()

    # -- plumbing --------------------------------------------------------------------------------

    async def _ask(self, unit: str, msg: Any) -> Any:
        try:
            with trio.fail_after(self.timeout):
                return await self.units[unit].ask(msg)
        except (ActorCrashed, IncarnationMismatch, trio.TooSlowError) as exc:
            self.on_failure()
            raise StorageUnavailable(f"storage unit {unit!r} failed: {exc}") from exc

    async def _each(
        self, work: Mapping[str, Callable[[], Any]], *, inline: bool = False
    ) -> dict[str, Any]:
        """Run one coroutine per unit concurrently; raise the first error (after all ended).
        ``inline``: the caller knows that no unit's work waits (rows in shared memory, no unit
        to ask): they run one after the other, without tasks (a nursery and its tasks cost more
        than such work), with the same results and errors."""
        results: dict[str, Any] = {}
        errors: list[BaseException] = []

        async def run(unit: str) -> None:
            try:
                results[unit] = await work[unit]()
            except Exception as exc:
                errors.append(exc)

        if len(work) == 1:  # the common case: no nursery, no task
            (unit,) = work
            results[unit] = await work[unit]()
            return results
        if inline:
            for unit in work:
                await run(unit)
        else:
            async with trio.open_nursery() as nursery:
                for unit in work:
                    nursery.start_soon(run, unit)
        if errors:
            storage = [e for e in errors if isinstance(e, StorageUnavailable)]
            raise (storage or errors)[0]
        return results

    def tell(self, unit: str, msg: Any) -> None:
        """A tell that never waits (clean-up): dropped if the unit is swamped or gone."""
        try:
            self.units[unit].send_nowait(msg)
        except (trio.WouldBlock, ActorCrashed, KeyError):
            pass

    def map_located(self, parts: Any, unit: str) -> Fetched | None:
        """The rows of a lease's located ``parts`` of ``unit``, mapped from shared memory
        without asking the unit (counted in ``direct``); ``None`` if a segment was compacted,
        freed or swept since (the unit knows where the rows are: ask it)."""
        try:
            mapped = _mapped(Fetched(parts, {}), unit)
        except StorageUnavailable:
            return None
        self.direct += 1
        return mapped

    async def _prefix(self, unit: str, incarnation: str) -> str | None:
        """The unit incarnation's segment prefix if this process can share its memory."""
        if self.shm_min_bytes is None or not incarnation:
            return None
        if incarnation not in _prefixes:
            try:
                with trio.fail_after(self.timeout):
                    info = await self.units[unit].ask(GetShm())
            except (ActorCrashed, trio.TooSlowError, TransferQueueError):
                info = None
            ok = (
                info is not None
                and info.prefix.endswith(f"{incarnation}-")
                and _shm.reachable(info)
            )
            _prefixes[incarnation] = info.prefix if ok and info is not None else None
        return _prefixes[incarnation]

    # -- writing ---------------------------------------------------------------------------------

    async def store(
        self,
        topic: str,
        incarnations: Mapping[str, str],
        positions: Mapping[str, list[int]],
        indexes: Sequence[int],
        columns: Mapping[str, Any],
        *,
        versions: Sequence[int] = (),
        group_ids: Sequence[int] = (),
        lengths: Sequence[int] = (),
        create: bool = True,
        tell: bool = False,
    ) -> dict[str, tuple[Located | None, Store | None]]:
        """Store rows ``positions[unit]`` of ``columns`` (as samples ``indexes``) on each unit;
        per unit, where new samples stored through shared memory lie (``None``: not there),
        and, with ``tell``, the ``Store`` of new samples whose segment was written for the unit
        but not sent: the caller's commit hands it to the controller, which tells the unit (no
        round trip to the unit on the put's path; ``None``: the unit was asked)."""

        spans = {unit: _span(where) for unit, where in positions.items()}
        whole = slice(0, len(indexes))  # a unit that takes every row takes the columns as given
        parts = {
            u: dict(columns) if where == whole else {c: take(v, where) for c, v in columns.items()}
            for u, where in spans.items()
        }
        payloads = {unit: _payload(part) for unit, part in parts.items()}

        held: list[str] = []  # segments of told stores written by this call

        def make(unit: str) -> Callable[[], Any]:
            async def one() -> tuple[Located | None, Store | None]:
                where, part = spans[unit], parts[unit]
                msg = Store(
                    topic,
                    incarnations.get(unit, ""),
                    _pick(indexes, where),
                    _pick(versions, where) if create else [],
                    _pick(group_ids, where) if create else [],
                    _pick(lengths, where) if create else [],
                    part,
                    create=create,
                )
                prefix = await self._prefix(unit, msg.incarnation)
                segment = ""
                located = None
                fill: Fill | None = None
                try:
                    if prefix is not None and payloads[unit] >= (self.shm_min_bytes or 0):
                        try:
                            segment, part, reused, fill = self._to_segment(prefix, part)
                            located = locate(msg.indexes, segment, part) if create else None
                            msg = Store(
                                msg.topic, msg.incarnation, msg.indexes, msg.versions,
                                msg.group_ids, msg.lengths, part, segment, create, reused,
                            )  # fmt: skip
                            await fill.run()
                        except (FileNotFoundError, BlockingIOError) as exc:  # the unit removed
                            # it (it restarted), or sweeps it: this writer stalled for so long
                            self.on_failure()
                            raise StorageUnavailable(
                                f"storage unit {unit!r}: a segment of this put went away ({exc})"
                            ) from exc
                        if tell and create:  # locked until the commit is answered: ``release``
                            self._held[segment], fill = fill, None
                            held.append(segment)
                            return located, msg
                    try:
                        stored: Stored = await self._ask(unit, msg)
                    except MissingSamples as exc:  # they left the lease (freed, or lost)
                        raise UnknownSample(topic, (), detail=f"unit {unit!r}: {exc}") from exc
                except BaseException:
                    if segment:
                        _shm.unlink(segment)  # not taken (the unit unlinks those it took)
                    raise
                finally:
                    if fill is not None:
                        fill.release()
                if prefix is not None:
                    _free[prefix] = list(stored.free)
                return located, None

            return one

        # told stores of small puts through shared memory wait for nothing: no tasks for them
        inline = (
            tell
            and create
            and sum(payloads.values()) < THREAD_BYTES
            and all(
                _prefixes.get(incarnations.get(unit, "")) and payload >= (self.shm_min_bytes or 0)
                for unit, payload in payloads.items()
            )
        )
        try:
            return await self._each({unit: make(unit) for unit in positions}, inline=inline)
        except BaseException:  # told stores of the other units will not be committed either
            self.release(held, touch=False)
            self.unlink(held)
            raise

    def release(self, segments: Sequence[str], *, touch: bool = True) -> None:
        """Let go of the segments of told stores once their commit was answered (or failed):
        until then the writer holds a lock on each, so that the unit never sweeps one as a dead
        writer's, however long the writer stalled; ``touch``: its unit may still take it (the
        sweep must wait ``shm_orphan_age`` from now)."""
        for name in segments:
            fill = self._held.pop(name, None)
            if fill is not None:
                fill.release(touch=touch)

    def _to_segment(
        self, prefix: str, part: dict[str, Any]
    ) -> tuple[str, dict[str, Any], str, Fill]:
        """Lay the part's tensor bodies out in a segment (a free one of the unit's pool if one
        fits, else a new one, created at its size); the segment, the part with
        :class:`ShmBody` references instead of the tensors, the free segment it was claimed
        from (or ``""``), and what fills it."""
        tensors: list[Any] = []
        for value in part.values():
            tensors.extend([value] if is_tensor(value) else [v for v in value if is_tensor(v)])
        bodies = [_bytes(t) for t in tensors]
        name = f"{prefix}c{self._nonce}-{next(self._seq)}"
        offsets, total = _shm.layout([b.nbytes for b in bodies])
        reused = _claim(prefix, total, name)
        try:
            if not reused:
                _shm.create(name, total)
            lock = _shm.hold(name)  # from now until it is filled: see ``Fill``
        except BaseException:
            _shm.unlink(name)
            raise
        where = iter(offsets)

        def ref(t: Any) -> ShmBody:
            return ShmBody(next(where), dtype_name(t), tuple(t.shape))

        out = {
            c: ref(v) if is_tensor(v) else [ref(x) if is_tensor(x) else x for x in v]
            for c, v in part.items()
        }
        fill = functools.partial(filler.write, name, bodies, claimed=bool(reused))
        return name, out, reused, Fill(fill, total, lock)

    async def store_groups(
        self,
        topic: str,
        incarnations: Mapping[str, str],
        groups: Mapping[str, dict[int, dict[str, Any]]],
    ) -> None:
        """Store the group-shared columns of several groups: one request per unit (``groups``:
        unit -> group id -> columns), the units concurrently."""
        work = {
            unit: functools.partial(
                self._ask, unit, StoreGroups(topic, incarnations[unit], per_group)
            )
            for unit, per_group in groups.items()
        }
        await self._each(work)

    @staticmethod
    def hint(incarnations: Mapping[str, str], free: Mapping[str, Sequence[FreeSegment]]) -> None:
        """Free segments of units as the controller last heard of them: claimable again when
        they changed since (the ones tried are struck off until then)."""
        for unit, hints in free.items():
            prefix = _prefixes.get(incarnations.get(unit, ""))
            if prefix and _hinted.get(prefix) != hints:
                _hinted[prefix] = tuple(hints)
                _free[prefix] = list(hints)

    @staticmethod
    def unlink(segments: Sequence[str]) -> None:
        """Remove segments written for told stores that no unit will take."""
        for name in segments:
            _shm.unlink(name)

    def mapped(self, incarnations: Mapping[str, str]) -> tuple[str, ...]:
        """The units (of ``incarnations``) whose segments this client is known to map."""
        if self.shm_min_bytes is None:
            return ()
        return tuple(u for u, inc in incarnations.items() if _prefixes.get(inc))

    def forget(
        self, topic: str, parts: Mapping[str, list[int]], group_ids: Sequence[int] = ()
    ) -> None:
        """Delete what a failed write left on units (tells: best effort)."""
        for unit, indexes in parts.items():
            self.tell(unit, Delete(topic, list(indexes), list(group_ids)))

    # -- reading ---------------------------------------------------------------------------------

    async def fetch(
        self,
        topic: str,
        incarnations: Mapping[str, str],
        placement: Mapping[str, Sequence[int]],
        columns: list[str],
        shared_groups: Mapping[str, Sequence[int]],
        shared_columns: list[str],
        located: Mapping[str, dict[str, list[Any]]] | None = None,
    ) -> dict[str, Fetched]:
        """Each unit's part of a lease, tensors as torch tensors (views of shared memory where
        the unit is on this host). ``located``: per unit, the parts the controller knows lie in
        shared memory (see ``_located``): mapped at once without asking the unit, which is
        asked only if a segment is gone."""

        def make(unit: str) -> Callable[[], Any]:
            async def one() -> Fetched:
                incarnation = incarnations.get(unit, "")
                shm = await self._prefix(unit, incarnation) is not None
                parts = located.get(unit) if shm and located else None
                mapped = self.map_located(parts, unit) if parts is not None else None
                if mapped is not None:
                    return mapped
                groups = list(shared_groups.get(unit, ())) if shared_columns else []
                msg = Fetch(
                    topic, incarnation, list(placement[unit]), columns, groups,
                    shared_columns, shm,
                )  # fmt: skip
                try:
                    fetched: Fetched = await self._ask(unit, msg)
                except UnitError as exc:  # it lacks samples of the lease: their data is lost
                    # (a told store whose segment went first: the controller reports them
                    # lost once the unit answers its bookkeeping)
                    raise StorageUnavailable(f"storage unit {unit!r}: {exc}") from exc
                return _mapped(fetched, unit) if shm else fetched

            return one

        return await self._each({unit: make(unit) for unit in placement})


class Fill:
    """Filling a segment: ``write()`` copies ``nbytes`` into it; ``lock``: the writer's shared
    lock on it (a descriptor, so that the unit neither recycles it while it is written nor
    sweeps it before it took it), until ``release()``."""

    def __init__(self, write: Callable[[], Any], nbytes: int, lock: int) -> None:
        self.write = write
        self.nbytes = nbytes
        self._lock = lock

    async def run(self) -> None:
        """Fill it (from a worker thread from ``THREAD_BYTES`` on: the copy releases the GIL,
        so the event loop serves other tasks meanwhile); the lock stays until ``release()``:
        the writer holds it until the unit took the segment, or its commit was answered."""
        if self.nbytes < THREAD_BYTES:
            self.write()
        else:  # not abandoned if cancelled: the segment is unlinked only once written
            await trio.to_thread.run_sync(self.write)

    def release(self, *, touch: bool = False) -> None:
        """Let go of the lock (``touch``: see ``_shm.let_go``)."""
        if self._lock >= 0:
            _shm.let_go(self._lock, touch=touch)
            self._lock = -1


def _claim(prefix: str, total: int, name: str) -> str:
    """Claim, as ``name``, a free segment of the unit's pool that holds ``total`` bytes without
    wasting more than as much again; the free name it had (``""``: none, write a new one)."""
    hints = _free.get(prefix)
    if not hints:
        return ""
    for free in sorted((h for h in hints if total <= h.size <= 2 * total), key=lambda h: h.size):
        hints.remove(free)  # tried once: claimed now, or taken by another writer
        if _shm.claim(free.name, name):
            return free.name
    return ""


def _span(positions: list[int]) -> slice | list[int]:
    """``positions`` as a slice if they are one run (the usual case: a put's slice for a
    unit), so that every column and list is cut once, as a view."""
    first = positions[0]
    if positions == list(range(first, first + len(positions))):
        return slice(first, first + len(positions))
    return positions


def _pick(values: Sequence[int], where: slice | list[int]) -> list[int]:
    return list(values[where]) if isinstance(where, slice) else [values[p] for p in where]


def _payload(part: Mapping[str, Any]) -> int:
    total = 0
    for value in part.values():
        if is_tensor(value):
            total += value.numel() * value.element_size()
        else:
            total += sum(v.numel() * v.element_size() for v in value if is_tensor(v))
    return int(total)


def _bytes(t: Any) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    if t.is_contiguous():
        try:  # one call where numpy has the dtype (a quarter of the general path's cost)
            return memoryview(t.numpy()).cast("B")
        except (TypeError, RuntimeError):
            pass  # bfloat16 and the like, conjugate views: reinterpreted as bytes below
    torch = torch_module()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _mapped(fetched: Fetched, unit: str) -> Fetched:
    """``fetched`` with its :class:`ShmBody` references replaced by tensors on the segments."""
    maps: dict[str, Any] = {}

    def view(ref: Any) -> Any:
        if not isinstance(ref, ShmBody):
            return ref
        mapping = maps.get(ref.segment)
        if mapping is None:
            try:
                mapping = maps[ref.segment] = _shm.map_for_reading(ref.segment)
            except OSError as exc:
                raise StorageUnavailable(
                    f"storage unit {unit!r}: segment {ref.segment!r} is gone ({exc})"
                ) from exc
        return _tensor(mapping, ref)

    columns = {
        c: [[view(v) for v in p] if isinstance(p, list) else view(p) for p in parts]
        for c, parts in fetched.columns.items()
    }
    return Fetched(columns, fetched.shared)


# wire dtypes numpy has, as numpy dtypes: their bodies are mapped as numpy arrays, then handed
# to torch (a third of the cost of a torch ``frombuffer`` and its reinterpretation)
_NUMPY = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip


def _tensor(mapping: Any, ref: ShmBody) -> Any:
    count = math.prod(ref.shape)
    dtype = _NUMPY.get(ref.dtype)
    if dtype is not None and count:
        array = np.frombuffer(mapping, dtype, count, ref.offset).reshape(ref.shape)
        return torch_module().from_numpy(array)
    data = memoryview(mapping)[ref.offset : ref.offset + itemsize(ref.dtype) * count]
    return RawTensor(ref.dtype, tuple(ref.shape), data).to_torch()

"""A storage unit on its own: blocks, exact rows, memory accounting, compaction, incarnations,
bookkeeping, and the shared-memory segments it owns."""

from __future__ import annotations

import gc
import mmap
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
import trio

import asyncflow_actors as afa
from asyncflow_actors.actors.remote import RawTensor
from asyncflow_actors.transfer_queue import _shm
from asyncflow_actors.transfer_queue import _unit_messages as S
from asyncflow_actors.transfer_queue._tensors import dtype_name
from asyncflow_actors.transfer_queue.client import _filler, _unit_io
from asyncflow_actors.transfer_queue.client._filler import Filler
from asyncflow_actors.transfer_queue.storage._unit import StorageUnit


def raw(t: torch.Tensor) -> RawTensor:
    return RawTensor(
        str(t.dtype).removeprefix("torch."), tuple(t.shape), memoryview(t.numpy()).cast("B")
    )


def back(value: Any) -> torch.Tensor:
    return value.to_torch() if isinstance(value, RawTensor) else value


def store(token: str, indexes: list[int], columns: dict[str, Any], **kw: Any) -> S.Store:
    n = len(indexes)
    return S.Store("t", token, indexes, [0] * n, indexes, [1] * n, columns, **kw)


def fetch(token: str, indexes: list[int], columns: list[str], **kw: Any) -> S.Fetch:
    return S.Fetch("t", token, indexes, columns, [], [], **kw)


@pytest.fixture
async def unit() -> AsyncIterator[tuple[Any, str]]:
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: StorageUnit("u"), name="u")
        yield ref, await ref.ask(S.GetToken())


@pytest.mark.parametrize("as_raw", [False, True])
async def test_store_fetch_rewrite_delete(as_raw: bool) -> None:
    wrap = raw if as_raw else (lambda t: t)
    tokens = torch.arange(24).reshape(6, 4)
    async with afa.open_actor_system() as system:
        unit = await system.spawn(lambda: StorageUnit("u"), name="u")
        me = await unit.ask(S.GetToken())
        text = ["a", "bb", "c", "d", "e", "f"]
        await unit.ask(store(me, [10, 11, 12, 13, 14, 15], {"tokens": wrap(tokens), "text": text}))
        got = await unit.ask(fetch(me, [11, 12, 13], ["tokens", "text"]))
        (part,) = got.columns["tokens"]  # rows stored together: one slice of one buffer
        assert torch.equal(back(part), tokens[1:4])
        assert got.columns["text"] == [["bb", "c", "d"]]
        out_of_order = await unit.ask(fetch(me, [15, 10], ["tokens"]))
        assert [back(p).tolist() for p in out_of_order.columns["tokens"]] == [
            tokens[5:6].tolist(),
            tokens[0:1].tolist(),
        ]
        stats = await unit.ask(S.GetStorageStatistics())
        assert (stats.samples, stats.zero_copy_fetches) == (6, 1)
        assert stats.nbytes == stats.live_nbytes == 32 * 6 + 7
        # a computed column arrives later for some samples; a rewrite replaces bytes, not adds
        lp = {"lp": wrap(torch.ones(2, 4))}
        await unit.ask(store(me, [11, 12], lp, create=False))
        await unit.ask(store(me, [11], {"lp": wrap(torch.zeros(1, 4))}, create=False))
        got = await unit.ask(fetch(me, [11, 12], ["lp", "tokens"]))
        assert [back(p).tolist() for p in got.columns["lp"]] == [[[0.0] * 4], [[1.0] * 4]]
        stats = await unit.ask(S.GetStorageStatistics())
        assert stats.live_nbytes == 32 * 6 + 7 + 16 * 2
        assert stats.nbytes == 32 * 6 + 7 + 16 * 2 + 16  # the rewritten row is still held
        inv = await unit.ask(S.GetInventory())
        by_index = {s.index: s for s in inv.samples["t"]}
        assert by_index[11].columns == {"tokens": 32, "text": 2, "lp": 16}
        with pytest.raises(S.UnitError, match="holds no samples"):  # columns for gone samples
            await unit.ask(store(me, [99], lp | {"lp": wrap(torch.ones(1, 4))}, create=False))
        with pytest.raises(S.UnitError, match="indexes repeat"):  # one row per sample
            await unit.ask(store(me, [11, 11], lp, create=False))
        await unit.ask(S.UnitBatch(me, [S.Delete("t", [10, 11, 12, 13, 14, 15], [])]))
        stats = await unit.ask(S.GetStorageStatistics())
        assert (stats.samples, stats.nbytes, stats.live_nbytes) == (0, 0, 0)
        with pytest.raises(S.UnitError, match="holds no samples"):
            await unit.ask(fetch(me, [10], ["tokens"]))
        assert (await unit.ask(S.GetStorageStatistics())).samples == 0  # bad input: no crash


async def test_rows_of_different_lengths_come_back_exactly(unit: Any) -> None:
    ref, me = unit
    short, long = torch.arange(6).reshape(2, 3), torch.arange(10).reshape(2, 5)
    await ref.ask(store(me, [0, 1], {"r": raw(short)}))
    await ref.ask(store(me, [2, 3], {"r": raw(long)}))
    await ref.ask(store(me, [4], {"r": [raw(torch.arange(7))]}))
    got = await ref.ask(fetch(me, [0, 1, 2, 3, 4], ["r"]))
    parts = got.columns["r"]
    assert [back(parts[0]).tolist(), back(parts[1]).tolist()] == [short.tolist(), long.tolist()]
    assert [back(v).tolist() for v in parts[2]] == [list(range(7))]


async def test_shared_bytes_are_counted_exactly(unit: Any) -> None:
    ref, me = unit
    for gid in range(3):
        await ref.ask(S.StoreGroups("t", me, {gid: {"prompt": raw(torch.arange(5))}}))
    assert (await ref.ask(S.GetStorageStatistics())).shared_nbytes == 3 * 40
    await ref.ask(S.StoreGroups("t", me, {0: {"prompt": raw(torch.arange(2))}}))  # rewrite
    assert (await ref.ask(S.GetStorageStatistics())).shared_nbytes == 2 * 40 + 16
    await ref.ask(S.UnitBatch(me, [S.Delete("t", [], [0, 1, 2])]))
    stats = await ref.ask(S.GetStorageStatistics())
    assert (stats.shared_nbytes, stats.nbytes, stats.groups) == (0, 0, 0)


async def test_memory_is_accounted_by_what_is_held_and_mostly_dead_blocks_compact(
    unit: Any,
) -> None:
    ref, me = unit
    rows = torch.arange(64 * 512, dtype=torch.int64).reshape(64, 512)  # 64 rows of 4 KiB
    await ref.ask(store(me, list(range(64)), {"x": raw(rows), "n": list(range(64))}))
    held = 64 * 4096 + 64 * 8
    assert (await ref.ask(S.GetStorageStatistics())).nbytes == held
    await ref.ask(S.UnitBatch(me, [S.Delete("t", list(range(0, 30)), [])]))
    stats = await ref.ask(S.GetStorageStatistics())
    assert (stats.live_nbytes, stats.nbytes, stats.compactions) == (34 * 4104, held, 0)
    await ref.ask(S.UnitBatch(me, [S.Delete("t", list(range(30, 48)), [])]))  # under half live
    stats = await ref.ask(S.GetStorageStatistics())
    assert stats.compactions == 1
    assert stats.nbytes == stats.live_nbytes == 16 * 4104  # the rest is freed
    got = await ref.ask(fetch(me, list(range(48, 64)), ["x", "n"]))
    (x,) = got.columns["x"]
    assert torch.equal(back(x), rows[48:])
    assert got.columns["n"] == [list(range(48, 64))]


async def test_requests_for_another_incarnation_are_refused(unit: Any) -> None:
    ref, me = unit
    await ref.ask(store(me, [0], {"x": raw(torch.ones(1, 2))}))
    with pytest.raises(S.IncarnationMismatch):
        await ref.ask(store("earlier", [1], {"x": raw(torch.ones(1, 2))}))
    with pytest.raises(S.IncarnationMismatch):
        await ref.ask(fetch("earlier", [0], ["x"]))
    info = S.TopicInfo("t", 3, 100, 50)
    with pytest.raises(S.IncarnationMismatch):
        await ref.ask(S.UnitBatch("earlier", [S.Delete("t", [0], []), info]))
    inv = await ref.ask(S.GetInventory())
    assert [s.index for s in inv.samples["t"]] == [0] and inv.topics == [info]  # watermarks hold
    fresh = await ref.ask(S.Reset())
    assert fresh != me
    stats = await ref.ask(S.GetStorageStatistics())
    assert (stats.samples, stats.nbytes, stats.incarnation) == (0, 0, fresh)


async def test_bookkeeping_is_idempotent_and_feeds_the_inventory(unit: Any) -> None:
    ref, me = unit
    await ref.ask(store(me, [0, 1, 2], {"x": raw(torch.ones(3, 2))}))
    items = [
        S.GroupInfo("t", 7, 4, 1),
        S.Committed("t", [0, 1]),
        S.MarkConsumed("t", "fwd", [0]),
        S.TopicInfo("t", 1, 10, 10),
        S.GroupInfo("t", 7, 3, 2),
        S.Delete("t", [1], []),
    ]
    await ref.ask(S.UnitBatch(me, items))
    once = await ref.ask(S.GetInventory())
    await ref.ask(S.UnitBatch(me, items))  # a controller that crashed mid-flush sends it again
    assert await ref.ask(S.GetInventory()) == once
    samples = {s.index: (s.committed, s.consumed) for s in once.samples["t"]}
    assert samples == {0: (True, ["fwd"]), 2: (False, [])}
    groups = {g.group_id: (g.size, g.committed, g.explicit) for g in once.groups["t"]}
    assert groups == {7: (3, 2, True), 0: (1, 1, False), 2: (1, 0, False)}


# -- shared memory -----------------------------------------------------------------------------

needs_shm = pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")


def segments(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(_shm.SHM_DIR) if n.startswith(namespace))


@needs_shm
async def test_segments_are_owned_unlinked_and_swept_by_the_unit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    namespace = f"afa-test{os.urandom(3).hex()}-u-"
    rows = torch.arange(4 * 1024, dtype=torch.float32).reshape(4, 1024)
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: StorageUnit("u", shm=namespace), name="u")
        me = await ref.ask(S.GetToken())
        info = await ref.ask(S.GetShm())
        assert info.prefix == f"{namespace}{me}-" and segments(namespace) == [info.probe]
        name = f"{info.prefix}c1-0"
        (offset,) = _shm.write_segment(name, [memoryview(rows.numpy()).cast("B")])
        body = S.ShmBody(offset, "float32", (4, 1024))
        await ref.ask(store(me, [0, 1, 2, 3], {"x": body}, segment=name))
        got = await ref.ask(fetch(me, [1, 2], ["x"], shm=True))
        (ref_part,) = got.columns["x"]
        assert ref_part == S.ShmBody(offset + 4096, "float32", (2, 1024), name)
        mapping = _shm.map_for_reading(name)
        view = torch.frombuffer(mapping, dtype=torch.float32, count=2048, offset=offset + 4096)
        assert torch.equal(view.reshape(2, 1024), rows[1:3])
        plain = await ref.ask(fetch(me, [0], ["x"]))  # a reader elsewhere: the bytes themselves
        assert torch.equal(back(plain.columns["x"][0]), rows[:1])
        await ref.ask(S.UnitBatch(me, [S.Delete("t", [0, 1, 2, 3], [])]))
        assert name not in segments(namespace)  # no live row left: unlinked
        assert torch.equal(view.reshape(2, 1024), rows[1:3])  # the reader's view stays valid
        # a writer that died after creating a segment, before handing it over: swept
        orphan = f"{info.prefix}c2-0"
        _shm.write_segment(orphan, [memoryview(b"x" * 10)])
        os.utime(_shm.path(orphan), (0, 0))
        await trio.sleep(60)
        assert segments(namespace) == [info.probe]
        # a store meant for an earlier incarnation: refused, and its segment removed
        stale = f"{namespace}earlier-c3-0"
        _shm.write_segment(stale, [memoryview(b"y" * 16)])
        with pytest.raises(S.IncarnationMismatch):
            await ref.ask(
                store("earlier", [5], {"x": S.ShmBody(0, "uint8", (1, 16))}, segment=stale)
            )
        assert stale not in segments(namespace)
        last = f"{info.prefix}c1-1"
        _shm.write_segment(last, [memoryview(rows[:1].numpy()).cast("B")])
        await ref.ask(store(me, [9], {"x": S.ShmBody(0, "float32", (1, 1024))}, segment=last))
        assert last in segments(namespace)
    assert segments(namespace) == []  # the unit stopped: everything of it is gone


@needs_shm
async def test_a_segment_just_handed_out_is_compacted_only_after_its_grace(
    autojump_clock: trio.testing.MockClock,
) -> None:
    namespace = f"afa-test{os.urandom(3).hex()}-u-"
    rows = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)  # 64 rows of 4 KiB
    async with afa.open_actor_system() as system:
        ref = await system.spawn(lambda: StorageUnit("u", shm=namespace), name="u")
        me = await ref.ask(S.GetToken())
        info = await ref.ask(S.GetShm())
        name = f"{info.prefix}c1-0"
        (offset,) = _shm.write_segment(name, [memoryview(rows.numpy()).cast("B")])
        body = S.ShmBody(offset, "float32", (64, 1024))
        await ref.ask(store(me, list(range(64)), {"x": body}, segment=name))
        await ref.ask(S.UnitBatch(me, [S.Committed("t", list(range(64)))]))
        await ref.ask(fetch(me, [60, 61], ["x"], shm=True))  # a reader may still have to map it
        await ref.ask(S.UnitBatch(me, [S.Delete("t", list(range(56)), [])]))  # 8 of 64 live
        stats = await ref.ask(S.GetStorageStatistics())
        assert (stats.compactions, stats.nbytes) == (0, 64 * 4096)  # not yet: it waits
        await trio.sleep(31)  # the grace passes; the unit's sweeper compacts
        stats = await ref.ask(S.GetStorageStatistics())
        assert stats.compactions == 1 and stats.nbytes == stats.live_nbytes == 8 * 4096
        assert name not in segments(namespace)  # the live rows moved to a segment of the unit's
        got = await ref.ask(fetch(me, list(range(56, 64)), ["x"]))
        assert torch.equal(back(got.columns["x"][0]), rows[56:])
        # rows not committed yet: their writer may still be filling the segment (a put's store
        # overlaps its fill), so they are not copied out before their commit
        name = f"{info.prefix}c1-1"
        (offset,) = _shm.write_segment(name, [memoryview(rows.numpy()).cast("B")])
        body = S.ShmBody(offset, "float32", (64, 1024))
        await ref.ask(store(me, list(range(100, 164)), {"x": body}, segment=name))
        await ref.ask(S.UnitBatch(me, [S.Delete("t", list(range(100, 156)), [])]))
        await trio.sleep(31)
        assert (await ref.ask(S.GetStorageStatistics())).compactions == 1  # waits
        await ref.ask(S.UnitBatch(me, [S.Committed("t", list(range(156, 164)))]))
        await trio.sleep(11)
        assert (await ref.ask(S.GetStorageStatistics())).compactions == 2
        got = await ref.ask(fetch(me, list(range(156, 164)), ["x"]))
        assert torch.equal(back(got.columns["x"][0]), rows[56:])


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
def test_a_segment_is_recycled_only_when_no_reader_maps_it() -> None:
    prefix = f"afa-test-{os.getpid()}-{os.urandom(4).hex()}-"
    name, free, mine = prefix + "c0", prefix + "f0", prefix + "c1"
    _shm.write_segment(name, [memoryview(b"a" * 4096)])
    try:
        mapping = _shm.map_for_reading(name)
        view = memoryview(mapping)[:4]
        again = _shm.map_for_reading(name)  # another view: its own private mapping
        again[0:1] = b"z"  # a reader's write stays in its own mapping
        assert bytes(view) == b"aaaa"
        del again
        assert not _shm.recycle(name, free)  # a reader maps it: not refilled
        del view, mapping
        gc.collect()
        assert _shm.recycle(name, free)  # the last mapping went, and the lock with it
        with pytest.raises(FileNotFoundError):
            _shm.map_for_reading(name)  # a reader late with its reference finds it gone
        assert _shm.claim(free, mine) and not _shm.claim(free, prefix + "c2")  # one writer wins
        lock = _shm.hold(mine)  # its writer fills it: not recycled meanwhile, either
        assert not _shm.recycle(mine, prefix + "f1")
        os.close(lock)
        assert _shm.recycle(mine, prefix + "f1") and _shm.claim(prefix + "f1", mine)
        _shm.write_segment(mine, [memoryview(b"b" * 1024)], reuse=True)
        with open(_shm.path(mine), "rb") as f:
            assert f.read(1028) == b"b" * 1024 + b"aaaa"  # the pages that existed, refilled
    finally:
        _shm.sweep(prefix)


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
def test_a_claimed_segment_is_young_for_the_orphan_sweep() -> None:
    # a pooled segment last written long ago, claimed by a writer that refills it through a
    # kept mapping (no write updates its time) and tells its unit later: the unit's sweep of
    # what dead writers left must not take it for one of theirs before ``older_than``
    prefix = f"afa-test-{os.getpid()}-{os.urandom(4).hex()}-"
    free, mine = prefix + "f0", prefix + "c0"
    _shm.write_segment(free, [memoryview(b"a" * 4096)])
    try:
        long_ago = os.stat(_shm.path(free)).st_mtime - 3600
        os.utime(_shm.path(free), (long_ago, long_ago))
        assert _shm.claim(free, mine)
        assert _shm.sweep(prefix, older_than=60.0) == 0
        assert os.path.exists(_shm.path(mine))
    finally:
        _shm.sweep(prefix)


@pytest.mark.skipif(not _shm.available(), reason="no writable /dev/shm here")
def test_a_writer_refills_a_claimed_segment_through_the_mapping_it_kept() -> None:
    prefix = f"afa-test-{os.getpid()}-{os.urandom(4).hex()}-"
    filler = Filler(budget=3 * 4096, max_kept=2)
    seq = iter(range(100))

    def cycle(name: str) -> str:
        """The unit frees ``name`` to its pool, a writer claims it: its new name."""
        free, mine = f"{prefix}f{next(seq)}", f"{prefix}c{next(seq)}"
        assert _shm.recycle(name, free) and _shm.claim(free, mine)
        return mine

    def content(name: str, n: int) -> bytes:
        with open(_shm.path(name), "rb") as f:
            return f.read(n)

    try:
        first = prefix + "c-first"
        _shm.create(first, 5008)
        assert filler.write(first, [memoryview(b"a" * 5000)], claimed=False) == [0]
        assert (filler.refills, filler.nbytes) == (0, 0)  # a new segment: written, not kept
        again = cycle(first)
        offsets = filler.write(again, [memoryview(b"b" * 10), [memoryview(b"c" * 7)]], claimed=True)
        assert offsets == [0, 16] and (filler.refills, filler.nbytes) == (0, 5008)  # kept now
        assert content(again, 24) == b"b" * 10 + b"a" * 6 + b"c" * 7 + b"a"
        mapping = _shm.map_for_reading(again)  # a reader maps it: no refill under its view
        assert not _shm.recycle(again, prefix + "f-no")
        del mapping
        gc.collect()
        third = cycle(again)
        filler.write(third, [memoryview(b"d" * 4)], claimed=True)
        assert filler.refills == 1 and content(third, 6) == b"dddd" + b"b" * 2  # same pages
        # the unit unlinks it: the writer's mapping would pin its pages, and goes
        _shm.unlink(third)
        other = prefix + "c-other"
        _shm.create(other, 8192)
        filler.write(other, [memoryview(b"e" * 8192)], claimed=False)
        assert filler.nbytes == 0
        # at most ``budget`` bytes in ``max_kept`` mappings, the least recently filled go first
        names = [prefix + f"c-many{k}" for k in range(3)]
        for name in names:
            _shm.write_segment(name, [memoryview(b"f" * 4096)])
            filler.write(cycle(name), [memoryview(b"g")], claimed=True)
        assert (len(filler._kept), filler.nbytes) == (2, 2 * 4096)
        filler.write(cycle(other), [memoryview(b"h")], claimed=True)  # 8 KiB more: over budget
        assert (len(filler._kept), filler.nbytes) == (2, 8192 + 4096)
        big = prefix + "c-big"
        _shm.write_segment(big, [memoryview(b"i" * 4 * 4096)])
        filler.write(cycle(big), [memoryview(b"j" * 4 * 4096)], claimed=True)  # over the budget
        assert (filler.refills, filler.nbytes) == (1, 8192 + 4096)  # written, not kept
    finally:
        _shm.sweep(prefix)
        filler.prune()
    assert filler.nbytes == 0


def test_a_large_fill_is_split_between_two_threads_and_copies_every_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_filler, "SPLIT_BYTES", 64)
    monkeypatch.setattr(_filler, "_CPUS", 2)
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (40, 0, 33, 7, 100, 1)]
    bodies: list[Any] = [
        [memoryview(pieces[0]), memoryview(pieces[1]), memoryview(pieces[2])],  # cut inside
        memoryview(pieces[3]),
        [memoryview(pieces[4])],
        memoryview(pieces[5]),
    ]
    offsets, total = _shm.layout([40 + 33, 7, 100, 1])
    mapping = mmap.mmap(-1, total)
    threads: list[str] = []
    copy = _filler._copy

    def spy(target: Any, jobs: Any) -> None:
        threads.append(threading.current_thread().name)
        copy(target, jobs)

    monkeypatch.setattr(_filler, "_copy", spy)
    _filler._fill(mapping, [b if isinstance(b, list) else [b] for b in bodies], offsets)
    assert sorted(threads) == ["MainThread", "afa-tq-fill"]
    got = bytes(mapping)
    expected = [pieces[0].tobytes() + pieces[2].tobytes(), pieces[3].tobytes()]
    expected += [pieces[4].tobytes(), pieces[5].tobytes()]
    for offset, body in zip(offsets, expected, strict=True):
        assert got[offset : offset + len(body)] == body
    mapping.close()  # no export of it left behind


def test_a_failed_half_of_a_split_fill_fails_the_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_filler, "SPLIT_BYTES", 64)
    monkeypatch.setattr(_filler, "_CPUS", 2)
    copy = _filler._copy

    def failing(target: Any, jobs: Any) -> None:
        if threading.current_thread().name == "afa-tq-fill":
            raise MemoryError("helper")
        copy(target, jobs)

    monkeypatch.setattr(_filler, "_copy", failing)
    mapping = mmap.mmap(-1, 256)
    with pytest.raises(MemoryError, match="helper"):
        _filler._fill(mapping, [[memoryview(b"x" * 200)]], [0])
    mapping.close()


def _bodies() -> list[torch.Tensor]:
    """Tensors of every kind a put may hold: each wire dtype family, numpy's and not (bfloat16,
    bool), empty, a scalar, a non-contiguous view."""
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(-(2**40), 2**40, (3, 5), generator=gen),
        torch.randn(4, 7, generator=gen),
        torch.randn(6, generator=gen).to(torch.bfloat16),
        torch.randn(2, 3, generator=gen).to(torch.float16),
        torch.tensor([True, False, True]),
        torch.randint(0, 255, (9,), generator=gen, dtype=torch.uint8),
        torch.zeros(0, 4),
        torch.tensor(2.5),
        torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        torch.randn(2, 2, generator=gen, dtype=torch.complex64),
    ]


def test_segment_bodies_are_the_exact_bytes_and_map_back_to_equal_tensors() -> None:
    bodies = _bodies()
    views = [_unit_io._bytes(t) for t in bodies]
    for t, view in zip(bodies, views, strict=True):
        expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (view.format, view.ndim, bytes(view)) == ("B", 1, expected), t
    offsets, total = _shm.layout([v.nbytes for v in views])
    mapping = mmap.mmap(-1, total)
    _filler._fill(mapping, [[v] for v in views], offsets)
    for t, offset in zip(bodies, offsets, strict=True):
        ref = S.ShmBody(offset, dtype_name(t), tuple(t.shape))
        back = _unit_io._tensor(mapping, ref)
        assert (back.dtype, back.shape) == (t.dtype, t.shape) and torch.equal(back, t), t
    del back
    gc.collect()
    mapping.close()  # no export of it left behind


@pytest.mark.parametrize("small_fill", [_filler.SMALL_FILL, 0], ids=["slices", "numpy"])
def test_both_fill_paths_copy_every_byte(monkeypatch: pytest.MonkeyPatch, small_fill: int) -> None:
    monkeypatch.setattr(_filler, "SMALL_FILL", small_fill)
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**31, 9, dtype=np.int64)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (40, 0, 33, 1)]
    bodies = [
        [memoryview(pieces[0]), memoryview(pieces[1]), memoryview(words)],  # formats B, q
        [memoryview(pieces[2])],
        [memoryview(pieces[3])],
    ]
    offsets, total = _shm.layout([40 + 72, 33, 1])
    mapping = mmap.mmap(-1, total)
    _filler._fill(mapping, bodies, offsets)
    got = bytes(mapping)
    expected = [pieces[0].tobytes() + words.tobytes(), pieces[2].tobytes(), pieces[3].tobytes()]
    for offset, body in zip(offsets, expected, strict=True):
        assert got[offset : offset + len(body)] == body
    mapping.close()

"""A unit's shelf under random stores, column rewrites and deletes: the bytes it counts live and
held are exactly what its rows hold, and every row reads back as it was last written (the fast
paths for samples that live whole in one block must agree with the cell-by-cell ones)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.actors.remote import RawTensor
from asyncflow_actors.transfer_queue._unit_messages import Delete, Fetch, MarkConsumed, Store
from asyncflow_actors.transfer_queue.storage._shelf import Shelf

WIDTHS = {"a": 3, "b": 512}  # batch columns: int64 rows of these widths (b: blocks that compact)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "rewrite", "delete"]),
        st.integers(1, 40),  # how many samples
        st.sampled_from([("a", "b"), ("a",), ("b",), ("a", "b", "text")]),
        st.integers(0, 10_000),  # a seed for the rows and the choice of samples
    ),
    max_size=25,
)


def batch(width: int, values: list[int]) -> RawTensor:
    rows = np.repeat(np.array(values, np.int64)[:, None], width, axis=1)
    return RawTensor("int64", rows.shape, memoryview(rows).cast("B"))


def message(indexes: list[int], columns: tuple[str, ...], seed: int, create: bool) -> Store:
    values = [seed * 1000 + i for i in indexes]
    data: dict[str, Any] = {c: batch(WIDTHS[c], values) for c in columns if c in WIDTHS}
    if "text" in columns:
        data["text"] = ["x" * (v % 7) for v in values]  # row values of different sizes
    n = len(indexes)
    meta = ([0] * n, indexes, [1] * n) if create else ([], [], [])
    return Store("t", "", indexes, *meta, data, create=create)


def expected_bytes(value: Any) -> int:
    return len(value) if isinstance(value, str) else 8 * len(value)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_live_and_held_bytes_are_exact_and_rows_read_back(ops: list[Any]) -> None:
    shelf = Shelf("u", None, lambda: 0.0)
    model: dict[int, dict[str, Any]] = {}  # index -> column -> the row last written
    next_index = 0
    for op, n, columns, seed in ops:
        rng = np.random.default_rng(seed)
        if op == "put":
            indexes = list(range(next_index, next_index + n))
            next_index += n
            create = True
        else:
            if not model:
                continue
            pick = rng.choice(sorted(model), size=min(n, len(model)), replace=False)
            indexes = [int(i) for i in pick]
            create = False
        if op == "delete":
            shelf.delete(Delete("t", indexes, []))
            for i in indexes:
                del model[i]
        else:
            shelf.store(message(indexes, columns, seed, create), create=create)
            for i in indexes:
                row = model.setdefault(i, {})
                for c in columns:
                    v = seed * 1000 + i
                    row[c] = "x" * (v % 7) if c == "text" else [v] * WIDTHS[c]
        live = sum(expected_bytes(v) for row in model.values() for v in row.values())
        assert shelf.live == live
        blocks = {
            id(b): b for s in shelf.samples.get("t", {}).values() for b, _ in s.cells.values()
        }
        assert shelf.held == sum(b.held for b in blocks.values())
        for sample in shelf.samples.get("t", {}).values():
            if sample.home is not None:
                block, _ = sample.home
                assert set(sample.cells) == set(block.columns)
                assert all(cell == sample.home for cell in sample.cells.values())
    for index, row in model.items():
        for column, want in row.items():
            got = shelf.fetch(Fetch("t", "", [index], [column], [], []))
            (part,) = got.columns[column]
            if column == "text":
                assert part == [want]
            else:  # a batch of one row, or the row itself (a compaction that kept some rows'
                # columns only stores that column's rows as row values)
                value = part[0] if isinstance(part, list) else part
                assert np.frombuffer(value.data, np.int64).tolist() == want
    assert set(shelf.samples.get("t", {})) == set(model)


def test_a_stored_row_is_one_object_for_the_garbage_collector() -> None:
    """A put's samples are the records a unit makes most of: one tracked object per row (no
    dict, tuple or set each), so that the collector's passes stay rare and short while puts
    wait for the unit's bookkeeping. Consumption marks and deletes make none either."""
    shelf = Shelf("u", None, lambda: 0.0)
    shelf.store(message(list(range(8)), ("a", "b"), 0, True))  # warm up caches
    gc.collect()
    before = len(gc.get_objects())
    indexes = list(range(8, 1032))
    shelf.store(message(indexes, ("a", "b"), 1, True))
    shelf.apply(MarkConsumed("t", "trainer", indexes))
    grown = len(gc.get_objects()) - before
    assert len(indexes) <= grown < len(indexes) + 32  # the records, and a few for the block
    shelf.delete(Delete("t", indexes, []))
    assert len(shelf.samples["t"]) == 8

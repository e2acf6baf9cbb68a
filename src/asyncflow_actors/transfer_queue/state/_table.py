"""A columnar table of rows keyed by increasing ids: the storage behind the control plane.

Samples (keyed by index) and groups (keyed by group id) live in :class:`Table`\\ s: one numpy
array per field, rows appended in id order and never reordered, so "oldest first" is "lowest
slot first" and a batch of new rows is one contiguous slice. Rows die in place; once dead rows
outnumber live ones the table compacts (memory follows the live rows, whatever the ids). Slots
change at compaction, ids never do: callers keep ids across calls and look slots up again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Index = slice | Ints  # rows of a table: a contiguous run (a view) or a gather

_MIN_CAPACITY = 256
_COMPACT_AT = 4096  # dead rows tolerated whatever the live count (compaction copies every field)
#: Index arrays up to this length are inspected as Python lists by the helpers below: for a
#: small batch that costs a fraction of the numpy calls' fixed cost. The controller state
#: machine runs with 0 (numpy only) and with the default (its small batches as lists), so both
#: branches are checked against one model.
SMALL = 32


class Table:
    """Rows keyed by strictly increasing int ids, one numpy array per field.

    ``ids[:n]`` is sorted; ``live[:n]`` says which rows are live. ``add(name, dtype, width)``
    declares a field (``width`` > 0: a 2-D field of that many columns); fields read as
    attributes, and a field array is replaced when the table grows or compacts, so never keep
    one across an :meth:`append` or :meth:`compact`.
    """

    def __init__(self) -> None:
        self.n = 0
        self.nlive = 0
        self.compactions = 0  # slots of ids are stable between compactions
        self._fields: dict[str, tuple[Any, int]] = {}
        self.ids: Ints = np.empty(_MIN_CAPACITY, np.int64)
        self.live: Bools = np.zeros(_MIN_CAPACITY, np.bool_)
        self.on_compact: list[Callable[[Bools], None]] = []  # keep-masks for dependents

    def add(self, name: str, dtype: Any, width: int = 0) -> None:
        """Declare a zero-filled field (also on existing rows)."""
        if name in vars(self) and name not in self._fields:
            raise ValueError(f"field name {name!r} is taken by the table itself")
        self._fields[name] = (dtype, width)
        shape = (len(self.ids), width) if width else (len(self.ids),)
        setattr(self, name, np.zeros(shape, dtype))

    def __getattr__(self, name: str) -> Any:  # declared fields, for the type checker
        raise AttributeError(name)

    def append(self, ids: Ints) -> slice:
        """Append live rows for ``ids`` (all greater than every id so far); zero-filled fields
        (rows past ``n`` are kept zero, so appending writes nothing else)."""
        k = len(ids)
        if self.n + k > len(self.ids):
            self._resize(max(2 * len(self.ids), self.n + k))
        rows = slice(self.n, self.n + k)
        self.ids[rows] = ids
        self.live[rows] = True
        self.n += k
        self.nlive += k
        return rows

    def _resize(self, capacity: int) -> None:
        def grow(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
            out = np.zeros((capacity, *a.shape[1:]), a.dtype)
            out[: self.n] = a[: self.n]
            return out

        self.ids = grow(self.ids)
        self.live = grow(self.live)
        for name in self._fields:
            setattr(self, name, grow(getattr(self, name)))

    def find(self, ids: Ints) -> tuple[Ints, Bools]:
        """Slots of ``ids`` and whether each is a live row (slots of absent ids are clipped)."""
        n = self.n
        if n == 0:
            return np.zeros(len(ids), np.int64), np.zeros(len(ids), np.bool_)
        slots = np.minimum(np.searchsorted(self.ids[:n], ids), n - 1)
        return slots, (self.ids[slots] == ids) & self.live[slots]

    def slot_of(self, id_: int) -> int:
        """The slot of a live row ``id_``, or -1."""
        n = self.n
        slot = int(np.searchsorted(self.ids[:n], id_))
        if slot < n and self.ids[slot] == id_ and self.live[slot]:
            return slot
        return -1

    def first_at_or_after(self, id_: int) -> int:
        """The first slot whose id is ``>= id_`` (``n`` if none)."""
        return int(np.searchsorted(self.ids[: self.n], id_))

    def kill(self, rows: Index, count: int) -> None:
        """Mark ``count`` live rows dead."""
        self.live[rows] = False
        self.nlive -= count

    def maybe_compact(self) -> None:
        """Drop dead rows once they outnumber the live ones (amortized O(1) per row)."""
        dead = self.n - self.nlive
        if dead < _COMPACT_AT or dead < self.nlive:
            return
        keep = self.live[: self.n].copy()
        k = self.nlive
        self.ids[:k] = self.ids[: self.n][keep]
        self.live[:k] = True
        self.live[k : self.n] = False
        for name in self._fields:
            a = getattr(self, name)
            a[:k] = a[: self.n][keep]
            a[k : self.n] = 0
        self.n = k
        self.compactions += 1
        for callback in self.on_compact:
            callback(keep)


def rows_of(slots: Ints, *, ascending: bool = False) -> Index:
    """``slots`` as a slice when they are one ascending contiguous run (cheaper to index);
    ``ascending``: the caller knows they are strictly increasing (skips that check)."""
    k = len(slots)
    if not k:
        return slots
    if k <= SMALL:
        v = slots.tolist()
        if v[-1] - v[0] == k - 1 and (ascending or v == list(range(v[0], v[0] + k))):
            return slice(v[0], v[0] + k)
        return slots
    if int(slots[-1]) - int(slots[0]) != k - 1:
        return slots
    if ascending or bool((slots[1:] > slots[:-1]).all()):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return slots


def ascending(a: Ints) -> bool:
    """Whether ``a`` is strictly increasing."""
    if len(a) < 2:
        return True
    if len(a) <= SMALL:
        return all(x < y for x, y in itertools.pairwise(a.tolist()))
    return bool((a[1:] > a[:-1]).all())


def distinct(a: Ints) -> Ints:
    """The distinct values of ``a``, ascending (skips the sort when ``a`` already is)."""
    return a if ascending(a) else np.unique(a)


ALL = slice(None)  # every row: the mask of the only key in :func:`groups_of`


def groups_of(keys: Ints) -> list[tuple[int, Bools | slice]]:
    """``(key, rows)`` for each distinct key of ``keys``: a mask, or :data:`ALL` when every
    key is equal (the common case, found in one pass)."""
    n = len(keys)
    if not n:
        return []
    if n <= SMALL:
        v = keys.tolist()
        if v.count(v[0]) == n:
            return [(v[0], ALL)]
    else:
        first = int(keys[0])
        if bool((keys == first).all()):
            return [(first, ALL)]
    return [(k, keys == k) for k in np.unique(keys).tolist()]


Runs = tuple["int | slice | Ints", int]  # an index array as one index, one run, or as is


def runs(idx: Ints) -> Runs:
    """``idx`` as the cheapest equivalent index, and its length: one index when every entry is
    the same (members of one group), a slice for one ascending run (groups of one), else the
    array (computed once, then used by several :func:`scatter_add`)."""
    n = len(idx)
    if not n:
        return idx, 0
    if n <= SMALL:
        v = idx.tolist()
        first = v[0]
        if v.count(first) == n:
            return first, n
        if v[-1] - first == n - 1 and v == list(range(first, first + n)):
            return slice(first, first + n), n
        return idx, n
    first, last = int(idx[0]), int(idx[-1])
    if first == last and bool((idx == first).all()):
        return first, n
    if last - first == n - 1 and bool((idx[1:] > idx[:-1]).all()):
        return slice(first, last + 1), n
    return idx, n


def scatter_add(a: npt.NDArray[Any], idx: Ints | Runs, value: Any) -> None:
    """``a[idx] += value``, repeated indexes adding up (like ``np.add.at``, but fast for the
    shapes :func:`runs` recognizes); ``value``: one for all, or one per index."""
    where, n = idx if isinstance(idx, tuple) else runs(idx)
    if not n:
        return
    if isinstance(where, int):
        a[where] += value.sum(axis=0) if getattr(value, "ndim", 0) else value * n
    elif isinstance(where, slice):
        a[where] += value
    else:
        np.add.at(a, where, value)


def popcount(a: Ints) -> Ints:
    """Number of set bits of each element (bit masks of at most 63 bits)."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2
        return np.bitwise_count(a).astype(np.int64)
    u = a.astype(np.uint64)
    out = np.zeros(u.shape, np.int64)
    while bool((nz := u != 0).any()):
        out += nz
        u = u & (u - np.uint64(1))
    return out

"""Where new groups go: the least-loaded storage units, filled evenly (internal)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ._table import Ints


def least_loaded(loads: list[int], down: Collection[int], n: int, min_block: int) -> Ints:
    """Units (as numbers) for ``n`` new groups: the least-loaded ``k`` units that are up, ``k``
    growing with ``n`` in steps of ``min_block`` samples, filled lowest load first (ties: lowest
    rank), each taking one contiguous run (a small batch goes to one unit whole; a large one
    splits into one slice per unit, never interleaved rows). If every unit is down, all count."""
    up = [r for r in range(len(loads)) if r not in down] or list(range(len(loads)))
    k = max(1, min(len(up), -(-n // min_block)))
    if k == 1:  # a small batch: whole on the least-loaded unit
        return np.full(n, min(up, key=lambda r: (loads[r], r)), np.int64)
    ranked = sorted(up, key=lambda r: (loads[r], r))[:k]
    # water-filling: the highest level every chosen unit below it can be raised to
    base = [loads[r] for r in ranked]
    level = min(base)
    remaining = n
    while remaining:
        below = [b for b in base if b <= level]
        nxt = min((b for b in base if b > level), default=None)
        step = remaining // len(below) if nxt is None else min(nxt - level, remaining // len(below))
        if step == 0:
            break
        level += step
        remaining -= step * len(below)
    counts = {r: max(0, level - b) for r, b in zip(ranked, base, strict=True)}
    for r in sorted(ranked):  # what is left: one each, lowest rank first, at the level
        if remaining and loads[r] <= level:
            counts[r] += 1
            remaining -= 1
    return np.repeat(np.array(sorted(counts), np.int64), [counts[r] for r in sorted(counts)])

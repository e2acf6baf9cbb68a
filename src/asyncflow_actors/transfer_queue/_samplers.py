"""Samplers: which ready samples a claim hands out, and how they split across DP ranks.

A sampler is a small frozen value passed to ``claim``; the selection itself is vectorized in the
lease table (``state._leases``), from each view's hint onwards, never a scan from the oldest sample.

- :class:`Fifo`: ready samples, oldest index first; group members may go to different claims.
- :class:`WholeGroups`: complete groups only (every remaining member ready, fresh and not held by
  this consumer), oldest group first, never split; first fit: groups are taken in order while their
  total stays ``<= count`` (a group that does not fit is skipped, at most a bounded number of them).
- :class:`Balanced`: ``count`` samples (or whole groups) for ``dp_size`` data-parallel ranks,
  partitioned by greedy LPT on the per-sample ``lengths`` given at allocation, so that the total
  length per rank is balanced; ungrouped partitions also get equal sample counts (within one).

Rank sharing (every rank of a DP group receiving the same samples) is orthogonal: ``claim``'s
``share_key``/``share_count`` works with any sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import attrs

from ._errors import InvalidArgument

#: Non-fitting groups a whole-group claim skips before it stops looking further.
MAX_SKIPPED_GROUPS = 64


@attrs.frozen
class Fifo:
    """Ready samples, oldest index first."""


@attrs.frozen
class WholeGroups:
    """Whole complete groups, oldest first, first fit up to ``count`` samples.

    ``wait_expiring``: never pass over a group that the next version would make stale (opened
    ``staleness`` or more versions ago and not complete yet): the claim takes only groups
    before it, and waits for it rather than take fewer than ``min_count``. Slow groups (the
    long tail of generation) are then trained instead of being overtaken and evicted. The
    wait lasts ``lease_ttl`` from the first claim held back at the latest version, no longer
    (a group whose writer died must not stall its consumers until ``write_ttl``).
    """

    wait_expiring: bool = False


@attrs.frozen
class Balanced:
    """Samples (or whole groups) split into ``dp_size`` length-balanced partitions."""

    dp_size: int = attrs.field()
    whole_groups: bool = False
    wait_expiring: bool = False  # with whole_groups: as ``WholeGroups.wait_expiring``

    @dp_size.validator
    def _check_dp(self, _attr: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgument(f"Balanced dp_size must be an int >= 1, got {value!r}")


Sampler = Union[Fifo, WholeGroups, Balanced]

FIFO = Fifo()
WHOLE_GROUPS = WholeGroups()


def uses_groups(sampler: Sampler) -> bool:
    """Whether ``sampler`` hands out whole groups."""
    return isinstance(sampler, WholeGroups) or (
        isinstance(sampler, Balanced) and sampler.whole_groups
    )


def waits_expiring(sampler: Sampler) -> bool:
    """Whether ``sampler`` waits for whole groups about to expire instead of passing them."""
    return uses_groups(sampler) and bool(getattr(sampler, "wait_expiring", False))


def partition_lpt(
    items: Sequence[tuple[int, Sequence[int]]],
    parts: int,
    *,
    equal_count: bool,
) -> list[list[int]]:
    """Split weighted items into ``parts`` bins with balanced total weight (greedy LPT).

    ``items`` are ``(weight, members)``; each item goes whole into one bin, heaviest first, to the
    lightest bin (ties: lowest rank). With ``equal_count`` the bins also get equal item counts
    (within one). Returns the members of each bin, in ascending order.
    """
    n = len(items)
    base, extra = divmod(n, parts)
    loads = [0] * parts
    counts = [0] * parts
    bins: list[list[int]] = [[] for _ in range(parts)]
    plus = 0
    order = sorted(range(n), key=lambda k: (-items[k][0], min(items[k][1], default=0)))
    for k in order:
        weight, members = items[k]
        best = -1
        for p in range(parts):
            if equal_count and not (counts[p] < base or (counts[p] == base and plus < extra)):
                continue
            if best < 0 or loads[p] < loads[best]:
                best = p
        if equal_count and counts[best] == base:
            plus += 1
        loads[best] += weight
        counts[best] += 1
        bins[best].extend(members)
    for b in bins:
        b.sort()
    return bins

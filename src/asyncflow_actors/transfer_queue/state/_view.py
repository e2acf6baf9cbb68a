"""A view of one topic: what one consumer may claim for one column set (internal).

A *view* (consumer c, columns C) answers "which samples may c claim for C": a sample is a
candidate iff its per-sample columns of C and its group's shared columns of C are present, c
has neither acked nor leased it, and its group is not pending eviction. A claim computes that
predicate over the rows in index order, from a per-view hint below which no candidate exists
(every change that may create one lowers the hint). For whole-group claims each view keeps,
per group, its number of candidates (a group field kept up to date by every change): a group
is eligible iff it is complete and that count equals its live members c has not acked.
Freshness needs no per-claim check: stale groups leave every view the moment the version moves
past them (see ``ControllerState.set_latest_version``).
"""

from __future__ import annotations


class View:
    """Consumer ``ci``'s view over ``columns``: its candidate count and its two hints (the
    lowest index a candidate may have, the lowest id an eligible group may have)."""

    __slots__ = ("bit", "ci", "columns", "field", "glo", "gmask", "lo", "nready", "smask")

    def __init__(self, ci: int, columns: frozenset[str], smask: int, gmask: int, field: str):
        self.ci = ci
        self.bit = 1 << ci
        self.columns = columns
        self.smask = smask
        self.gmask = gmask
        self.field = field  # the group-table field counting this view's candidates per group
        self.lo = 0  # no candidate has a lower index
        self.glo = 0  # no eligible group has a lower id
        self.nready = 0  # candidates

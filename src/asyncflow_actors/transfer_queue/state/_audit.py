"""The invariants of a topic's incremental bookkeeping, checked from scratch (internal).

Every mutation keeps each view's counts and hints up to date incrementally (see ``_topic``);
:func:`topic_problems` recomputes them from the tables and names every difference. It is a
check for tests (O(samples * views)), not something a running controller calls.
"""

from __future__ import annotations

import numpy as np

from ._topic import Topic


def topic_problems(t: Topic) -> list[str]:
    """What is inconsistent in ``t``'s views, in words (empty: nothing).

    Per view: its candidate count is the number of live samples that are candidates; its
    per-group counts are those candidates per live group; no candidate has an index below its
    hint ``lo``, and no eligible group an id below its hint ``glo``.
    """
    out: list[str] = []
    s, g = t.s, t.g
    live_groups = g.live[: g.n]
    for v in t.views.values():
        name = f"topic {t.name!r} view ({t.spec.consumers[v.ci]!r}, {sorted(v.columns)})"
        cand = t.cand(v, slice(0, s.n))
        if v.nready != int(cand.sum()):
            out.append(f"{name}: counts {v.nready} candidates, there are {int(cand.sum())}")
        per_group = np.bincount(s.gs[: s.n][cand], minlength=g.n)[: g.n]
        counted = getattr(g, v.field)[: g.n]
        wrong = np.flatnonzero(live_groups & (per_group != counted))
        if wrong.size:
            x = int(wrong[0])
            out.append(
                f"{name}: group {int(g.ids[x])} counts {int(counted[x])} candidates, "
                f"there are {int(per_group[x])}"
            )
        if cand.any() and int(s.ids[: s.n][cand].min()) < v.lo:
            out.append(f"{name}: a candidate lies below the hint lo={v.lo}")
        eligible = t.eligible(v, 0, g.n)
        if eligible.any() and int(g.ids[: g.n][eligible].min()) < v.glo:
            out.append(f"{name}: an eligible group lies below the hint glo={v.glo}")
    return out

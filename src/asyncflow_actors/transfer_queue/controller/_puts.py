"""Puts the controller holds until their topic has room, and the puts it granted (internal).

A put that needs more slots than its topic has free waits, FIFO per topic: later puts wait
behind the head, so a large put is never starved by small ones. A granted put (its allocation
or its opened groups) is remembered until its writer commits or cancels it, so that a writer
that gave up before it saw the grant gets its slots back, and a retried commit finds it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import attrs

from .. import _messages as M
from .._results import Allocation
from .._runtime import Reply
from ._shared import REMEMBERED


@attrs.frozen
class Allocated:
    """An allocation granted to a put (``group``: the open group it joined, if any)."""

    allocation: Allocation
    group: int | tuple[int, ...] | None


def slots_of(msg: M.Allocate | M.OpenGroups) -> int:
    """Capacity slots a put needs (0: members of open groups use their reserved slots)."""
    if isinstance(msg, M.OpenGroups):
        return sum(msg.sizes)
    return msg.n if msg.group is None else 0


@attrs.define(eq=False)
class WaitingPut:
    msg: M.Allocate | M.OpenGroups
    reply: Reply


class PutQueues:
    """Waiting puts per topic, and granted puts by id (see the module docstring)."""

    def __init__(self) -> None:
        self.waiting: dict[str, deque[WaitingPut]] = {}  # topic -> puts, oldest first
        self._granted: OrderedDict[int, Any] = OrderedDict()  # put id -> Allocated | slots

    def waiting_holders(self) -> list[tuple[str | None, str]]:
        """``(holder, topic)`` of every put waiting for capacity."""
        return [(w.msg.holder, topic) for topic, queue in self.waiting.items() for w in queue]

    def __len__(self) -> int:
        return sum(len(w) for w in self.waiting.values())

    def topics(self) -> list[str]:
        return list(self.waiting)

    def queue(self, topic: str) -> deque[WaitingPut]:
        """``topic``'s waiting puts (created empty)."""
        return self.waiting.setdefault(topic, deque())

    def waits(self, topic: str) -> bool:
        return bool(self.waiting.get(topic))

    def cancel(self, put_id: int) -> WaitingPut | None:
        """Withdraw the waiting put ``put_id`` (its writer gave up), if it waits."""
        for waiting in self.waiting.values():
            for item in waiting:
                if item.msg.put_id == put_id:
                    waiting.remove(item)
                    return item
        return None

    def withdraw(self, holder: str) -> list[WaitingPut]:
        """Withdraw every waiting put of ``holder`` (it went away)."""
        gone = []
        for queue in self.waiting.values():
            for item in [w for w in queue if w.msg.holder == holder]:
                queue.remove(item)
                gone.append(item)
        return gone

    def grant(self, put_id: int, result: Any) -> None:
        """Remember what put ``put_id`` was granted (the oldest grants are forgotten first)."""
        if put_id:
            self._granted[put_id] = result
            while len(self._granted) > REMEMBERED:
                self._granted.popitem(last=False)

    def pop_granted(self, put_id: int) -> Any:
        """What put ``put_id`` was granted, forgotten now (``None``: nothing remembered)."""
        return self._granted.pop(put_id, None)

    def problems(self) -> list[str]:
        """What is inconsistent, in words (empty: nothing): every waiting put is queued under
        its own topic, a put id is waiting or granted but not both, the grants are bounded."""
        out = []
        if any(w.msg.topic != topic for topic, queue in self.waiting.items() for w in queue):
            out.append("a put waits under another topic than its own")
        ids = {w.msg.put_id for queue in self.waiting.values() for w in queue if w.msg.put_id}
        if ids & set(self._granted):
            out.append(f"puts both waiting and granted: {sorted(ids & set(self._granted))}")
        if len(self._granted) > REMEMBERED:
            out.append("the granted puts outgrew their bound")
        return out

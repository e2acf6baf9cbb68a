"""Claims the controller holds until enough samples qualify.

Waiting claims are queued FIFO per *kind* (topic, consumer, columns, sampler, counts, share
key): when a topic changes, only the head of each of its queues is retried, and the next one
only if the head was served. So the cost of a change does not grow with the number of waiting
clients, and a consumer is served in arrival order (no waiter starves while later ones with the
same request are served).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

import attrs

from .. import _messages as M
from .._runtime import Reply


@attrs.define(eq=False)
class WaitingClaim:
    msg: M.Claim
    reply: Reply


def _kind(msg: M.Claim) -> Hashable:
    return (
        msg.consumer,
        frozenset(msg.columns),
        msg.sampler,
        msg.count,
        msg.min_count,
        msg.share_key,
        msg.share_count,
    )


class ClaimQueues:
    """Waiting claims, FIFO per kind (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[str, dict[Hashable, deque[WaitingClaim]]] = {}
        self._seen: dict[tuple[str, Hashable], int] = {}  # changes counter at the last try
        self._by_id: dict[int, WaitingClaim] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def waiting(self) -> list[tuple[str, str, str, int]]:
        """``(holder, topic, consumer, count)`` of every claim waiting."""
        return [
            (w.msg.holder, w.msg.topic, w.msg.consumer, w.msg.count) for w in self._by_id.values()
        ]

    def add(self, waiting: WaitingClaim, changes: int) -> None:
        msg = waiting.msg
        kind = _kind(msg)
        self._queues.setdefault(msg.topic, {}).setdefault(kind, deque()).append(waiting)
        self._by_id[msg.claim_id] = waiting
        self._seen.setdefault((msg.topic, kind), changes)

    def pop(self, claim_id: int) -> WaitingClaim | None:
        """Withdraw a waiting claim (its claimant gave up)."""
        waiting = self._by_id.pop(claim_id, None)
        if waiting is not None:
            kind = _kind(waiting.msg)
            queue = self._queues[waiting.msg.topic][kind]
            queue.remove(waiting)
            if not queue:
                self._forget(waiting.msg.topic, kind)
        return waiting

    def withdraw(self, holder: str) -> list[WaitingClaim]:
        """Withdraw every waiting claim of ``holder`` (it went away), oldest first."""
        gone = [w for w in self._by_id.values() if w.msg.holder == holder]
        for waiting in gone:
            self.pop(waiting.msg.claim_id)
        return gone

    def _forget(self, topic: str, kind: Hashable) -> None:
        del self._queues[topic][kind]
        self._seen.pop((topic, kind), None)
        if not self._queues[topic]:
            del self._queues[topic]

    def topics(self) -> list[str]:
        return list(self._queues)

    def serve(self, topic: str, changes: int, attempt: Callable[[WaitingClaim], bool]) -> None:
        """Retry the head of each queue of ``topic`` whose topic changed since its last try;
        ``attempt`` answers the claim (and returns ``True``) or leaves it waiting."""
        for kind, queue in list(self._queues.get(topic, {}).items()):
            if self._seen.get((topic, kind)) == changes:
                continue
            self._seen[(topic, kind)] = changes
            while queue and attempt(queue[0]):
                done = queue.popleft()
                self._by_id.pop(done.msg.claim_id, None)
            if not queue:
                self._forget(topic, kind)

    def ids(self) -> set[int]:
        """The ids of the waiting claims."""
        return set(self._by_id)

    def problems(self) -> list[str]:
        """What is inconsistent, in words (empty: nothing): the index by id holds exactly the
        queued claims, each queued once under its own topic and kind, and no queue is empty."""
        out = []
        queued = [w for kinds in self._queues.values() for q in kinds.values() for w in q]
        if sorted(w.msg.claim_id for w in queued) != sorted(self._by_id):
            out.append("waiting claims: the index by id and the queues disagree")
        for topic, kinds in self._queues.items():
            for kind, queue in kinds.items():
                if not queue:
                    out.append(f"waiting claims: an empty queue is kept for topic {topic!r}")
                if any(w.msg.topic != topic or _kind(w.msg) != kind for w in queue):
                    out.append("waiting claims: a claim is queued under the wrong topic or kind")
        return out

    def drain(self) -> list[WaitingClaim]:
        """Every waiting claim, removed (the controller is stopping)."""
        out = list(self._by_id.values())
        self._queues.clear()
        self._seen.clear()
        self._by_id.clear()
        return out

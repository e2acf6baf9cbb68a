"""Requests the controller holds until they can be answered: claims and event watches.

Waiting claims are queued FIFO per *kind* (topic, consumer, columns, sampler, counts, share
key): when a topic changes, only the head of each of its queues is retried, and the next one
only if the head was served. So the cost of a change does not grow with the number of waiting
clients, and a consumer is served in arrival order (no waiter starves while later ones with the
same request are served). Event watchers wait for the log to move past their cursor; the log is
read once per new event batch, not once per watcher per message.
"""

from __future__ import annotations

import itertools
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

    def drain(self) -> list[WaitingClaim]:
        """Every waiting claim, removed (the controller is stopping)."""
        out = list(self._by_id.values())
        self._queues.clear()
        self._seen.clear()
        self._by_id.clear()
        return out


class EventLog:
    """Numbered events (kept across controller restarts, bounded) and the watchers waiting."""

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.events: deque[M.TQEvent] = deque()
        self.seq = 0

    def add(
        self, kind: str, topic: str, groups: tuple[int, ...], indexes: tuple[int, ...], detail: str
    ) -> None:
        self.seq += 1
        self.events.append(M.TQEvent(self.seq, kind, topic, tuple(groups), tuple(indexes), detail))
        while len(self.events) > self.max_events:
            self.events.popleft()

    def after(self, since: int) -> tuple[M.TQEvent, ...]:
        """Events with ``seq > since`` still in the log."""
        if not self.events or since >= self.seq:
            return ()
        first = self.events[0].seq
        return tuple(itertools.islice(self.events, max(0, since + 1 - first), None))


class EventWaiters:
    """Watchers of one controller incarnation, answered when the log passes their cursor."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._waiting: dict[int, tuple[int, Reply]] = {}  # wait id -> (since, reply)
        self._served = log.seq

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, wait_id: int, since: int, reply: Reply) -> None:
        fresh = self.log.after(since)
        if fresh:
            reply.send(M.EventBatch(self.log.seq, fresh))
        else:
            self._waiting[wait_id or id(reply)] = (since, reply)

    def cancel(self, wait_id: int) -> None:
        entry = self._waiting.pop(wait_id, None)
        if entry is not None:
            entry[1].fail(_Withdrawn(f"event wait {wait_id} withdrawn by its watcher"))

    def serve(self) -> None:
        """Answer the watchers the log moved past (only when it moved)."""
        if self.log.seq == self._served:
            return
        self._served = self.log.seq
        batches: dict[int, M.EventBatch] = {}  # watchers mostly share a cursor
        for wait_id, (since, reply) in list(self._waiting.items()):
            batch = batches.get(since)
            if batch is None:
                batch = batches[since] = M.EventBatch(self.log.seq, self.log.after(since))
            if batch.events or reply.done:
                del self._waiting[wait_id]
                reply.send(batch)


class _Withdrawn(Exception):
    """Answer to a wait whose asker is gone (nobody reads it)."""

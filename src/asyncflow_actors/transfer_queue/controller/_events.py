"""The controller's numbered event log, and the watchers waiting for it to move (internal).

Event watchers wait for the log to move past their cursor; the log is read once per new event
batch, not once per watcher per message. The log outlives a controller incarnation (it lives in
``ControllerShared``); the watchers belong to one.
"""

from __future__ import annotations

import itertools
from collections import deque

from .. import _messages as M
from .._runtime import Reply


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

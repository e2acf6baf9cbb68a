"""What outlives a controller incarnation (internal).

The controller always knows which incarnation of each unit holds what: data messages name the
incarnation, and that knowledge (with the last state, the event log, the undelivered
bookkeeping and the replies of non-idempotent requests) lives in :class:`ControllerShared`,
which the queue creates once and every controller incarnation receives. So a unit that
restarted while the controller was down is found at the rebuild and its samples are reported
lost, never silently dropped; and a client retrying a request across a controller restart gets
the answer the first try got.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from .. import _unit_messages as U
from .._runtime import ActorRef
from .._spec import TopicSpec
from ..state._state import ControllerState
from ._events import EventLog
from ._outbox import Outbox

REMEMBERED = 65536  # replies of non-idempotent requests kept for retries


@attrs.define(eq=False)
class ControllerShared:
    """What outlives a controller incarnation: topics, units, options, and the knowledge a
    restarted controller needs to stay exact (see the module docstring)."""

    specs: dict[str, TopicSpec]
    units: dict[str, ActorRef[Any]]
    unit_check_interval: float = 0.5
    flush_linger: float = 0.05  # bookkeeping nobody waits for waits this long to travel with more
    unit_timeout: float = 5.0  # the controller's own requests to units
    io_timeout: float = 60.0  # clients' data requests to units
    shm_min_bytes: int | None = 64 << 10
    max_events: int = 10_000
    incarnations: int = 0
    log: EventLog = attrs.Factory(lambda self: EventLog(self.max_events), takes_self=True)
    outbox: Outbox = attrs.Factory(Outbox)
    watermarks: dict[str, U.TopicInfo] = attrs.Factory(dict)
    known: dict[str, str | None] = attrs.Factory(dict)  # unit -> incarnation holding its data
    state: ControllerState | None = None  # the last incarnation's (its losses at a rebuild)
    done: OrderedDict[int, Any] = attrs.Factory(OrderedDict)  # request id -> reply

    def remember(self, request_id: int, reply: Any) -> None:
        if request_id:
            self.done[request_id] = reply
            while len(self.done) > REMEMBERED:
                self.done.popitem(last=False)

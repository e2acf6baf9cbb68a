"""The controller's puts (internal): allocating slots or opening groups for a writer, parking
what does not fit yet (FIFO per topic), committing writes, and undoing what a writer gave up.
"""

from __future__ import annotations

from typing import Any

import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError, UnknownSample
from .._results import GroupSlot
from ..state._state import ControllerState
from ._base import ControllerBase, Ctx
from ._puts import Allocated, slots_of


class Putting(ControllerBase):
    """The put side of the controller (see the module docstring)."""

    def _put(self, state: ControllerState, msg: M.Allocate | M.OpenGroups) -> Any:
        now = trio.current_time()
        if isinstance(msg, M.OpenGroups):
            slots = state.open_groups(msg.topic, msg.sizes, holder=msg.holder, now=now)
            self._group_infos(msg.topic, tuple(s.group_id for s in slots))
            self._records(msg.topic)
            self.puts.grant(msg.put_id, slots)
            self._write_deadline(msg.topic, now)
            return M.OpenedGroups(slots, self._incarnations({s.unit for s in slots}))
        allocation = state.allocate(
            msg.topic,
            msg.n,
            msg.version,
            group=msg.group,
            lengths=msg.lengths,
            holder=msg.holder,
            now=now,
        )
        # every unit keeps the watermarks: a rebuild must never reuse an index, even if the
        # unit that held the newest samples is gone
        self._records(msg.topic)
        self.puts.grant(msg.put_id, Allocated(allocation, msg.group))
        self._write_deadline(msg.topic, now)
        self._kick(msg.topic, puts=False)
        units = set(allocation.units)
        free = self.shared.outbox.free
        hints = {u: free[u] for u in units if free.get(u)}
        return M.Placed(allocation, self._incarnations(units), hints)

    def _fits(self, state: ControllerState, topic: str, size: int) -> bool:
        """Whether ``size`` slots fit now: the capacity counts live samples, reserved group
        slots, and freed samples whose deletion their unit has not taken yet (so it bounds
        what the units hold). Raises ``CapacityError`` if ``size`` can never fit."""
        if not state.can_allocate(topic, size):
            return False
        free = state.free_slots(topic)
        return free is None or free - self.shared.outbox.deleting.get(topic, 0) >= size

    def _commit(self, msg: M.Commit, ctx: Ctx, state: ControllerState) -> None:
        if msg.put_id and msg.put_id in self.shared.done:
            return  # a retry: the first commit went through
        known = self.shared.known
        for unit, store in msg.stores.items():
            if unit not in self.shared.units or known.get(unit) != store.incarnation:
                raise UnknownSample(msg.topic, store.indexes)  # that incarnation is gone
        state.commit_write(msg.topic, msg.indexes, msg.columns)
        for unit, store in msg.stores.items():  # before its Committed and any Delete
            self._to_unit(unit, store)
        if not msg.new:
            self.locations.drop(msg.topic, msg.indexes)  # rewritten cells lie elsewhere now
        for unit, located in msg.located.items():
            self.locations.add(msg.topic, unit, located)
        if msg.new:
            granted = self.puts.pop_granted(msg.put_id)
            if isinstance(granted, Allocated) and granted.allocation.indexes == msg.indexes:
                # placed as allocated (no lookup); only an explicit group has a record to send
                pairs: Any = zip(msg.indexes, granted.allocation.units, strict=True)
                group = granted.group
                gids: Any = () if group is None else dict.fromkeys(_as_tuple(group))
            else:  # allocated by an earlier incarnation
                where = state.locate(msg.topic, msg.indexes)
                pairs = ((index, unit) for index, (_, unit) in where.items())
                gids = {gid for gid, _ in where.values()}
            placed: dict[str, list[int]] = {}
            for index, unit in pairs:
                placed.setdefault(unit, []).append(index)
            for unit, indexes in placed.items():
                self._to_unit(unit, U.Committed(msg.topic, indexes))
            self._group_infos(msg.topic, gids)
            self.shared.remember(msg.put_id, None)
        self._kick(msg.topic)

    def _cancel_put(self, state: ControllerState, put_id: int) -> None:
        item = self.puts.cancel(put_id)
        if item is not None:
            item.reply.fail(TransferQueueError(f"put {put_id} cancelled by its writer"))
            return
        granted = self.puts.pop_granted(put_id)
        if granted is None:
            return
        if isinstance(granted, tuple):  # groups opened, but the writer never saw them
            slots: tuple[GroupSlot, ...] = granted
            for slot in slots:
                topic, gid = slot.topic, slot.group_id
                try:
                    self._apply(state.shrink_group(topic, gid, slot.size))
                    self._group_infos(topic, (gid,))
                except TransferQueueError:
                    pass  # already used or gone
            self._kick(slots[0].topic)
        else:  # allocated, but the writer never saw the indexes
            allocation = granted.allocation
            self._discard(
                state, M.Discard(allocation.topic, allocation.indexes, missing_ok=True, undo=True)
            )

    def _retry_puts(self, topic: str) -> None:
        state = self.state
        waiting = self.puts.waiting.get(topic)
        assert state is not None
        while waiting:
            head = waiting[0]
            if not self._fits(state, topic, slots_of(head.msg)):
                return  # FIFO: later puts wait behind the head
            waiting.popleft()
            try:
                head.reply.send(self._put(state, head.msg))
            except TransferQueueError as exc:
                head.reply.fail(exc)

    def _discard(self, state: ControllerState, msg: M.Discard) -> tuple[int, ...]:
        indexes, missing = list(msg.indexes), tuple[int, ...]()
        if msg.missing_ok:
            try:
                state.locate(msg.topic, indexes)
            except UnknownSample as exc:
                missing = exc.indexes
                indexes = [i for i in indexes if i not in set(missing)]
            if not indexes:
                return missing
        located = state.locate(msg.topic, indexes)
        drop = state.unallocate if msg.undo else state.discard
        self._apply(drop(msg.topic, indexes))
        self._group_infos(msg.topic, {gid for gid, _ in located.values()})
        self._kick(msg.topic)
        return missing


def _as_tuple(group: int | tuple[int, ...]) -> tuple[int, ...]:
    return group if isinstance(group, tuple) else (group,)

"""FlowControl: admission control bounding how far rollout may run ahead of training.

Capacity is ``(staleness + 1) * batch_size`` slots. The driver acquires a slot per prompt before it
injects it; the trainer releases ``batch_size`` slots after each batch. Modelled on trio's
``CapacityLimiter``/``Semaphore``, with counted requests and strict FIFO grants.
"""

from __future__ import annotations

from typing import final

import attrs
import trio

from ._errors import CapacityError, FlowControlError, InvalidArgument


@attrs.frozen
class FlowControlStatistics:
    """Snapshot of a :class:`FlowControl`: slots in flight, waiters, totals since creation."""

    capacity: int
    in_flight: int
    available: int
    waiters: int
    waiting_slots: int
    total_acquired: int
    total_released: int


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
    return value


@final
class FlowControl:
    """A counted, FIFO-fair capacity limiter of ``(staleness + 1) * batch_size`` slots.

    Requests are granted strictly in arrival order: a waiting request for many slots is never
    overtaken by later, smaller ones (no starvation), and :meth:`acquire_nowait` does not barge
    past waiters. :meth:`acquire` is a checkpoint even when it does not wait, and is
    cancellation-atomic: it either returns holding ``n`` slots or raises ``Cancelled`` holding
    nothing.
    """

    def __init__(self, staleness: int, batch_size: int) -> None:
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise InvalidArgument(f"staleness must be an int >= 0, got {staleness!r}")
        _positive("batch_size", batch_size)
        self._staleness = staleness
        self._batch_size = batch_size
        self._capacity = (staleness + 1) * batch_size
        self._in_flight = 0
        self._waiters: dict[trio.lowlevel.Task, int] = {}  # insertion order = arrival order
        self._acquired = 0
        self._released = 0

    def __repr__(self) -> str:
        return (
            f"<FlowControl {self._in_flight}/{self._capacity} in flight, "
            f"{len(self._waiters)} waiting>"
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def staleness(self) -> int:
        return self._staleness

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def available(self) -> int:
        return self._capacity - self._in_flight

    def _check_request(self, n: int) -> None:
        _positive("n", n)
        if n > self._capacity:
            raise CapacityError(
                f"cannot acquire {n} slots: more than the capacity {self._capacity} "
                f"((staleness {self._staleness} + 1) * batch_size {self._batch_size})"
            )

    @trio.lowlevel.enable_ki_protection
    def acquire_nowait(self, n: int = 1) -> None:
        """Take ``n`` slots now. Raises ``trio.WouldBlock`` if they are not free or if earlier
        requests are waiting; :class:`CapacityError` if ``n`` exceeds the capacity."""
        self._check_request(n)
        if self._waiters or n > self._capacity - self._in_flight:
            raise trio.WouldBlock
        self._grant(n)

    @trio.lowlevel.enable_ki_protection
    async def acquire(self, n: int = 1) -> None:
        """Wait until ``n`` slots are free and every earlier request was served, then take them.

        Raises :class:`CapacityError` at once if ``n`` exceeds the capacity (it could never be
        served). Bound the wait with ``trio.fail_after`` / ``move_on_after``.
        """
        self._check_request(n)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.acquire_nowait(n)
        except trio.WouldBlock:
            task = trio.lowlevel.current_task()
            self._waiters[task] = n

            def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
                del self._waiters[task]
                # It may have been the head that kept smaller requests behind it.
                self._wake()
                return trio.lowlevel.Abort.SUCCEEDED

            # _wake() grants the slots before it reschedules us, so returning means holding them.
            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    @trio.lowlevel.enable_ki_protection
    def release(self, n: int = 1) -> None:
        """Return ``n`` slots and wake the waiters they let through, in order. Raises
        :class:`FlowControlError` (state unchanged) if fewer than ``n`` are in flight."""
        _positive("n", n)
        if n > self._in_flight:
            raise FlowControlError(
                f"cannot release {n} slots: only {self._in_flight} are in flight"
            )
        self._in_flight -= n
        self._released += n
        self._wake()

    def _grant(self, n: int) -> None:
        self._in_flight += n
        self._acquired += n

    def _wake(self) -> None:
        while self._waiters:
            task, n = next(iter(self._waiters.items()))
            if n > self._capacity - self._in_flight:
                return
            del self._waiters[task]
            self._grant(n)
            trio.lowlevel.reschedule(task)

    def statistics(self) -> FlowControlStatistics:
        """A frozen snapshot: capacity, in flight, available, waiters, totals."""
        return FlowControlStatistics(
            capacity=self._capacity,
            in_flight=self._in_flight,
            available=self._capacity - self._in_flight,
            waiters=len(self._waiters),
            waiting_slots=sum(self._waiters.values()),
            total_acquired=self._acquired,
            total_released=self._released,
        )

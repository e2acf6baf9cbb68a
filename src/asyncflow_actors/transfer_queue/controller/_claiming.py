"""The controller's claims (internal): leasing what qualifies to a consumer, parking a claim
until enough samples do, holding a grant until its units took their stores, and ending leases
(ack, nack, a claim cancelled after its grant).
"""

from __future__ import annotations

from typing import Any

import trio

from .. import _messages as M
from .. import _unit_messages as U
from .._errors import TransferQueueError
from ..state._state import ControllerState
from ._base import ControllerBase, Ctx
from ._claims import WaitingClaim


class Claiming(ControllerBase):
    """The claim side of the controller (see the module docstring)."""

    def _claim(self, msg: M.Claim, ctx: Ctx, state: ControllerState) -> Any:
        leased = self._try_claim(state, msg)
        if leased is not None:
            marks = self._store_marks(msg, leased)
            if not marks:
                return leased
            self.delivery.hold(marks, ctx.defer_reply(), leased)
            return None
        if not msg.wait:
            return None
        self.claims.add(WaitingClaim(msg, ctx.defer_reply()), state.changes(msg.topic))
        self._wake_timer(state)  # a claim held back for groups about to go stale: till when
        return None

    def _store_marks(self, msg: M.Claim, leased: M.Leased) -> dict[str, int]:
        """The told stores to wait for before the claimant may ask the units of its lease:
        none for units whose rows it maps from shared memory without asking."""
        units = [u for u in leased.lease.placement if u not in leased.located or u not in msg.maps]
        return self.delivery.marks(units)

    def _try_claim(self, state: ControllerState, msg: M.Claim) -> M.Leased | None:
        lease = state.claim(
            msg.topic,
            msg.consumer,
            msg.columns,
            msg.count,
            holder=msg.holder,
            now=trio.current_time(),
            sampler=msg.sampler,
            min_count=msg.min_count,
            share_key=msg.share_key,
            share_count=msg.share_count,
        )
        if lease is None:
            return None
        self.grants.add(msg.claim_id, lease.id)
        self.timer.deadline(lease.deadline)
        located = self.locations.of_lease(lease, self.shared.specs[lease.topic])
        return M.Leased(lease, self._incarnations(lease.placement), located)

    def _retry_claims(self, topic: str) -> None:
        state = self.state
        assert state is not None

        def attempt(waiting: WaitingClaim) -> bool:
            try:
                leased = self._try_claim(state, waiting.msg)
            except TransferQueueError as exc:
                waiting.reply.fail(exc)
                return True
            if leased is None:
                return False
            marks = self._store_marks(waiting.msg, leased)
            if marks:
                self.delivery.hold(marks, waiting.reply, leased)
            elif not waiting.reply.send(leased):  # the claimant is gone: give the samples back
                self._apply(state.nack(leased.lease.id))
            return True

        self.claims.serve(topic, state.changes(topic), attempt)
        if len(self.claims):
            self._wake_timer(state)

    def _stores_taken(self, state: ControllerState) -> None:
        """Send the held replies whose units took their stores (or were declared lost)."""
        for reply, value in self.delivery.taken():
            if not reply.send(value) and isinstance(value, M.Leased):
                try:  # the claimant is gone: give the samples back
                    self._apply(state.nack(value.lease.id))
                except TransferQueueError:
                    pass  # it ended already (its claim was cancelled)
                self._kick(value.lease.topic)

    def _cancel_claim(self, state: ControllerState, claim_id: int) -> None:
        waiting = self.claims.pop(claim_id)
        if waiting is not None:
            waiting.reply.fail(TransferQueueError(f"claim {claim_id} cancelled by its claimant"))
            return
        lease_id = self.grants.cancel(claim_id)
        if lease_id is not None:  # granted, but the claimant never saw it
            try:
                self._apply(state.nack(lease_id))
            except TransferQueueError:
                pass  # it ended already
            self._kick_all()

    def _end_lease(
        self, state: ControllerState, lease_id: int, holder: str | None, *, ack: bool
    ) -> tuple[int, ...]:
        lease = state.lease(lease_id)
        update = state.ack(lease_id, holder=holder) if ack else state.nack(lease_id)
        self._apply(update)
        if ack and lease_id in update.ended:
            for unit, indexes in lease.placement.items():
                self._to_unit(unit, U.MarkConsumed(lease.topic, lease.consumer, list(indexes)))
        if update.missing:
            self._event("missing", lease.topic, (), update.missing, f"lease {lease_id}")
        self._kick(lease.topic)
        return update.missing

"""The claims the controller granted, and their leases (internal)."""

from __future__ import annotations

from collections.abc import Iterable


class Grants:
    """Granted claims and their leases, one map read both ways, until each lease ends (a
    claimant that gave up on a granted claim has its lease returned: ``cancel``)."""

    def __init__(self) -> None:
        self._lease_of: dict[int, int] = {}  # claim id -> lease id
        self._claim_of: dict[int, int] = {}  # lease id -> claim id

    def add(self, claim_id: int, lease_id: int) -> None:
        self._lease_of[claim_id] = lease_id
        self._claim_of[lease_id] = claim_id

    def claims(self) -> set[int]:
        return set(self._lease_of)

    def cancel(self, claim_id: int) -> int | None:
        """Forget the grant of ``claim_id``; its lease id (``None``: none granted)."""
        lease_id = self._lease_of.pop(claim_id, None)
        if lease_id is not None:
            self._claim_of.pop(lease_id, None)
        return lease_id

    def ended(self, lease_ids: Iterable[int]) -> None:
        """Forget the grants of leases that ended."""
        for lease_id in lease_ids:
            claim_id = self._claim_of.pop(lease_id, None)
            if claim_id is not None:
                self._lease_of.pop(claim_id, None)

    def problems(self, outstanding: set[int]) -> list[str]:
        """What is inconsistent, in words (empty: nothing): the two directions agree, and
        every granted lease is among the ``outstanding`` ones."""
        out = []
        if self._claim_of != {lease: claim for claim, lease in self._lease_of.items()}:
            out.append("1: the grants by claim and by lease disagree")
        ended = set(self._claim_of) - outstanding
        if ended:
            out.append(f"2: grants name leases that ended: {sorted(ended)}")
        return out

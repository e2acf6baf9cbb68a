"""The controller's outbox to its units: what one delivery carries."""

from __future__ import annotations

from asyncflow_actors.transfer_queue._unit_messages import Committed, Delete, MarkConsumed
from asyncflow_actors.transfer_queue.controller._outbox import Outbox, _coalesce


def test_a_delivery_drops_the_marks_of_samples_it_deletes_and_nothing_else() -> None:
    items = [
        Committed("t", [1, 2, 3]),
        MarkConsumed("t", "trainer", [1, 2]),  # both deleted below: dropped
        MarkConsumed("t", "critic", [2, 3]),  # 3 stays
        MarkConsumed("u", "trainer", [1]),  # another topic: kept whole
        Delete("t", [1, 2], [1, 2]),
    ]
    assert _coalesce(items) == [
        Committed("t", [1, 2, 3]),
        MarkConsumed("t", "critic", [3]),
        MarkConsumed("u", "trainer", [1]),
        Delete("t", [1, 2], [1, 2]),
    ]
    no_marks = [Committed("t", [1]), Delete("t", [1], [1])]
    assert _coalesce(no_marks) is no_marks


def test_the_outbox_counts_the_samples_whose_delete_is_not_taken_yet() -> None:
    outbox = Outbox()
    outbox.put("a", Delete("t", [1, 2], []))
    outbox.put("b", Delete("t", [3], []))
    outbox.put("b", MarkConsumed("t", "trainer", [4]))
    assert outbox.deleting == {"t": 3}
    outbox.drop("a")  # its incarnation is gone: so are the samples
    assert outbox.deleting == {"t": 1} and len(outbox) == 2

"""Where rows put through shared memory lie (the controller's ``Locations``)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncflow_actors.transfer_queue import StorageUnavailable
from asyncflow_actors.transfer_queue._located import Located, locate
from asyncflow_actors.transfer_queue._unit_messages import ShmBody
from asyncflow_actors.transfer_queue.controller._locations import Locations


def test_parts_read_like_a_fetch_and_go_with_releases_rewrites_and_losses() -> None:
    locations = Locations()
    batch = ShmBody(64, "int64", (4, 2))  # 4 rows of 16 bytes from offset 64
    rows = [ShmBody(256 + 32 * r, "float32", (r + 1,)) for r in range(4)]
    put = locate([10, 11, 12, 13], "seg-a", {"x": batch, "y": rows})
    assert put is not None
    locations.add("t", "unit-0", put)
    other = Located("seg-b", (20,), {"x": ShmBody(0, "int64", (1, 2))})
    locations.add("t", "unit-1", other)

    parts = locations.parts("t", [11, 12, 10], ["x", "y"])
    assert parts == {
        "x": [ShmBody(64 + 16, "int64", (2, 2), "seg-a"), ShmBody(64, "int64", (1, 2), "seg-a")],
        "y": [[ShmBody(256 + 32 * r, "float32", (r + 1,), "seg-a") for r in (1, 2, 0)]],
    }
    assert locations.parts("t", [10], ["x", "z"]) is None  # a column the put did not carry
    assert locations.parts("t", [10, 99], ["x"]) is None  # a row not located
    assert locations.parts("u", [10], ["x"]) is None

    locations.drop("t", [11])  # freed, or rewritten elsewhere
    assert locations.parts("t", [11], ["x"]) is None
    assert locations.parts("t", [12], ["x"]) is not None
    locations.drop_unit("unit-0")  # lost: nothing of it is located any more
    assert locations.parts("t", [10], ["x"]) is None and locations.parts("t", [12], ["x"]) is None
    assert locations.parts("t", [20], ["x"]) == {"x": [ShmBody(0, "int64", (1, 2), "seg-b")]}


def test_a_store_with_values_held_by_the_unit_is_not_located() -> None:
    body = ShmBody(0, "int64", (2, 3))
    assert locate([1, 2], "seg", {"x": body, "text": ["a", "b"]}) is None
    assert locate([1, 2], "seg", {"x": body, "r": [ShmBody(48, "int64", (1,)), "b"]}) is None
    assert locate([1, 2], "seg", {"x": body}) == Located("seg", (1, 2), {"x": body})


@pytest.mark.parametrize("inline", [False, True], ids=["tasks", "inline"])
async def test_unit_work_inline_or_in_tasks_has_the_same_results_and_errors(inline: bool) -> None:
    # ``inline`` runs the units' work one after the other (it waits for nothing): every unit's
    # work still runs, and the error raised is the same (a StorageUnavailable first)
    from asyncflow_actors.transfer_queue.client._unit_io import UnitIO

    io = UnitIO({}, shm_min_bytes=None, timeout=1.0, on_failure=lambda: None)
    ran: list[str] = []

    def work(unit: str, error: Exception | None) -> Any:
        async def one() -> str:
            ran.append(unit)
            if error is not None:
                raise error
            return unit * 2

        return one

    ok = {u: work(u, None) for u in ("a", "b")}
    assert await io._each(ok, inline=inline) == {"a": "aa", "b": "bb"}
    ran.clear()
    failing = {
        "a": work("a", ValueError("a")),
        "b": work("b", StorageUnavailable("b")),
        "c": work("c", None),
    }
    with pytest.raises(StorageUnavailable, match="b"):
        await io._each(failing, inline=inline)
    assert sorted(ran) == ["a", "b", "c"]

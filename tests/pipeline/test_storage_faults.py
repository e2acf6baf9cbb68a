"""A storage unit's death as the Driver and the rollout meet it (issue #27 §5's soak found it): a
prompt put, group opening or group put that fails with ``StorageUnavailable`` stored nothing,
and is made again instead of failing the run or crashing the worker."""

from __future__ import annotations

from typing import Any

import trio

from asyncflow_actors.pipeline import run_pipeline
from asyncflow_actors.transfer_queue import StorageUnavailable, TransferQueueClient

from .kit import tiny


def refuse(monkeypatch: Any, method: str, topic: str, times: int) -> list[str]:
    """The first ``times`` calls of ``TransferQueueClient.<method>`` on ``topic`` fail with
    ``StorageUnavailable`` before storing anything, as when their unit was just killed."""
    real = getattr(TransferQueueClient, method)
    refused: list[str] = []

    async def failing(self: TransferQueueClient, name: str, *args: Any, **kw: Any) -> Any:
        if name == topic and len(refused) < times:
            await trio.lowlevel.checkpoint()
            refused.append(name)
            raise StorageUnavailable("storage unit 'unit-0' failed: killed (test)")
        return await real(self, name, *args, **kw)

    monkeypatch.setattr(TransferQueueClient, method, failing)
    return refused


async def test_the_driver_puts_prompts_again_after_a_refused_put(monkeypatch: Any) -> None:
    refused = refuse(monkeypatch, "put", "prompts", times=3)
    with trio.fail_after(60):
        result = await run_pipeline(tiny("async"))
    assert refused == ["prompts"] * 3
    assert [r.samples for r in result.records] == [16] * 3


async def test_the_driver_opens_groups_again_after_a_refused_opening(monkeypatch: Any) -> None:
    refused = refuse(monkeypatch, "open_groups", "rollout", times=2)
    with trio.fail_after(60):
        result = await run_pipeline(tiny("async"))
    assert refused == ["rollout"] * 2
    assert [r.samples for r in result.records] == [16] * 3


async def test_the_rollout_puts_its_groups_again_after_a_refused_put(
    monkeypatch: Any, caplog: Any
) -> None:
    # a group put that met a unit's death stored nothing: the worker puts it again instead
    # of crashing (its supervisor restarted it and its groups were generated again)
    refused = refuse(monkeypatch, "put", "rollout", times=2)
    with trio.fail_after(60):
        result = await run_pipeline(tiny("async"))
    assert refused == ["rollout"] * 2
    assert [r.samples for r in result.records] == [16] * 3
    crashed = [r.getMessage() for r in caplog.records if "crashed" in r.getMessage()]
    assert crashed == []
    again = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
    assert len(again) == 2 and all("put of" in m for m in again)

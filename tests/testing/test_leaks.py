"""No thread, process or socket outlives a failing example (checked from /proc)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import ClassVar

import pytest
import trio
from hypothesis import Phase
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

import asyncflow_actors as afa
from asyncflow_actors.testing import (
    ActorMachine,
    ResourceLeak,
    ResourceSnapshot,
    check_no_leaks,
    in_trio,
    open_link_proxy,
    open_node_process,
    protocol_settings,
    warm_up_zmq,
)
from tests.testing.actors import Add, Counter, Hold, Total

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

OPTIONS = afa.NodeOptions(heartbeat_timeout=30.0, shutdown_grace=0.5)


class FailingMachine(ActorMachine):
    """Two nodes (a child node, and a node process behind a link proxy), then a planted failure
    while an ask is pending on each."""

    clock = "real"
    runs: ClassVar[int] = 0

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        await super().setup(stack)
        type(self).runs += 1
        far = await stack.enter_async_context(open_node_process(allow=["tests.testing"]))
        proxy = await stack.enter_async_context(open_link_proxy(far.address))
        child = await self.system.start_node("child", allow=["tests.testing"], options=OPTIONS)
        remote = await self.system.connect_node(proxy.address, name="far", options=OPTIONS)
        self.refs = [
            await child.spawn(Counter, name="c"),
            await remote.spawn(Counter, name="c"),
        ]
        self.total = 0

    @rule()
    @in_trio
    async def fail_with_asks_pending(self) -> None:
        for ref in self.refs:
            await ref.send(Add(1))
        self.total += 1
        async with trio.open_nursery() as nursery:
            for ref in self.refs:
                nursery.start_soon(ref.ask, Hold(60.0))
            await trio.sleep(0.05)
            raise AssertionError("planted failure")

    @invariant()
    @in_trio
    async def totals(self) -> None:
        for ref in self.refs:
            assert await ref.ask(Total()) == self.total


def test_a_failing_example_leaves_nothing_behind() -> None:
    warm_up_zmq()
    before = ResourceSnapshot.take()
    settings = protocol_settings(
        max_examples=3, stateful_step_count=4, derandomize=True, database=None,
        phases=[Phase.generate],
    )  # fmt: skip
    with pytest.raises(BaseException) as info:
        run_state_machine_as_test(FailingMachine, settings=settings)
    assert "planted failure" in repr(info.value) or "planted failure" in str(info.value.__cause__)
    assert FailingMachine.runs == 2  # the failing example, and its replay for the report
    check_no_leaks(before, settle=10.0)


def test_a_leak_is_reported() -> None:
    before = ResourceSnapshot.take()
    reader, writer = os.pipe()
    try:
        with pytest.raises(ResourceLeak, match="pipe"):
            check_no_leaks(before, settle=0.1)
    finally:
        os.close(reader)
        os.close(writer)
    check_no_leaks(before, settle=0.1)

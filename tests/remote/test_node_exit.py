"""A node process ends promptly and quietly: after a polite shutdown it does not tear its
interpreter down (seconds with torch loaded, past the owner's shutdown grace), and a node
whose owner died (kill -9) stops at once, its actors' clean-ups not waiting for the dead
owner's actors to answer."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import asyncflow_actors as afa
from tests.remote.exit_actors import HeavyProcess

ALLOW = ["tests.remote", "asyncflow_actors.transfer_queue"]

# A driver with the TransferQueue in its process and, on a node, a consumer waiting in a claim:
# the peer benchmark's trainer node, when its driver is killed at the threshold.
DRIVER = textwrap.dedent(
    """
    import json, trio, asyncflow_actors as afa
    from asyncflow_actors import transfer_queue as tq
    from tests.remote.exit_actors import TOPIC
    async def main():
        config = tq.TransferQueueConfig(topics=(TOPIC,), units=1)
        async with afa.open_actor_system() as system, tq.open_transfer_queue(
            system, config
        ) as queue:
            node = await system.start_node("n", allow=ALLOW)
            await node.spawn("tests.remote.exit_actors:Claimer", name="claimer",
                             kwargs={"controller": queue.controller})
            client = await queue.client()
            while (await client.statistics()).controller.waiting_claims < 1:
                await trio.sleep(0.01)
            print(json.dumps({"node": node.pid}), flush=True)
            await trio.sleep_forever()
    trio.run(main)
    """
).replace("ALLOW", repr(ALLOW))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_stopped_node_exits_without_tearing_its_interpreter_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "torn-down"
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=ALLOW)
        await node.spawn(HeavyProcess, name="heavy", kwargs={"path": str(marker)})
        await node.stop()
    assert not marker.exists()  # no teardown ran: the process ended as its actors had
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []  # it exited within its grace: not terminated


def test_a_node_whose_owner_died_stops_at_once_and_quietly(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr"  # the driver's, and its node's (inherited)
    with open(stderr, "w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=err, cwd=os.getcwd()
        )
    try:
        assert driver.stdout is not None
        node = json.loads(driver.stdout.readline())["node"]
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 60  # a guard against a hang, not a bound
        while _alive(node) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(node)
    finally:
        driver.kill()
        driver.wait()
    # the claimer's clean-ups (withdrawing its claim, returning its holder's leases) fail at
    # once against the dead owner's queue: nothing waited out a timeout, nothing was killed
    lines = stderr.read_text().splitlines()
    assert [line for line in lines if "WARNING" in line or "Error" in line] == []

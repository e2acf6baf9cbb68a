"""A run in the default placement (a process per role) ends cleanly: after its last step every
role and node stops within its grace, and nothing is logged as a fault."""

from __future__ import annotations

import logging

import pytest

from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny


async def test_a_run_with_a_process_per_role_stops_quietly(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    config = tiny("async", staleness=0, train={"steps": 2}, placement={"default": "process"})
    result = await run_pipeline(config)
    assert result.version == 2
    # the driver's records, and the nodes' (their stderr is this process's)
    ours = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("asyncflow_actors") and r.levelno >= logging.WARNING
    ]
    nodes = [line for line in capfd.readouterr().err.splitlines() if "WARNING" in line]
    # no actor killed past its grace, no TransferQueue clean-up timed out, no node terminated
    assert ours == [] and nodes == []

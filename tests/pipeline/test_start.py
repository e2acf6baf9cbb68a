"""The start of a run: node processes launch beside the slower half of the checks
(``pipeline._start``), are stopped on its error, and the observer still sees their roles."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from asyncflow_actors.pipeline import PipelineConfig, PipelineConfigError, _start, run_pipeline
from asyncflow_actors.pipeline._preflight import check_contents, check_paths, preflight

from .kit import tiny

ON_A_NODE = {"default": "local", "roles": {"trainer": "t"}}


def _nodes() -> list[psutil.Process]:
    """This process's node processes (``python -m asyncflow_actors.node``) still running."""
    out = []
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if "asyncflow_actors.node" in command and child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


async def test_a_failed_slow_check_stops_the_nodes_that_started_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``check_contents`` runs while the trainer's node starts (it sees the node process); its
    error comes out of ``run_pipeline`` as itself, and the node is gone by then."""
    seen: list[int] = []

    def slow_check(config: PipelineConfig, checkpoint: str | None) -> None:
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            seen.extend(p.pid for p in _nodes())
            time.sleep(0.05)
        raise PipelineConfigError("task.options: refused by the test")

    monkeypatch.setattr(_start, "check_contents", slow_check)
    with pytest.raises(PipelineConfigError, match=r"^task\.options: refused by the test$"):
        await run_pipeline(tiny("async", placement=ON_A_NODE))
    assert seen  # the node started before the check ended
    assert not [p.pid for p in _nodes() if p.pid in seen]


async def test_a_quick_check_fails_before_any_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing model file is ``check_paths``'s: no node starts (and no slow check runs)."""
    ran: list[str] = []
    monkeypatch.setattr(_start, "check_contents", lambda *a: ran.append("contents"))
    config = tiny("async", placement=ON_A_NODE, model={"init": str(tmp_path / "none")})
    with pytest.raises(PipelineConfigError, match=r"^model\.init: no such file"):
        await run_pipeline(config)
    assert ran == [] and not _nodes()


def test_preflight_is_its_two_halves(tmp_path: Path) -> None:
    """``preflight`` = ``check_paths`` then ``check_contents``: each raises what it checks."""
    config = tiny("async", task={"kind": "addition", "options": {"digits": 3}})
    assert check_paths(config) is None
    with pytest.raises(PipelineConfigError, match=r"^task.options.digits: not an option"):
        check_contents(config, None)
    with pytest.raises(PipelineConfigError, match=r"^task.options.digits: not an option"):
        preflight(config)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PipelineConfigError, match="holds a run already"):
        check_paths(tiny("async", run_dir=str(tmp_path)))


async def test_the_observer_sees_the_roles_of_a_node_started_before_it(tmp_path: Path) -> None:
    """The node starts before the observer exists and waits for it: the trainer's spans (on
    the node) are in the trace."""
    config = tiny(
        "async", placement=ON_A_NODE, observe=True, run_dir=str(tmp_path), train={"steps": 2}
    )
    result = await run_pipeline(config)
    assert result.version == 2
    trace: dict[str, Any] = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert any(name.startswith("trainer-0 [") and "driver" not in name for name in names), names
    trained = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "train"]
    assert len(trained) == 2

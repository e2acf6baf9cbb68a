"""``asyncflow train`` as a user meets it: a process started in its own process group, stopped
by a terminal's Ctrl-C, errors in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import trio

from asyncflow_actors.pipeline import PipelineConfig, run_pipeline

RUN_TOML = """
mode = "async"
run_dir = "run"
progress = "plain"
plot = false

[model]
d_model = 32
n_layers = 1
n_heads = 2
max_seq_len = 16

[task.options]
min_digits = 1
max_digits = 2

[rollout]
group_size = 4
max_new_tokens = 4

[train]
steps = 1000
prompts_per_step = 4

[placement]
default = "local"
roles.rollout = "gen"    # one node process: a terminal's Ctrl-C must not reach it
"""


def _start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "asyncflow_actors.cli", "train", "run.toml", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


async def test_ctrl_c_stops_the_run_cleanly_and_names_the_resume_command(tmp_path: Path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C): the run saves its last step,
    prints one line naming the command that resumes it, and exits 130; no role reports a lost
    node (the node process ignores the group's signal: its driver stops it); the checkpoint
    resumes."""
    process = _start(tmp_path)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the first step: the run is under way
            if line.startswith("step "):
                break
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    match = re.fullmatch(
        r"stopped at step (\d+); resume with: asyncflow train run\.toml --resume (\S+)", lines[0]
    )
    assert match is not None, lines[0]
    step, checkpoint = int(match[1]), match[2]
    assert checkpoint == "run/final"
    assert "NodeLost" not in out
    config = PipelineConfig.from_toml(tmp_path / "run.toml")
    table: dict[str, Any] = {"steps": step + 1}
    config = attrs.evolve(
        config,
        run_dir=str(tmp_path / "run"),
        progress="none",
        train=attrs.evolve(config.train, **table),
        placement=attrs.evolve(config.placement, roles={}),
    )
    with trio.fail_after(60):
        resumed = await run_pipeline(config, resume=str(tmp_path / checkpoint))
    assert [r.version for r in resumed.records] == [step + 1]


def test_ctrl_c_stops_the_dashboard_quietly(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncflow_actors.cli", "dashboard", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith('{"url"')  # listening
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, out, err) == (130, "", "")

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
import pytest
import trio

from asyncflow_actors.pipeline import PipelineConfig, run_pipeline
from asyncflow_actors.testing import find_exception

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

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


def _start(tmp_path: Path, *args: str, node: bool = True) -> subprocess.Popen[str]:
    toml = RUN_TOML if node else RUN_TOML.replace('roles.rollout = "gen"', "")
    (tmp_path / "run.toml").write_text(toml)
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


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_a_signal_stops_the_run_cleanly_and_names_the_resume_command(
    tmp_path: Path, signum: int, code: int
) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C), or SIGTERM (a scheduler's
    stop): the run saves its last step, prints one line naming the command that resumes it,
    and exits 130 / 143; no role reports a lost node (the node process ignores the group's
    signal: its driver stops it); the checkpoint resumes."""
    process = _start(tmp_path, node=signum == signal.SIGINT)  # (SIGTERM: the quicker run)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the first step: the run is under way
            if line.startswith("step "):
                break
        os.killpg(process.pid, signum)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == code, (err, out[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    match = re.fullmatch(
        r"stopped at step (\d+); resume with: asyncflow train run\.toml --resume (\S+)", lines[0]
    )
    assert match is not None, lines[0]
    step, checkpoint = int(match[1]), match[2]
    assert checkpoint == "run/final"
    assert "NodeLost" not in out
    if signum != signal.SIGINT:
        return  # the same checkpoint as a Ctrl-C's: resumed once, below
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


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_dashboard_quietly(tmp_path: Path, signum: int, code: int) -> None:
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
        os.killpg(process.pid, signum)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (process.returncode, out, err) == (code, "", "")


BAD = """
mode = "sync"
run_dir = "run"
progress = "none"
plot = false

[model]
d_model = 32
n_layers = 1
n_heads = 2
max_seq_len = 16

[task.options]
max_digits = 2

[rollout]
group_size = 4
max_new_tokens = 4

[train]
steps = 2
prompts_per_step = 2

[placement]
default = "local"
"""


def _train(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, toml: str, *args: str
) -> tuple[int, list[str]]:
    """``asyncflow train`` in this process: its exit status and stderr's lines."""
    from asyncflow_actors import cli

    (tmp_path / "run.toml").write_text(toml)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["train", "run.toml", *args])
    finally:
        os.chdir(cwd)
    return int(exit_info.value.code or 0), capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("old", "new", "args", "line"),
    [
        ("", "", ("--steps", "0"), "--steps: expected a number > 0, got 0"),
        ("", "", ("--resume", "nowhere"), "--resume: no such directory: nowhere"),
        ("", "", ("--resume", "."), "--resume: . holds no checkpoint"),
        ("", "", ("--resume", "run"), "--resume: no such directory: run"),
        ("max_digits = 2", "max_digit = 2", (), "task.options.max_digit: not an option"),
        ("max_digits = 2", "max_digits = 7", (), "rollout.max_new_tokens: prompts of up to 17"),
        ("max_digits = 2", "max_digits = 2\nmin_digits = 3", (), "task.options: max_digits (2)"),
        ("n_heads = 2", "n_heads = 3", (), "model.n_heads: d_model = 32 does not split"),
        ("group_size = 4", "top_p = 1.5", (), "rollout.top_p: expected a number in (0, 1]"),
        ("[train]", "[algorithm]\nagg = 'token_mean'\n[train]", (), "algorithm.agg: expected"),
        ("n_heads = 2", "n_heads = 2\ninit = 'nope.safetensors'", (), "model.init: no such file"),
        ("[train]", "[train]\nrank_launcher = 'slurm'", (), "train.rank_launcher: expected"),
        ("[train]", "[train]\nray_strategy = 'pack'", (), "train.ray_strategy: expected one"),
        ("[train]", "[train]\nray_rank_resources = {GPU = -1}", (), "train.ray_rank_resources"),
    ],
)
def test_a_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    old: str,
    new: str,
    args: tuple[str, ...],
    line: str,
) -> None:
    code, lines = _train(capsys, tmp_path, BAD.replace(old, new), *args)
    assert (code, len(lines)) == (2, 1), lines
    assert lines[0].startswith(f"asyncflow train: {line}"), lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_wrong_model_path_fails_in_one_line_before_torch_loads(tmp_path: Path) -> None:
    """A fresh process, as a user starts it: no torch, no node, no traceback. (What makes such
    an error come in about a second is that nothing heavy is imported first: asserted here with
    a ``torch`` that fails the run if anything imports it, not with a wall-clock bound that a
    loaded machine breaks.)"""
    toml = BAD.replace("n_heads = 2", 'n_heads = 2\nhf = "/models/x"')
    (tmp_path / "run.toml").write_text(toml.replace("group_size = 4", 'engine = "hf"'))
    shim = tmp_path / "shim"
    for heavy in ("torch", "transformers"):
        (shim / heavy).mkdir(parents=True)
        (shim / heavy / "__init__.py").write_text(f"raise ImportError('{heavy} was imported')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow_actors.cli", "train", "run.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "asyncflow train: model.hf: no such directory: /models/x\n"


def test_a_failed_run_names_its_root_cause_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role that raises fails the run: one line naming the role and the author's exception
    (not trio's group, not the supervisor's wrapper), exit 1; ``--debug`` raises it whole."""
    from asyncflow_actors.roles import _compute

    def broken(self: Any, data: Any) -> Any:
        raise ValueError("the loss is not a number")

    monkeypatch.setattr(_compute.Learner, "updates", broken)
    code, lines = _train(capsys, tmp_path, BAD)
    assert (code, lines) == (
        1,
        [
            "asyncflow train: role 'trainer-0' failed: ValueError: the loss is not a number "
            "(--debug: the full trace)"
        ],
    )
    from asyncflow_actors.pipeline import RunFailed

    with pytest.raises(BaseException) as info:
        _train(capsys, tmp_path, BAD, "--debug", "--overwrite")
    found = find_exception(info.value, RunFailed)
    assert found is not None and isinstance(found.error, ValueError)


def test_runtime_errors_show_the_exception_inside_a_group_of_one() -> None:
    """trio wraps an actor's error in a group of one: the runtime's summaries show the error
    itself, and ``root_error`` digs it out of every wrapper."""
    from asyncflow_actors.actors import ActorCrashed, SupervisorFailed, root_error

    boom = ValueError("boom")
    group = ExceptionGroup("Exceptions from Trio nursery (1 sub-exception)", [boom])
    failed = SupervisorFailed("sup", "too many restarts", [group, group])
    assert str(failed).splitlines()[1:] == ["  - ValueError: boom"] * 2
    assert "ValueError: boom" in str(ActorCrashed("a", group))
    assert root_error(ActorCrashed("outer", failed)) is boom


def test_ray_ranks_without_ray_name_the_extra(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    toml = BAD.replace("[train]", "[train]\nranks = 2\nrank_launcher = 'ray'")
    code, lines = _train(capsys, tmp_path, toml)
    assert (code, lines) == (2, [
        "asyncflow train: train.rank_launcher: 'ray' needs ray, which is not installed (the "
        "'ray' extra)"
    ])  # fmt: skip

"""Configuration: TOML in, a frozen value out; every mistake named by its key, before anything
starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncflow_actors import cli
from asyncflow_actors.pipeline import PipelineConfig, PipelineConfigError
from asyncflow_actors.roles._schema import station_columns, topic_specs

GOOD = """
mode = "async"
staleness = 2
run_dir = "runs/x"

[task]
kind = "addition"
seed = 3
[task.options]
min_digits = 1
max_digits = 3

[rollout]
group_size = 4
pause_mode = "abort"

[train]
steps = 7
lr = 1e-4

[placement]
default = "process"
[placement.roles]
advantage = "driver"
trainer = "gpu"
[placement.nodes]
gpu = "tcp://10.1.2.3:5555"
"""


def test_a_toml_file_loads_into_a_frozen_config(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(GOOD)
    config = PipelineConfig.from_toml(path)
    assert (config.mode, config.effective_staleness, config.train.steps) == ("async", 2, 7)
    assert config.task.options == {"min_digits": 1, "max_digits": 3}
    assert config.placement_of("advantage", "advantage-0") == "driver"
    assert config.placement_of("trainer", "trainer-0") == "gpu"
    assert config.placement_of("rollout", "rollout-0") == "rollout-0"  # its own process
    spec = config.run_spec()
    assert spec.batch_size == 8 * 4 and not spec.stage_barrier and spec.staleness == 2
    # the placement names the advantage role: it runs as a station of its own
    assert not spec.fused_advantage and ("advantage", "advantage-0") in config.instances()


def test_the_advantage_placed_in_actor_forward_runs_no_station_of_its_own() -> None:
    config = PipelineConfig.from_dict({"mode": "sync"})
    assert not config.run_spec().fused_advantage
    assert config.rollout.pause_mode == "none" and not config.rollout.pauses
    fused = PipelineConfig.from_dict({"placement": {"roles": {"advantage": "actor_fwd"}}})
    assert fused.run_spec().fused_advantage
    assert [role for role, _ in fused.instances()] == ["rollout", "actor_fwd", "trainer"]


def test_the_forward_and_the_advantage_folded_into_the_trainer_run_no_station() -> None:
    roles = {"actor_fwd": "trainer", "advantage": "trainer"}
    config = PipelineConfig.from_dict({"placement": {"roles": roles}})
    spec = config.run_spec()
    assert spec.trainer_forward and spec.trainer_advantage and not spec.advantage_station
    assert [role for role, _ in config.instances()] == ["rollout", "trainer"]
    _, rollout = topic_specs(spec)
    assert list(rollout.consumers) == ["trainer"]
    assert "old_logprobs" not in station_columns(spec)["trainer"]
    assert "advantages" not in station_columns(spec)["trainer"]
    # sync: the stages that remain do not wait for a column nobody writes
    sync = PipelineConfig.from_dict(
        {"mode": "sync", "placement": {"roles": {"actor_fwd": "trainer"}}}
    )
    columns = station_columns(sync.run_spec())
    assert "old_logprobs" not in columns["advantage"] + columns["trainer"]
    assert "advantages" in columns["trainer"]


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"trian": {}}, "trian: unknown key"),
        ({"train": {"lrr": 1.0}}, "train.lrr: unknown key"),
        ({"train": {"steps": "ten"}}, "train.steps: expected a int"),
        ({"train": {"steps": 0}}, "train.steps: expected a number > 0, got 0"),
        ({"train": {"auto_resume": "yes"}}, "train.auto_resume: expected a bool"),
        (
            {"train": {"auto_resume_retries": -1}},
            "train.auto_resume_retries: expected a number >= 0",
        ),
        ({"rollout": {"pause_mode": "nap"}}, "rollout.pause_mode: expected one of"),
        ({"algorithm": {"agg": "token_mean"}}, "algorithm.agg: expected one of ['token-mean'"),
        ({"algorithm": {"kl_estimator": "k4"}}, "algorithm.kl_estimator: expected one of"),
        ({"algorithm": {"clip_low": 1.0}}, "algorithm.clip_low: expected a number in [0, 1)"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p: expected a number in (0, 1], got 1.5"),
        ({"rollout": {"temperature": 0}}, "rollout.temperature: expected a number > 0"),
        ({"model": {"d_model": 30, "n_heads": 4}}, "model.n_heads: d_model = 30 does not split"),
        ({"model": {"device": "gpu"}}, "model.device: expected a torch device"),
        ({"staleness": -1}, "staleness: expected an int >= 0"),
        ({"mode": "sync", "staleness": 2}, "staleness: mode 'sync' runs at staleness 0"),
        ({"mode": "turbo"}, "mode: expected one of"),
        ({"placement": {"roles": {"trainr": "x"}}}, "placement.roles.trainr: unknown role"),
        ({"placement": {"roles": {"ref_fwd": "x"}}}, "placement.roles.ref_fwd: this run has no"),
        ({"placement": {"roles": {"ref_fwd": "trainer"}}}, "placement.roles.ref_fwd: only"),
        (
            {"placement": {"roles": {"actor_fwd": "trainer", "advantage": "actor_fwd"}}},
            "placement.roles.advantage: 'actor_fwd' runs inside the trainer",
        ),
        ({"placement": {"nodes": {"gpu": "10.0.0.1"}}}, "placement.nodes.gpu: expected an address"),
        (
            {"mode": "colocated", "placement": {"roles": {"trainer": "elsewhere"}}},
            "placement.roles.trainer: colocated mode shares one model",
        ),
        ({"mode": "colocated", "rollout": {"workers": 2}}, "rollout.workers: colocated"),
        ({"rollout": {"max_new_tokens": 40}}, "rollout.max_new_tokens"),
    ],
)
def test_a_bad_config_names_the_key(table: dict[str, object], named: str) -> None:
    with pytest.raises(PipelineConfigError, match=re.escape(named)) as info:
        PipelineConfig.from_dict(table)
    assert named in str(info.value)


def test_the_cli_refuses_a_bad_config_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nsteps = 3\nlearning_rate = 0.1\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", str(path)])
    assert exit_info.value.code == 2
    assert "train.learning_rate: unknown key" in capsys.readouterr().err


def test_the_cli_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "dashboard" in out
    assert "``" not in out  # no RST markup


TINY = """
mode = "sync"
progress = "plain"
run_dir = "{run_dir}"

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


def test_asyncflow_train_runs_a_toml_file(tmp_path: Path) -> None:
    """What a user types: ``asyncflow train run.toml`` prints a line per step and a summary,
    and leaves the step records and the reward/throughput picture in the run directory."""
    import json
    import subprocess
    import sys

    path = tmp_path / "run.toml"
    path.write_text(TINY.format(run_dir=tmp_path / "run"))
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow_actors.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    )
    lines = done.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines[:2]] == ["1/2", "2/2"]
    summary = json.loads(lines[-1])
    assert summary["steps"] == 2 and summary["samples"] == 16 and summary["mode"] == "sync"
    assert len((tmp_path / "run" / "steps.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_vllm_example_config_loads() -> None:
    """examples/vllm_grpo.toml runs in nox -s tests_vllm; here it must stay a valid config."""
    root = Path(__file__).resolve().parents[2]
    config = PipelineConfig.from_toml(root / "examples" / "vllm_grpo.toml")
    assert config.rollout.engine == "vllm" and config.model.hf is not None

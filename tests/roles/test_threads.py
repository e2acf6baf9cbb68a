"""``train.torch_threads``: a number, or ``"auto"`` (``roles._threads``)."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncflow_actors.pipeline import PipelineConfig, PipelineConfigError, run_pipeline
from asyncflow_actors.roles._threads import available_cpus, intra_op_threads
from tests.pipeline.kit import tiny


def _threads_of_a_fresh_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def _spec(threads: int | str, staleness: int, **placement: object) -> object:
    config = PipelineConfig.from_dict({
        "mode": "async", "staleness": staleness, "train": {"torch_threads": threads},
        "placement": placement or {"default": "process"},
    })  # fmt: skip
    return config.run_spec()


def test_a_number_is_used_as_given() -> None:
    assert intra_op_threads(_spec(3, 1), cpus=16) == 3  # type: ignore[arg-type]
    assert intra_op_threads(_spec(3, 0), cpus=1) == 3  # type: ignore[arg-type]


def test_auto_gives_every_cpu_on_policy_and_shares_them_otherwise() -> None:
    """At staleness 0 rollout and training take turns: each process may use every CPU; at
    staleness 1 they compute at once: the CPUs are divided among the run's processes."""
    on_policy = _spec("auto", 0)
    assert intra_op_threads(on_policy, cpus=2) == 2  # type: ignore[arg-type]
    two = _spec("auto", 1, default="local", roles={"trainer": "t"})
    assert two.processes == 2  # type: ignore[attr-defined]
    assert intra_op_threads(two, cpus=8) == 4  # type: ignore[arg-type]
    assert intra_op_threads(two, cpus=2) == 1  # type: ignore[arg-type]
    assert intra_op_threads(two, cpus=1) == 1  # type: ignore[arg-type]  # never 0


def test_the_processes_of_a_run() -> None:
    """The driver's and one per node (each extra rank too): what ``"auto"`` divides."""
    assert PipelineConfig.from_dict({"placement": {"default": "local"}}).processes == 1
    # rollout, actor_fwd, advantage and trainer each on a node of its own, and the driver
    assert PipelineConfig.from_dict({}).processes == 5
    folded = {"default": "process", "roles": {"actor_fwd": "trainer", "advantage": "trainer",
                                              "rollout": "driver"}}  # fmt: skip
    assert PipelineConfig.from_dict({"placement": folded}).processes == 2
    ranked = {"placement": {"default": "local"}, "train": {"ranks": 3}}
    assert PipelineConfig.from_dict(ranked).processes == 3


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5])
def test_a_bad_value_names_the_key(bad: object) -> None:
    with pytest.raises(PipelineConfigError, match=r"^train\.torch_threads: expected "):
        PipelineConfig.from_dict({"train": {"torch_threads": bad}})


async def test_an_on_policy_run_with_auto_computes_on_every_cpu() -> None:
    """The path is taken: a run in this process leaves torch on ``available_cpus()`` threads
    (the stations set them when they start; a thread reads the setting at its first torch
    operation, hence a fresh one here), and trains as with one thread."""
    before = torch.get_num_threads()
    try:
        result = await run_pipeline(tiny("async", staleness=0, train={"torch_threads": "auto"}))
        assert _threads_of_a_fresh_thread() == available_cpus()
    finally:
        torch.set_num_threads(before)
    assert result.version == 3 and result.offpolicy_samples == 0

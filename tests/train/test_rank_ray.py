"""Ranks placed by Ray (``train.rank_launcher = "ray"``): rank 1 is a Ray actor in a bundle of
a placement group, takes the same update as one process, a killed Ray rank fails the step naming
it, a group Ray cannot place fails at once naming the bundle, and closing the group removes the
actor and the placement group."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncflow_actors.pipeline import run_pipeline
from asyncflow_actors.roles._compute import Learner
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.roles._ranks import RankFailed
from tests.pipeline.kit import tiny

from .conftest import global_batch, run_spec

ray = pytest.importorskip("ray", reason="ray is not installed (the `ray` extra)")

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A fresh local Ray instance with 2 CPUs (never a cluster named by RAY_ADDRESS)."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=80 << 20,  # the minimum: the ranks' traffic never uses it
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        yield
    finally:
        ray.shutdown()


def groups() -> dict[str, str]:
    """State of every placement group Ray knows (CREATED, PENDING, REMOVED)."""
    return {pg_id: info["state"] for pg_id, info in ray.util.placement_group_table().items()}


def relative(a: object, b: object) -> float:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_a_ray_rank_takes_the_one_process_update_and_leaves_nothing(local_ray: None) -> None:
    spec = run_spec()
    parallel = ParallelSettings(ranks=2, launcher="ray", timeout_s=60.0)
    with DistributedLearner.open(spec, parallel) as learner:
        (rank,) = learner.group.children
        where = ray.get(rank.handle.where.remote(), timeout=30)  # rank 1: a Ray actor
        assert where["pid"] != os.getpid()
        ((group_id, state),) = groups().items()
        assert state == "CREATED" and where["placement_group"] == group_id
        reference = Learner(spec, spec.task.build())
        data = global_batch()
        expected = reference.step(data)
        metrics = learner.step(data)
        assert metrics["updates"] == expected["updates"]
        grads = learner.gradients()
        for name, param in reference.model.named_parameters():
            assert param.grad is not None
            assert relative(grads[name], param.grad) <= 1e-5, name
    assert set(groups().values()) == {"REMOVED"}
    with pytest.raises(ray.exceptions.RayActorError):  # the rank's actor is gone
        ray.get(rank.handle.where.remote(), timeout=30)


def test_a_killed_ray_rank_fails_the_step_naming_it(local_ray: None) -> None:
    timeout = 30.0
    parallel = ParallelSettings(ranks=2, launcher="ray", timeout_s=timeout)
    env = {"AFA_RANK_KILL_IN_BACKWARD": "1"}  # rank 1 SIGKILLs itself in its first backward
    with DistributedLearner.open(run_spec(), parallel, env=env) as learner:
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1") as failure:
            learner.step(global_batch())
        assert failure.value.rank == 1
        assert time.monotonic() - started < timeout


def test_a_group_ray_cannot_place_fails_naming_the_bundles(local_ray: None) -> None:
    # STRICT_SPREAD wants each bundle on its own Ray node: a one-node cluster cannot place 2
    parallel = ParallelSettings(ranks=3, launcher="ray", ray_strategy="STRICT_SPREAD",
                                timeout_s=3.0)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"did not place 2 bundle\(s\).*STRICT_SPREAD"):
        DistributedLearner.open(run_spec(), parallel)
    deadline = time.monotonic() + 10
    while "PENDING" in groups().values() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "PENDING" not in groups().values()  # the unplaceable group was removed


async def test_a_run_whose_trainer_process_places_its_ranks_with_ray(
    local_ray: None, tmp_path: Path
) -> None:
    """As a user runs it: the Trainer in a node process of its own joins the Ray cluster by its
    address and places rank 1 there; the run trains every step and removes its group."""
    address = ray.get_runtime_context().gcs_address
    train = {"ranks": 2, "rank_launcher": "ray", "ray_address": address, "ray_strategy": "SPREAD"}
    config = tiny("async", train=train, placement={"roles": {"trainer": "trainer"}},
                  run_dir=str(tmp_path))  # fmt: skip
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2, 3]
    assert all(r.metrics["normaliser"] > 0 for r in result.records)
    assert set(groups().values()) == {"REMOVED"}  # this run's group, and the earlier tests'

"""A forward station's rank 1 as a Ray actor (``train.rank_launcher = "ray"``): the same
log-probs as one process, and nothing left in Ray after the group closes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from asyncflow_actors.roles._compute import build_policy, sequence_logprobs
from asyncflow_actors.roles._forward_ranks import ForwardGroup

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
        object_store_memory=80 << 20,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_a_ray_forward_rank_gives_the_one_process_log_probs(local_ray: None) -> None:
    spec = run_spec(forward_ranks=2, rank_launcher="ray", collective_timeout=60)
    rows = global_batch(8)
    model, tokenizer = build_policy(spec.model, spec.task.build())
    expected = sequence_logprobs(
        model, rows["prompt_ids"], rows["response_ids"], pad_id=tokenizer.pad_id, temperature=1.0
    )
    with ForwardGroup.open(spec) as forward:
        (rank,) = forward.group.children
        where = ray.get(rank.handle.where.remote(), timeout=30)  # rank 1: a Ray actor
        assert where["pid"] != os.getpid()
        got = forward.logprobs(
            rows["prompt_ids"], rows["response_ids"], pad_id=tokenizer.pad_id, temperature=1.0
        )
    for a, e in zip(got, expected, strict=True):
        assert float((a - e).abs().max() / e.abs().max()) <= 1e-5
    states = {info["state"] for info in ray.util.placement_group_table().values()}
    assert states == {"REMOVED"}

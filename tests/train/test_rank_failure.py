"""A rank killed in the middle of its backward fails the step with ``RankFailed`` naming it,
well within the collective timeout: the leader never hangs in a collective; the other ranks
are stopped with it and the process can start a new group (from the last checkpoint)."""

from __future__ import annotations

import time

import pytest

from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings
from asyncflow_actors.roles._ranks import RankFailed

from .conftest import global_batch, run_spec


def test_a_rank_killed_mid_backward_fails_the_step_naming_it() -> None:
    timeout = 30.0
    parallel = ParallelSettings(ranks=2, timeout_s=timeout)
    env = {"AFA_RANK_KILL_IN_BACKWARD": "1"}  # rank 1 SIGKILLs itself in its first backward
    with DistributedLearner.open(run_spec(), parallel, env=env) as learner:
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1") as failure:
            learner.step(global_batch())
        assert failure.value.rank == 1
        assert time.monotonic() - started < timeout
        with pytest.raises(RankFailed, match="closed"):
            learner.step(global_batch())  # the group is unusable after a failure
    with DistributedLearner.open(run_spec(), ParallelSettings(ranks=1)) as again:
        assert again.step(global_batch())["normaliser"] > 0

"""The environment-driven rendezvous of torchrun / SLURM: every rank started by someone else,
rank 0 leads, the others serve until it closes the group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings

from .conftest import global_batch, run_spec

FOLLOWER = """
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import ParallelSettings
from tests.train.conftest import run_spec
assert DistributedLearner.from_env(run_spec(), ParallelSettings(ranks=2)) is None
"""


def test_ranks_started_elsewhere_meet_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER], env={**os.environ, **env, "RANK": "1"}
    )
    for key, value in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    learner = DistributedLearner.from_env(run_spec(), ParallelSettings(ranks=2))
    assert learner is not None
    with learner:
        assert learner.step(global_batch())["normaliser"] > 0
    assert follower.wait(30) == 0

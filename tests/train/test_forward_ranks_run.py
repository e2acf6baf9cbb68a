"""Pipeline runs whose forward stations are 2 ranks each (FSDP2 on gloo, forward only):
ActorForward (loading every synced version into its shards) and RefForward train their steps;
a process holds one rank group, which the config checks; a forward rank that dies fails its
station naming it, and the station restarts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from asyncflow_actors.pipeline import PipelineConfigError, run_pipeline
from asyncflow_actors.roles import RankFailed
from tests.pipeline.kit import tiny

# ActorForward in a node process of its own; RefForward (and the trainer, on one rank) here
APART = {"roles": {"actor_fwd": "fwd"}}


async def test_a_run_with_two_forward_ranks_trains_its_steps() -> None:
    """Sync mode: the rollout and ActorForward hold the same version at every step, so the
    old log-probs (ActorForward's, on its ranks, after each weight load) match the engine's.
    The entropy bonus moves the weights at every step (the first rewards are all equal: no
    advantage), so a version not loaded on the ranks shows (k1 ~ 0.1 here, else ~1e-8)."""
    config = tiny(
        "sync",
        train={"steps": 2, "lr": 0.05, "forward_ranks": 2, "collective_timeout": 60},
        algorithm={"kl_coef": 0.05, "entropy_coef": 0.1},
        placement=APART,
    )
    result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2]
    for record in result.records:
        assert record.metrics["grad_norm"] > 0
        assert abs(record.metrics["mismatch_kl_k1"]) < 1e-5, record.metrics
    assert result.records[0].sync["sync_bytes"] > 0  # loaded on the ranks
    # RefForward's ranks: the reference is the first version's policy, then moves away
    assert result.records[0].metrics["kl_ref"] < 1e-6 < result.records[1].metrics["kl_ref"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"algorithm": {"kl_coef": 0.05}}, "placement.roles.ref_fwd: ref_fwd-0 and actor_fwd-0"),
        (
            {
                "train": {"forward_ranks": 2, "ranks": 2},
                "placement": {"roles": {"actor_fwd": "fwd", "trainer": "fwd"}},
            },
            "placement.roles.trainer: trainer-0 and actor_fwd-0",
        ),
        ({"placement": {"roles": {"actor_fwd": "fwd", "trainer": "fwd"}}}, None),  # 1 rank
        ({"mode": "colocated"}, "colocated mode"),
        ({"placement": {"roles": {"actor_fwd": "trainer"}}}, "no forward station"),
    ],
)
def test_rank_groups_sharing_a_process_are_refused(
    overrides: dict[str, Any], match: str | None
) -> None:
    table = {"train": {"forward_ranks": 2}, **overrides}
    mode = table.pop("mode", "async")
    if match is None:  # a trainer of one process shares a node with the forward ranks
        tiny(mode, **table)
        return
    with pytest.raises(PipelineConfigError, match=match):
        tiny(mode, **table)


async def test_a_forward_rank_killed_fails_the_station_naming_it_and_it_restarts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """ActorForward's rank 1 dies in its first forward (once): the station crashes with
    ``RankFailed`` naming it, within the collective timeout; its supervisor restarts it (a
    fresh group of ranks) and the run trains its steps."""
    monkeypatch.setenv("AFA_RANK_KILL_IN_FORWARD", "1")
    monkeypatch.setenv("AFA_RANK_KILL_ONCE", str(tmp_path / "killed"))
    config = tiny("async", train={"steps": 2, "forward_ranks": 2, "collective_timeout": 60})
    with trio.fail_after(90), caplog.at_level(logging.WARNING):
        result = await run_pipeline(config)
    assert [r.version for r in result.records] == [1, 2]
    crashes = [r.exc_info[1] for r in caplog.records if r.exc_info and r.exc_info[1]]
    ranks = [e for c in crashes for e in failures(c) if isinstance(e, RankFailed)]
    assert ranks and all(e.rank == 1 for e in ranks), crashes
    assert any("actor_fwd" in r.getMessage() for r in caplog.records if r.exc_info)


def failures(exc: BaseException) -> list[BaseException]:
    """Every exception in a tree of groups and causes."""
    out = [exc]
    for inner in getattr(exc, "exceptions", ()):
        out += failures(inner)
    if exc.__cause__ is not None:
        out += failures(exc.__cause__)
    return out

"""The soak's machinery (``benchmarks/soak.py``), kept from rotting: the seeded schedule, and a
mini campaign of three faults (a station killed, then stalled, then a storage unit stalled)
against a real run, judged from its ledger."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio

from asyncflow_actors import testing as aft
from asyncflow_actors.pipeline import PipelineConfig

from ..pipeline.kit import tiny


def process_config(run_dir: str | None = None) -> PipelineConfig:
    """The soak's placement: every role and both storage units in processes of their own."""
    return tiny(
        "async",
        run_dir=run_dir,
        rollout={"reward": "actor"},
        algorithm={"kl_coef": 0.01},
        placement={"default": "process", "tq_placement": "process", "tq_units": 2},
    )


def test_the_targets_of_a_run_follow_its_placement() -> None:
    targets = aft.fault_targets(process_config(), links=["rollout-0", "trainer-0", "unit-0"])
    assert targets["kill_role"] == ["reward-0", "rollout-0", "actor_fwd-0", "ref_fwd-0",
                                    "advantage-0"]  # fmt: skip
    assert targets["kill_trainer"] == ["trainer-0"]
    assert targets["kill_unit"] == ["unit-0", "unit-1"]
    assert targets["stall"] == targets["kill_role"] + targets["kill_unit"]
    assert targets["link_cut"] == ["rollout-0", "trainer-0", "unit-0"]
    assert targets["link_delay"] == ["rollout-0", "trainer-0", "unit-0"]
    # everything in this process, or only the rollout on a node: nothing else to hit
    local = aft.fault_targets(tiny("async", placement={"default": "local",
                                                       "roles": {"rollout": "gen"}}))  # fmt: skip
    assert local["kill_role"] == ["gen"] and local["kill_unit"] == local["kill_trainer"] == []


def test_a_kill_hits_what_the_process_holds_folded_stations_included() -> None:
    """In the folded placement ActorForward and Advantage live in the Trainer's process: a
    kill of that process is a kill of each, and a fault meant for them hits it."""
    folded = tiny(
        "async",
        rollout={"reward": "actor"},
        algorithm={"kl_coef": 0.01},
        placement={"default": "process", "tq_placement": "process", "tq_units": 1,
                   "roles": {"actor_fwd": "trainer", "advantage": "trainer"}},
    )  # fmt: skip
    held = aft.roles_at(folded)
    assert held == {
        "reward-0": ("reward-0",),
        "rollout-0": ("rollout-0",),
        "ref_fwd-0": ("ref_fwd-0",),
        "trainer-0": ("trainer-0", "actor_fwd-0", "advantage-0"),
        "unit-0": ("unit-0",),
    }
    targets = aft.fault_targets(folded)
    assert targets["kill_role"] == ["reward-0", "rollout-0", "ref_fwd-0"]
    assert targets["kill_trainer"] == ["trainer-0"]
    assert aft.target_node(folded, "actor_fwd-0") == "trainer-0"
    assert aft.target_node(folded, "advantage-0") == "trainer-0"
    assert aft.target_node(folded, "rollout-0") == "rollout-0"
    with pytest.raises(ValueError, match="no process of this run holds 'critic-0'"):
        aft.target_node(folded, "critic-0")
    # one process per role: each holds its own
    assert aft.roles_at(process_config())["actor_fwd-0"] == ("actor_fwd-0",)
    fused = tiny("async", placement={"default": "process", "roles": {"advantage": "actor_fwd"}})
    assert aft.target_node(fused, "advantage-0") == "actor_fwd-0"


def test_a_schedule_is_a_seeded_plan() -> None:
    targets = aft.fault_targets(process_config(), links=["rollout-0", "unit-1"])
    schedule = aft.FaultSchedule(every=20, seed=3)
    plan = schedule.plan(600, targets)
    assert plan == aft.FaultSchedule(every=20, seed=3).plan(600, targets)
    assert plan != aft.FaultSchedule(every=20, seed=4).plan(600, targets)
    assert [f.at for f in plan] == [20.0 * i for i in range(1, 30)]
    assert {f.kind for f in plan} == set(aft.FAULT_KINDS)
    for f in plan:
        assert f.target in targets[f.kind]
        if f.kind == "stall":
            assert 0.5 <= f.seconds <= 3.0 < afa_heartbeat()  # a pause, not a death
        if f.kind == "link_cut":
            assert f.seconds > afa_heartbeat()  # the link drops
    only = aft.FaultSchedule(every=5, first=1, weights={"kill_unit": 1, "link_cut": 1})
    assert {f.kind for f in only.plan(60, {"kill_unit": ["unit-0"]})} == {"kill_unit"}
    reward = aft.FaultSchedule(every=5, only=["reward-0"]).plan(60, targets)
    assert {f.target for f in reward} == {"reward-0"}
    assert {f.kind for f in reward} == {"kill_role", "stall"}  # no proxy on its link here
    with pytest.raises(ValueError, match="unknown fault kind 'kill_all'"):
        aft.FaultSchedule(weights={"kill_all": 1})


def afa_heartbeat() -> float:
    import asyncflow_actors as afa

    return afa.NodeOptions().heartbeat_timeout


def test_the_names_links_are_opened_under() -> None:
    assert aft.node_base_name("rollout-0.3ecd69a4") == "rollout-0"
    assert aft.node_base_name("tq.3ecd69a4-unit-1") == "unit-1"
    assert aft.node_base_name("gen") == "gen"


# The mini campaign: a station killed, then stalled (once it is back), then a storage unit
# stalled. (Storage unit
# kills are left out until the run survives them: the soak's findings in docs/testing.md.)
MINI = aft.FaultSchedule(
    every=1.5, first=0.5, seed=28, weights={"kill_role": 1, "stall": 1}, stall_seconds=(0.5, 1.5)
)


async def test_a_mini_soak_loses_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    config = tiny(
        "async",
        run_dir=str(tmp_path),
        train={"steps": 10**6},
        placement={"default": "local", "roles": {"rollout": "gen"},
                   "tq_placement": "process", "tq_units": 1},
    )  # fmt: skip
    plan = MINI.plan(4, aft.fault_targets(config))
    assert [(f.kind, f.target) for f in plan] == [
        ("kill_role", "gen"), ("stall", "gen"), ("stall", "unit-0")
    ]  # fmt: skip
    with trio.fail_after(90):
        result = await aft.run_soak(config, MINI, seconds=4, links=False, settle=30)
    assert result.error is None and result.finished
    assert (result.faults["kill_role"], result.faults["stall"]) == (1, 2)
    assert not result.skipped
    assert len(result.recovery_s) == 3 and all(math.isfinite(r) for r in result.recovery_s)
    assert result.lost == result.duplicated == result.stale == result.retrained == ()
    assert result.leaks == ()
    assert result.ok and result.steps > 0
    names = [row["name"] for row in result.metrics(result)]
    assert {"soak_faults_injected", "soak_samples_lost", "soak_samples_duplicated",
            "soak_prompts_retrained", "soak_recovery_s_p50", "soak_recovery_s_p99", "soak_steps_per_min"} <= set(names)  # fmt: skip
    rate = next(row for row in result.metrics(result) if row["name"] == "soak_steps_per_min")
    assert rate["ratio"] == 1.0

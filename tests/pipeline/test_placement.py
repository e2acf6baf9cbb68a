"""Placement by configuration: a role on a node started by hand and reached by address, a
separate Reward actor, several engines behind one rollout worker."""

from __future__ import annotations

from asyncflow_actors import testing as aft
from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny


async def test_a_role_runs_on_a_node_started_by_hand() -> None:
    """What SLURM / torchrun / Kubernetes deployments do: ``python -m asyncflow_actors.node``
    on a host, the trainer placed there by its address; refs travel both ways."""
    async with aft.open_node_process(allow=["asyncflow_actors"], name="far") as far:
        config = tiny(
            "async",
            placement={
                "default": "local",
                "roles": {"trainer": "far"},
                "nodes": {"far": far.address},
            },
        )
        result = await run_pipeline(config)
    assert result.samples == 3 * 16 and result.version == 3
    assert all(r.sync["sync_bytes"] > 0 for r in result.records)  # weights left that host


async def test_a_reward_actor_and_two_engines_behind_one_worker() -> None:
    config = tiny("one_step_off", rollout={"reward": "actor", "engines": 2, "max_batch": 8})
    result = await run_pipeline(config)
    assert result.samples == 3 * 16
    assert all(0.0 <= r.reward_mean <= 1.0 for r in result.records)

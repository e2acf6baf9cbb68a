"""What a run reports about its roles."""

from __future__ import annotations

from asyncflow_actors.actors import open_actor_system
from asyncflow_actors.observe import get_registry
from asyncflow_actors.pipeline import open_pipeline
from asyncflow_actors.pipeline._run import role_statistics

from .kit import tiny


async def test_every_role_reports_its_policy_version_or_none() -> None:
    """The roles that hold a policy report its version; the advantage, which holds none,
    reports none (not a 0 that reads like a stuck worker)."""
    async with open_actor_system() as system, open_pipeline(system, tiny("async")) as run:
        await run.wait()
        stats = {s.worker: s.version for s in await role_statistics(run.refs)}
    assert stats["advantage-0"] is None
    assert stats["driver-0"] == stats["trainer-0"] == 3
    assert stats["rollout-0"] in (2, 3) and stats["actor_fwd-0"] in (2, 3)
    series = get_registry().snapshot().select("afa_policy_version", worker="advantage-0")
    assert series == []

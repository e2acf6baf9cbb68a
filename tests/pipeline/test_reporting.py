"""What a run reports about its roles."""

from __future__ import annotations

import os
from typing import Any

import pytest

from asyncflow_actors.actors.remote import open_actor_system
from asyncflow_actors.observe import get_registry
from asyncflow_actors.pipeline import open_pipeline, run_pipeline
from asyncflow_actors.pipeline._report import HF_BARS
from asyncflow_actors.pipeline._steps import role_statistics

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


async def test_third_party_progress_bars_are_off_while_the_display_is_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hugging Face's loading bars would interleave with the step lines: they are off during
    a run with a display (node processes inherit the setting), and back on after it."""
    import transformers.utils.logging as hf_logging

    monkeypatch.delenv(HF_BARS, raising=False)
    hf_logging.enable_progress_bar()
    seen: list[tuple[str | None, bool]] = []

    def on_step(record: Any) -> None:
        seen.append((os.environ.get(HF_BARS), hf_logging.is_progress_bar_enabled()))

    await run_pipeline(tiny("sync", progress="plain", train={"steps": 1}), on_step=on_step)
    assert seen == [("1", False)]
    assert HF_BARS not in os.environ and hf_logging.is_progress_bar_enabled()

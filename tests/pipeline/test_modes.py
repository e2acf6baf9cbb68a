"""Short end-to-end runs in every mode, with the staleness promises checked per sample.

The Trainer checks every trained sample (trainer version - the version of its oldest token must
lie in [0, staleness], else the run fails with ``StalenessViolation``) and reports the lags it
saw; these tests read them back from the step records.
"""

from __future__ import annotations

from typing import Any

import pytest

from asyncflow_actors.pipeline import run_pipeline

from .kit import tiny

BATCH = 16  # 4 prompts x 4 samples


@pytest.mark.parametrize("mode", ["sync", "colocated", "one_step_off", "async"])
async def test_every_mode_trains_its_steps(mode: str) -> None:
    result = await run_pipeline(tiny(mode))
    assert [r.version for r in result.records] == [1, 2, 3]
    assert [r.samples for r in result.records] == [BATCH] * 3
    assert result.samples == 3 * BATCH and result.version == 3
    for record in result.records:
        assert sum(record.staleness) == BATCH
        assert 0.0 <= record.reward_mean <= 1.0
        assert "mismatch_kl_k1" in record.metrics and "pg_loss" in record.metrics
    if mode in ("sync", "colocated"):
        assert result.offpolicy_samples == 0
    if mode == "one_step_off":
        assert all(len(r.staleness) == 2 for r in result.records)


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_advantages_computed_in_actor_forward_train_as_well(mode: str) -> None:
    """``placement.roles.advantage = "actor_fwd"``: ActorForward computes the advantages, no
    Advantage station runs, and every step still trains a whole batch."""
    fused = await run_pipeline(tiny(mode, placement={"roles": {"advantage": "actor_fwd"}}))
    assert [r.samples for r in fused.records] == [BATCH] * 3
    assert not any("advantage" in r.idle for r in fused.records)
    assert all("actor_fwd" in r.idle for r in fused.records)


@pytest.mark.parametrize("mode", ["sync", "colocated", "async"])
async def test_forward_and_advantage_folded_into_the_trainer_train_as_well(mode: str) -> None:
    """``placement.roles.actor_fwd = advantage = "trainer"``: only rollout and the trainer run;
    the trainer's old log-probs are its policy's before the update, so its single update per
    batch has a PPO ratio of exactly 1, and at staleness 0 every sample is on-policy."""
    roles = {"actor_fwd": "trainer", "advantage": "trainer"}
    extra = {"staleness": 0} if mode == "async" else {}
    result = await run_pipeline(tiny(mode, placement={"roles": roles}, **extra))
    assert [r.samples for r in result.records] == [BATCH] * 3
    assert result.offpolicy_samples == 0
    assert all(set(r.idle) == {"rollout", "trainer"} for r in result.records)
    for record in result.records:
        assert record.metrics["ratio_mean"] == 1.0 and record.metrics["clip_frac"] == 0.0
        assert record.metrics["updates"] == 1.0


async def test_staleness_zero_is_on_policy_by_construction() -> None:
    """Async at staleness 0: every trained sample's oldest token has the trainer's version,
    although stations stream and rollout overlaps the forwards and the advantage."""
    result = await run_pipeline(tiny("async", staleness=0, train={"steps": 4}))
    assert result.offpolicy_samples == 0
    assert [r.staleness for r in result.records] == [(BATCH,)] * 4
    # the recomputed old log-probs differ from the engine's (a full forward against
    # incremental decoding): the mismatch metric measures something, and it is tiny
    for record in result.records:
        assert abs(record.metrics["mismatch_kl_k1"]) < 1e-3
        assert record.metrics["ess"] > 0.99


async def test_staleness_bound_holds_and_is_used() -> None:
    """Async at staleness 2: no trained sample is older than 2 versions, and rollout does run
    ahead (some trained samples are stale), which is the point of the window."""
    result = await run_pipeline(tiny("async", staleness=2, train={"steps": 5}))
    assert all(len(r.staleness) == 3 for r in result.records)
    assert result.offpolicy_samples > 0
    assert result.samples == 5 * BATCH


@pytest.mark.parametrize("stream", [False, True])
async def test_a_version_is_trained_only_after_the_sync_of_the_one_before(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The sync of version v overlaps the next step's fetch and its forward and backward (the
    first of a whole batch, or every piece of a streamed step), but that step's first optimizer
    step starts only after the sync of v returned (the weights it sends never change under
    it). Here each sync starts only once the next step stands ready to update: a trainer that
    did not wait would update during the sync."""
    import time

    import trio

    from asyncflow_actors.roles import _compute
    from asyncflow_actors.roles._trainer import Trainer

    syncs: dict[int, tuple[float, float]] = {}
    parts: list[tuple[str, float]] = []  # per step: "ready" (to update), then "update"
    sync, finish, updates = Trainer._sync, _compute.finish, _compute.Learner.updates
    accumulate, apply = _compute.Learner.accumulate, _compute.Learner.apply
    taken = [0]

    async def timed_sync(self: Trainer, version: int) -> Any:
        with trio.fail_after(30):  # the overlap: the next step's forward runs meanwhile
            while version < 5 and len(parts) < 2 * version + 1:
                await trio.sleep(0.001)
        await trio.sleep(0.05)  # time for a trainer that did not wait to update
        started = time.perf_counter()
        result = await sync(self, version)
        syncs[version] = (started, time.perf_counter())
        return result

    def timed_updates(self: Any, data: Any) -> Any:
        inner = updates(self, data)
        next(inner)
        parts.append(("ready", time.perf_counter()))  # forward and backward done
        yield
        return finish(inner)

    def timed_finish(steps: Any) -> Any:
        parts.append(("update", time.perf_counter()))
        return finish(steps)

    def timed_accumulate(self: Any, data: Any, *, first: bool) -> Any:
        piece = accumulate(self, data, first=first)
        taken[0] += len(data["response_ids"])
        if taken[0] == self.spec.batch_size:
            parts.append(("ready", time.perf_counter()))  # every piece's forward and backward
        return piece

    def timed_apply(self: Any, pieces: Any) -> Any:
        parts.append(("update", time.perf_counter()))
        taken[0] = 0
        return apply(self, pieces)

    monkeypatch.setattr(Trainer, "_sync", timed_sync)
    monkeypatch.setattr(_compute.Learner, "updates", timed_updates)
    monkeypatch.setattr(_compute, "finish", timed_finish)
    monkeypatch.setattr(_compute.Learner, "accumulate", timed_accumulate)
    monkeypatch.setattr(_compute.Learner, "apply", timed_apply)
    roles = {"actor_fwd": "trainer", "advantage": "trainer"}
    result = await run_pipeline(tiny("async", staleness=1, placement={"roles": roles},
                                     train={"steps": 5, "stream": stream}))  # fmt: skip
    assert [r.version for r in result.records] == [1, 2, 3, 4, 5]
    assert [r.metrics.get("pieces", 0) >= 1 for r in result.records] == [stream] * 5
    assert [kind for kind, _ in parts] == ["ready", "update"] * 5
    assert sorted(syncs) == [1, 2, 3, 4, 5]
    for version in range(1, 5):  # the step of version + 1 updates after the sync of version
        ready, update = parts[2 * version][1], parts[2 * version + 1][1]
        assert ready < syncs[version][0] and syncs[version][1] < update


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_trainer_starts_each_sync_without_waiting_for_the_driver(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The sync is on every step's critical path: the trainer starts it right after its
    optimizer step, and the Driver's ``SyncWeights`` for that version takes its report instead
    of syncing again. Here the Driver waits before it asks: a trainer that synced only when
    asked would start every sync after the ask. The last step's sync is the Driver's (the run
    ends with it)."""
    import time

    import trio

    from asyncflow_actors.roles._driver import Driver
    from asyncflow_actors.roles._messages import SyncWeights
    from asyncflow_actors.roles._trainer import Trainer

    started: list[tuple[int, float]] = []
    asked: dict[int, float] = {}
    sync, handle, step_done = Trainer._sync, Trainer.handle, Driver._step_done

    async def recorded_sync(self: Trainer, version: int | None) -> Any:
        started.append((version if version is not None else -1, time.perf_counter()))
        return await sync(self, version)

    async def recorded_handle(self: Trainer, msg: Any, ctx: Any) -> Any:
        if isinstance(msg, SyncWeights):
            asked[msg.version] = time.perf_counter()
        return await handle(self, msg, ctx)

    async def slow_step_done(self: Driver, msg: Any) -> Any:
        await trio.sleep(0.05)
        return await step_done(self, msg)

    monkeypatch.setattr(Trainer, "_sync", recorded_sync)
    monkeypatch.setattr(Trainer, "handle", recorded_handle)
    monkeypatch.setattr(Driver, "_step_done", slow_step_done)
    extra: dict[str, Any] = {"staleness": 1} if mode == "async" else {}
    result = await run_pipeline(tiny(mode, train={"steps": 4}, **extra))
    assert [r.version for r in result.records] == [1, 2, 3, 4]
    assert [version for version, _ in started] == [1, 2, 3, 4]  # one sync per version
    for version, at in started[:-1]:
        assert at < asked[version] - 0.04, f"the sync of {version} waited for the Driver"
    assert asked[4] < started[-1][1]

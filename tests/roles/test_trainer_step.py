"""The trainer's step in its compute threads: ``_prepare`` (staleness lags, advantages, the first
forward and backward) then ``_finish`` is ``Learner.step`` on the batch with its advantages, bit
for bit; a streamed step (pieces of whole groups, ``_accumulate`` each, then ``_finish``) takes
the same step up to float rounding, whatever the pieces; a sample outside the window fails the
step before the model is touched."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from asyncflow_actors.actors import ActorRef
from asyncflow_actors.roles import RunSpec
from asyncflow_actors.roles import _compute as C
from asyncflow_actors.roles import _schema as S
from asyncflow_actors.roles._advantage import Advantages
from asyncflow_actors.roles._settings import (
    AlgorithmSettings,
    ModelSettings,
    RolloutSettings,
    TrainSettings,
)
from asyncflow_actors.roles._trainer import StalenessViolation, Trainer, _Step

SPEC = RunSpec(
    mode="async",
    staleness=1,
    stage_barrier=False,
    colocated=False,
    trainer_forward=True,
    trainer_advantage=True,
    model=ModelSettings(d_model=32, n_layers=1, n_heads=2, max_seq_len=16),
    train=TrainSettings(lr=1e-2),
    algorithm=AlgorithmSettings(is_level="token"),
)


@attrs.frozen
class FakeBatch:
    """What the trainer reads of a TQ ``Batch``: columns, the lease's versions and groups."""

    data: dict[str, Any]
    versions: tuple[int, ...]
    group_ids: tuple[int, ...]
    shared: dict[str, Any] = attrs.field(factory=dict)  # group-shared columns: none apart

    def __len__(self) -> int:
        return len(self.versions)

    @property
    def indexes(self) -> tuple[int, ...]:
        return tuple(range(len(self.versions)))

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


def make_batch(version: int, *, oldest: int | None = None) -> FakeBatch:
    """Four groups of four samples at ``version``; ``oldest``: the version of sample 5's first
    token (and of the rest of its tokens when newer than ``version``: its oldest is ``oldest``)."""
    gen = torch.Generator().manual_seed(3)
    n = 16
    # groups 2 and 3 answer longer: pieces differ in tokens per sequence
    responses = [torch.randint(3, 12, (1 + k % 4 + 2 * (k // 8),), generator=gen) for k in range(n)]
    token_versions = [torch.full((len(r),), version, dtype=torch.int64) for r in responses]
    if oldest is not None:
        token_versions[5][0 if oldest < version else slice(None)] = oldest
    data = {
        S.PROMPT_IDS: [torch.tensor([1, 3 + k // 4, 4]) for k in range(n)],
        S.PROMPT_KEY: [torch.tensor([k // 4, 0, version]) for k in range(n)],
        S.RESPONSE_IDS: responses,
        S.BEHAVIOUR: [-1.0 - 0.1 * torch.rand(len(r), generator=gen) for r in responses],
        S.TOKEN_VERSIONS: token_versions,
        S.REWARDS: torch.tensor([float(k % 3 == 0) for k in range(n)]),
        S.RESUMES: torch.tensor([int(k == 2) for k in range(n)]),
    }
    return FakeBatch(data, (version,) * n, tuple(k // 4 for k in range(n)))


def make_trainer(spec: RunSpec) -> Trainer:
    ref: ActorRef[Any] = None  # type: ignore[assignment]  # no message is sent here
    trainer = Trainer(spec, ref, "trainer-test", ref)
    trainer.compute = C
    task = spec.task.build()
    trainer.learner = C.Learner(spec, task)
    trainer.advantages = Advantages(spec, C)
    return trainer


def test_prepare_then_finish_is_the_learners_step_bit_for_bit() -> None:
    trainer = make_trainer(SPEC)
    reference = C.Learner(SPEC, SPEC.task.build())
    for step in range(3):
        batch = make_batch(version=step)
        trainer.version = step + 1  # every sample one version old
        data = {name: batch[name] for name in S.station_columns(SPEC)["trainer"]}
        updates, lags, lengths = trainer._prepare(batch, data)
        metrics = trainer._finish(_Step(0, [batch], lags, lengths, updates=updates))

        expected_data = dict(batch.data)
        expected_data[S.ADVANTAGES] = C.padded_advantages(
            SPEC.algorithm, batch[S.REWARDS], batch.group_ids, lengths
        )
        expected = reference.step(expected_data)
        assert lags == [1] * len(batch)
        assert lengths == [int(r.shape[0]) for r in batch[S.RESPONSE_IDS]]
        for key, value in expected.items():
            assert metrics[key] == value, key
        assert metrics["reward_mean"] == float(batch[S.REWARDS].mean())
        assert metrics["accuracy"] == pytest.approx(6 / 16)
        assert metrics["response_length"] == sum(lengths) / 16
        assert metrics["partial_rollout_ratio"] == 1 / 16
        for a, b in zip(
            trainer.learner.model.parameters(), reference.model.parameters(), strict=True
        ):
            assert torch.equal(a, b)
    assert trainer._count_staleness([1] * 15 + [0]) == (1, 15)


@pytest.mark.parametrize("oldest", [0, 3])
def test_a_sample_outside_the_window_fails_before_any_forward(oldest: int) -> None:
    trainer = make_trainer(SPEC)
    trainer.version = 2  # window [1, 2]: a token of version 0 is two old, 3 is from the future
    batch = make_batch(version=2, oldest=oldest)
    before = {k: v.clone() for k, v in trainer.learner.model.state_dict().items()}
    with pytest.raises(StalenessViolation, match=f"version {oldest} reached the trainer"):
        trainer._prepare(batch, dict(batch.data))
    assert all(p.grad is None for p in trainer.learner.model.parameters())
    for name, value in trainer.learner.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def split(batch: FakeBatch, sizes: list[int]) -> list[FakeBatch]:
    """``batch`` as consecutive pieces of ``sizes`` groups (of four samples)."""
    pieces, at = [], 0
    for groups in sizes:
        rows = list(range(at, at + 4 * groups))
        data = {
            k: (v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows])
            for k, v in batch.data.items()
        }
        pieces.append(FakeBatch(data, tuple(batch.versions[i] for i in rows),
                                tuple(batch.group_ids[i] for i in rows)))  # fmt: skip
        at += 4 * groups
    return pieces


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("sizes", [[4], [1, 1, 1, 1], [3, 1], [1, 2, 1]])
def test_a_streamed_step_is_the_whole_batchs_step(agg: str, sizes: list[int]) -> None:
    """Same loss figures and the same (clipped) gradient; parameters are not compared, since
    Adam's first steps turn a rounding-level difference in a near-zero gradient into a
    difference of ``lr``."""
    spec = attrs.evolve(SPEC, algorithm=AlgorithmSettings(is_level="token", agg=agg))
    assert spec.streams_updates
    trainer, whole = make_trainer(spec), make_trainer(spec)
    names = S.station_columns(spec)["trainer"]
    for step in range(3):
        batch = make_batch(version=step)
        trainer.version = whole.version = step + 1
        trainer.learner.model.load_state_dict(whole.learner.model.state_dict())
        trainer.learner.optimizer.load_state_dict(whole.learner.optimizer.state_dict())
        updates, lags, lengths = whole._prepare(batch, {n: batch[n] for n in names})
        expected = whole._finish(_Step(0, [batch], lags, lengths, updates=updates))

        streamed = _Step(0, [], [], [])
        for piece in split(batch, sizes):
            data = {n: piece[n] for n in names}
            result, piece_lags, piece_lengths = trainer._accumulate(
                piece, data, not streamed.batches
            )
            streamed.batches.append(piece)
            streamed.pieces.append(result)
            streamed.lags += piece_lags
            streamed.lengths += piece_lengths
        metrics = trainer._finish(streamed)

        assert streamed.lags == lags and streamed.lengths == lengths
        assert metrics["pieces"] == len(sizes) and metrics["updates"] == 1
        for key in ("pg_loss", "clip_frac", "approx_kl", "grad_norm", "valid_tokens",
                    "reward_mean", "accuracy", "response_length", "partial_rollout_ratio"):  # fmt: skip
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        for a, b in zip(
            trainer.learner.model.parameters(), whole.learner.model.parameters(), strict=True
        ):
            assert a.grad is not None and b.grad is not None
            scale = float(b.grad.abs().max())
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6 * scale)


def test_a_piece_outside_the_window_fails_before_any_forward() -> None:
    trainer = make_trainer(SPEC)
    trainer.version = 2
    first, second = split(make_batch(version=2, oldest=0), [1, 3])
    trainer._accumulate(first, dict(first.data), True)
    grads = [p.grad.clone() for p in trainer.learner.model.parameters()]
    with pytest.raises(StalenessViolation, match="version 0 reached the trainer"):
        trainer._accumulate(second, dict(second.data), False)
    for p, g in zip(trainer.learner.model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)


def test_streaming_needs_one_update_a_batch_and_streaming_stages() -> None:
    assert SPEC.streams_updates
    assert not attrs.evolve(SPEC, stage_barrier=True).streams_updates
    assert not attrs.evolve(SPEC, colocated=True).streams_updates
    assert not attrs.evolve(SPEC, train=TrainSettings(mini_batches=2)).streams_updates
    assert not attrs.evolve(SPEC, train=TrainSettings(epochs=2)).streams_updates
    assert not attrs.evolve(SPEC, train=TrainSettings(stream=False)).streams_updates
    sum_norm = AlgorithmSettings(agg="seq-mean-token-sum-norm")
    assert not attrs.evolve(SPEC, algorithm=sum_norm).streams_updates


async def test_a_streamed_step_renews_the_leases_of_its_pieces_while_it_waits(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long tail may outlast the rollout topic's ``lease_ttl``: the pieces already taken (and
    in the gradient) are renewed every third of it until the last piece arrives, then no more."""
    import trio

    from asyncflow_actors.roles import _trainer

    async def inline(fn: Any, *args: Any) -> Any:
        return fn(*args)

    monkeypatch.setattr(_trainer, "in_thread", inline)
    monkeypatch.setattr(_trainer, "columns", lambda batch, name: batch[name])
    spec = attrs.evolve(SPEC, train=TrainSettings(lr=1e-2, prompts_per_step=4),
                        rollout=RolloutSettings(group_size=4))  # fmt: skip
    assert spec.batch_size == 16
    trainer = make_trainer(spec)
    trainer.version = 1
    first, rest = split(make_batch(version=0), [1, 3])
    renewed: list[tuple[float, Any]] = []

    class Client:
        async def renew(self, batch: Any) -> None:
            renewed.append((trio.current_time(), batch))

    arrivals = iter([(0.0, first), (900.0, rest)])

    counts: list[int] = []

    async def fetch(columns: Any, count: int, **options: Any) -> Any:
        delay, batch = next(arrivals)
        counts.append(count)
        await trio.sleep(delay)
        return batch

    trainer.columns = S.station_columns(spec)["trainer"]
    trainer.client = Client()  # type: ignore[assignment]
    monkeypatch.setattr(trainer, "fetch", fetch)
    start = trio.current_time()
    step = await trainer._pieces()
    ttl = S.topic_specs(spec)[1].lease_ttl
    assert ttl / 3 * 4 < 900 < ttl / 3 * 5
    assert [(t - start, b) for t, b in renewed] == [(ttl / 3 * k, first) for k in (1, 2, 3, 4)]
    assert step.batches == [first, rest] and len(step.pieces) == 2 and counts == [16, 12]
    await trio.sleep(ttl)
    assert len(renewed) == 4  # the step has all its pieces: nothing renews them any more

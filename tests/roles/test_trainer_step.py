"""The trainer's step in its compute threads: ``_prepare`` (staleness lags, advantages, the first
forward and backward) then ``_finish`` is ``Learner.step`` on the batch with its advantages, bit
for bit, and a sample outside the window fails the step before the model is touched."""

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
from asyncflow_actors.roles._settings import AlgorithmSettings, ModelSettings, TrainSettings
from asyncflow_actors.roles._trainer import StalenessViolation, Trainer

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

    def __len__(self) -> int:
        return len(self.versions)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


def make_batch(version: int, *, oldest: int | None = None) -> FakeBatch:
    """Four groups of four samples at ``version``; ``oldest``: the version of sample 5's first
    token (and of the rest of its tokens when newer than ``version``: its oldest is ``oldest``)."""
    gen = torch.Generator().manual_seed(3)
    n = 16
    responses = [torch.randint(3, 12, (1 + k % 4,), generator=gen) for k in range(n)]
    token_versions = [torch.full((len(r),), version, dtype=torch.int64) for r in responses]
    if oldest is not None:
        token_versions[5][0 if oldest < version else slice(None)] = oldest
    data = {
        S.PROMPT_IDS: [torch.tensor([1, 3 + k // 4, 4]) for k in range(n)],
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
        metrics = trainer._finish(updates, batch, lengths)

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

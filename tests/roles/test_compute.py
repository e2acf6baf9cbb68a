"""The stations' vectorized helpers agree with their per-row definitions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_actors.roles._compute import group_advantages, right_pad
from asyncflow_actors.roles._settings import AlgorithmSettings


@given(lengths=st.lists(st.integers(0, 6), max_size=9), width=st.integers(0, 8))
def test_right_pad_puts_each_row_left_aligned_in_zeros(lengths: list[int], width: int) -> None:
    rows = [torch.arange(1, n + 1, dtype=torch.int64) * (k + 1) for k, n in enumerate(lengths)]
    out = right_pad(rows, width)
    assert out.shape == (len(rows), width) and out.dtype == torch.float32
    for k, row in enumerate(rows):
        keep = min(width, len(row))
        assert torch.equal(out[k, :keep], row[:keep].float())
        assert not out[k, keep:].any()


def test_group_advantages_are_one_value_per_sequence_over_its_tokens() -> None:
    out = group_advantages(AlgorithmSettings(), torch.tensor([1.0, 0.0, 1.0, 1.0]),
                           [0, 0, 1, 1], [2, 1, 3, 0])  # fmt: skip
    assert [t.shape[0] for t in out] == [2, 1, 3, 0]
    assert out[0][0] > 0 > out[1][0] and torch.all(out[0] == out[0][0])
    assert not out[2].any()  # equal rewards in a group: no advantage


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_the_trainer_computing_old_logprobs_updates_as_an_actor_forward_would(
    mini_batches: int,
) -> None:
    """``trainer_forward``: the old log-probs are the trainer's policy before the batch's first
    update (the update's own forward, detached, or one no-grad forward first with several
    updates): the same update as with old log-probs recomputed by an ActorForward station on
    the same weights."""
    import attrs

    from asyncflow_actors.roles._compute import Learner, sequence_logprobs
    from asyncflow_actors.roles._settings import RunSpec, TrainSettings

    base = RunSpec(mode="async", staleness=1, stage_barrier=False, colocated=False,
                   train=TrainSettings(mini_batches=mini_batches, lr=1e-2))  # fmt: skip
    task = base.task.build()
    learners = [Learner(base, task), Learner(attrs.evolve(base, trainer_forward=True), task)]
    torch.manual_seed(0)
    prompts = [torch.tensor([1, 3 + k % 5, 4]) for k in range(8)]
    responses = [torch.randint(3, 12, (1 + k % 4,)) for k in range(8)]
    old = sequence_logprobs(learners[0].model, prompts, responses, pad_id=0, temperature=1.0)
    data = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "behaviour_logprobs": [o + 0.01 for o in old],
        "advantages": [torch.full((len(r),), 1.0 - 2 * (k % 2)) for k, r in enumerate(responses)],
    }
    metrics = [learners[0].step({**data, "old_logprobs": old}), learners[1].step(data)]
    assert metrics[0]["updates"] == metrics[1]["updates"] == mini_batches
    assert metrics[0]["pg_loss"] == pytest.approx(metrics[1]["pg_loss"], abs=1e-6)
    for a, b in zip(learners[0].model.parameters(), learners[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert (metrics[1]["approx_kl"] > 0) == (mini_batches > 1)  # the second update moved away


def test_a_step_in_two_parts_changes_nothing_before_its_yield(tmp_path: Any) -> None:
    """``Learner.updates`` yields after its first forward and backward, before any optimizer
    step: until resumed, the weights, the optimizer state and the RNG states a checkpoint saves
    are those of the last finished step (the trainer syncs and saves meanwhile); resumed, it
    ends exactly as ``step`` does."""
    import attrs

    from asyncflow_actors.models import load_safetensors
    from asyncflow_actors.roles._compute import OPTIMIZER_FILE, Learner, finish
    from asyncflow_actors.roles._settings import RunSpec, TrainSettings

    spec = RunSpec(mode="async", staleness=1, stage_barrier=False, colocated=False,
                   trainer_forward=True, train=TrainSettings(mini_batches=2, lr=1e-2))  # fmt: skip
    task = spec.task.build()
    torch.manual_seed(0)
    prompts = [torch.tensor([1, 3 + k % 5, 4]) for k in range(8)]
    responses = [torch.randint(3, 12, (1 + k % 4,)) for k in range(8)]
    data = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "behaviour_logprobs": [torch.full((len(r),), -1.0) for r in responses],
        "advantages": [torch.full((len(r),), 1.0 - 2 * (k % 2)) for k, r in enumerate(responses)],
    }
    whole, split = Learner(spec, task), Learner(attrs.evolve(spec), task)
    whole.step(data)
    split.step(data)  # both one step in, then the second step in two parts
    expected = whole.step(data)
    split.save(str(tmp_path / "before"), {})
    weights = {k: v.clone() for k, v in split.model.state_dict().items()}
    updates = split.updates(data)
    next(updates)
    for name, value in split.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert all(p.grad is not None for p in split.model.parameters())
    split.save(str(tmp_path / "during"), {})
    saved = [load_safetensors(str(tmp_path / d / OPTIMIZER_FILE)).tensors
             for d in ("before", "during")]  # fmt: skip
    assert saved[0].keys() == saved[1].keys()
    for name in saved[0]:
        assert torch.equal(saved[0][name], saved[1][name]), name
    assert finish(updates) == expected
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.equal(a, b)

"""The stations' vectorized helpers agree with their per-row definitions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_actors.models import BatchLayoutError, pack_batch
from asyncflow_actors.roles._compute import (
    MiniBatches,
    group_advantages,
    oldest_versions,
    padded_advantages,
    right_pad,
)
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


rows_of = st.lists(st.integers(0, 5), min_size=1, max_size=10)


@given(
    prompt_lengths=rows_of.map(lambda ls: [n + 1 for n in ls]),
    response_lengths=rows_of,
    picks=st.lists(st.integers(0, 9), min_size=1, max_size=10, unique=True),
)
def test_mini_batches_are_the_tensors_pack_batch_and_right_pad_build(
    prompt_lengths: list[int], response_lengths: list[int], picks: list[int]
) -> None:
    """Padding a global batch once and indexing it gives each mini-batch exactly what packing
    its rows does (values, dtypes, shapes, contiguity): the update is bit for bit the same."""
    n = min(len(prompt_lengths), len(response_lengths))
    prompts = [torch.arange(2, 2 + p) for p in prompt_lengths[:n]]
    responses = [torch.arange(3, 3 + r) * (k + 1) for k, r in enumerate(response_lengths[:n])]
    logprobs = [-torch.arange(1, r + 1, dtype=torch.float32) / (k + 1) for k, r in
                enumerate(response_lengths[:n])]  # fmt: skip
    lengths = [int(r.shape[0]) for r in responses]
    advantages = padded_advantages(AlgorithmSettings(), torch.arange(n).float() % 2,
                                   [k // 3 for k in range(n)], lengths)  # fmt: skip
    data = {"prompt_ids": prompts, "response_ids": responses, "logp": logprobs,
            "advantages": advantages}  # fmt: skip
    rows = [k for k in picks if k < n] or [0]
    whole = MiniBatches(data, ["logp", "advantages"], pad_id=0)
    got = whole.batch(torch.tensor(rows))
    want = pack_batch([prompts[k].tolist() for k in rows], [responses[k].tolist() for k in rows],
                      pad_id=0)  # fmt: skip
    for name in ("input_ids", "attention_mask", "response_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b) and a.is_contiguous(), name
    width = want.response_length
    column = whole.column("logp", torch.tensor(rows), width)
    assert torch.equal(column, right_pad([logprobs[k] for k in rows], width))
    expected = right_pad([advantages.rows()[k] for k in rows], width)
    assert torch.equal(whole.column("advantages", torch.tensor(rows), width), expected)


def test_mini_batches_refuse_what_pack_batch_refuses() -> None:
    with pytest.raises(BatchLayoutError, match="prompt 1 is empty"):
        MiniBatches({"prompt_ids": [torch.tensor([1]), torch.tensor([], dtype=torch.long)],
                     "response_ids": [torch.tensor([2]), torch.tensor([3])]}, [], pad_id=0)  # fmt: skip
    with pytest.raises(BatchLayoutError, match="2 prompts and 1 responses"):
        MiniBatches({"prompt_ids": [torch.tensor([1])] * 2, "response_ids": [torch.tensor([2])]},
                    [], pad_id=0)  # fmt: skip


@given(st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=4), st.integers(0, 9)),
                max_size=12))  # fmt: skip
def test_oldest_versions_is_each_rows_minimum_or_its_stored_version(
    samples: list[tuple[list[int], int]],
) -> None:
    rows = [torch.tensor(tokens, dtype=torch.long) for tokens, _ in samples]
    stored = [version for _, version in samples]
    expected = [min(tokens) if tokens else version for tokens, version in samples]
    assert oldest_versions(rows, stored) == expected


def test_padded_advantages_hold_the_rows_in_positive_zeros() -> None:
    lengths = [2, 1, 3, 0]
    padded = padded_advantages(AlgorithmSettings(), torch.tensor([1.0, 0.0, 1.0, 1.0]),
                               [0, 0, 1, 1], lengths)  # fmt: skip
    rows = group_advantages(AlgorithmSettings(), torch.tensor([1.0, 0.0, 1.0, 1.0]),
                            [0, 0, 1, 1], lengths)  # fmt: skip
    assert padded.lengths.tolist() == lengths and len(padded) == 4
    for k, row in enumerate(rows):
        assert torch.equal(padded.values[k, : lengths[k]], row)
        tail = padded.values[k, lengths[k] :]
        assert not tail.any() and not torch.signbit(tail).any()  # +0.0, as right_pad pads


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
    from asyncflow_actors.roles._settings import AlgorithmSettings, RunSpec, TrainSettings

    # the ratio against the old log-probs (the default at staleness 1 takes the engine's)
    base = RunSpec(mode="async", staleness=1, stage_barrier=False, colocated=False,
                   algorithm=AlgorithmSettings(anchor="proximal"),
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


def test_an_entropy_bonus_trains_and_raises_the_policys_entropy() -> None:
    """``entropy_coef > 0``: the trainer computes each token's entropy in its forward (it raised
    ``RLInputError: ... needs entropy`` on every step), reports it, and with zero advantages the
    bonus alone moves the policy towards higher entropy."""
    import attrs

    from asyncflow_actors.roles._compute import Learner, policy_token_logprobs
    from asyncflow_actors.roles._settings import AlgorithmSettings, RunSpec, TrainSettings

    base = RunSpec(mode="async", staleness=1, stage_barrier=False, colocated=False,
                   trainer_forward=True, train=TrainSettings(lr=1e-2, weight_decay=0.0))  # fmt: skip
    spec = attrs.evolve(base, algorithm=AlgorithmSettings(entropy_coef=0.5))
    task = spec.task.build()
    torch.manual_seed(0)
    learner, plain = Learner(spec, task), Learner(base, task)
    plain.model.load_state_dict(learner.model.state_dict())
    prompts = [torch.tensor([1, 3 + k % 5, 4]) for k in range(8)]
    responses = [torch.randint(3, 12, (1 + k % 4,)) for k in range(8)]
    data = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "behaviour_logprobs": [torch.full((len(r),), -1.0) for r in responses],
        "advantages": [torch.zeros(len(r)) for r in responses],
    }
    batch = MiniBatches(data, ["advantages"], 0).batch(torch.arange(8))

    def mean_entropy(model: Any) -> float:
        with torch.no_grad():
            out = policy_token_logprobs(model, batch, 1.0, with_entropy=True)
        assert out.entropy is not None
        return float(out.entropy[batch.response_mask].mean())

    before = mean_entropy(learner.model)
    for _ in range(5):
        last = mean_entropy(learner.model)
        metrics = learner.step(data)
        plain_metrics = plain.step(data)
    assert metrics["entropy"] == pytest.approx(last, rel=1e-5)  # the step's own forward
    assert "entropy" not in plain_metrics  # computed only where the loss needs it
    assert mean_entropy(learner.model) > before + 1e-3
    assert mean_entropy(plain.model) == pytest.approx(before, abs=1e-6)  # no advantage, no bonus


def test_the_anchor_resolves_by_staleness_and_importance_weights() -> None:
    """``anchor = "auto"``: the engine's log-probs (behaviour) when the run trains stale
    samples without importance weights; the proximal policy at staleness 0 (unchanged) and
    when ``is_level`` asks for decoupled PPO's weights. ``"behaviour"`` with weights is refused."""
    from asyncflow_actors.roles._compute import loss_config
    from asyncflow_actors.roles._settings import SettingsError

    auto = AlgorithmSettings()
    assert auto.anchor == "auto"
    assert loss_config(auto, 0).anchor == "proximal"
    assert loss_config(auto, 1).anchor == "behaviour"
    assert loss_config(auto, 2).correction is None
    weighted = AlgorithmSettings(is_level="token")
    assert loss_config(weighted, 1).anchor == "proximal"
    assert loss_config(AlgorithmSettings(anchor="proximal"), 1).anchor == "proximal"
    assert loss_config(AlgorithmSettings(anchor="behaviour"), 0).anchor == "behaviour"
    with pytest.raises(SettingsError, match="needs is_level = 'none'"):
        AlgorithmSettings(anchor="behaviour", is_level="sequence")


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_stale_batch_does_not_push_tokens_the_policy_already_moved(staleness: int) -> None:
    """At staleness 1 the trainer's default loss takes PPO's ratio against the engine's
    log-probs: tokens the trainer's policy already makes e^0.5 = 1.65x as likely as the
    sampler did, with positive advantages, are all clipped and the step leaves the weights as
    they were. Before (the ratio against the trainer's own forward: 1) it pushed them further.
    At staleness 0 the ratio stays the trainer's own (1) and the step moves the weights."""
    from asyncflow_actors.roles._compute import Learner, sequence_logprobs
    from asyncflow_actors.roles._settings import RunSpec, TrainSettings

    spec = RunSpec(mode="async", staleness=staleness, stage_barrier=False, colocated=False,
                   trainer_forward=True, train=TrainSettings(lr=1e-2, weight_decay=0.0))  # fmt: skip
    learner = Learner(spec, spec.task.build())
    torch.manual_seed(0)
    prompts = [torch.tensor([1, 3 + k % 5, 4]) for k in range(8)]
    responses = [torch.randint(3, 12, (1 + k % 4,)) for k in range(8)]
    current = sequence_logprobs(learner.model, prompts, responses, pad_id=0, temperature=1.0)
    data = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "behaviour_logprobs": [c - 0.5 for c in current],
        "advantages": [torch.ones(len(r)) for r in responses],
    }
    before = [p.detach().clone() for p in learner.model.parameters()]
    metrics = learner.step(data)
    moved = any(
        not torch.equal(a, b) for a, b in zip(before, learner.model.parameters(), strict=True)
    )
    assert metrics["clip_frac"] == (1.0 if staleness else 0.0)
    assert moved == (staleness == 0)


def test_hf_logprobs_without_the_cache_and_the_prompt_logits_are_the_full_forward_s() -> None:
    # ``hf_logprobs`` asks a Hugging Face model for no KV cache and for the logits of the
    # response positions only; the log-probs (and entropies) are those of a plain forward.
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncflow_actors.roles._hf_policy import hf_logprobs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=13, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    batch = pack_batch([[1, 5, 6], [1, 7], [1, 2, 3, 4]], [[8, 9], [10], [11, 12]], pad_id=0)
    ids, mask = batch.input_ids, batch.attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    width = batch.response_length
    logp = torch.log_softmax(full[:, -width - 1 : -1].float() / 0.7, dim=-1)
    want = logp.gather(-1, ids[:, -width:, None]).squeeze(-1)
    got = hf_logprobs(model, batch, 0.7, with_entropy=True)
    torch.testing.assert_close(got.logprobs, want, rtol=0, atol=1e-6)
    assert got.entropy is not None
    torch.testing.assert_close(got.entropy, -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-6)

"""A forward station on 2 ranks (FSDP2 on gloo, forward only) computes the log-probs one
process computes on the same batch, before and after a weight load, and fails naming a rank
that died. One group serves the module's first tests (a group costs a process start)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncflow_actors.roles import RankFailed
from asyncflow_actors.roles._compute import build_policy, sequence_logprobs
from asyncflow_actors.roles._forward_ranks import ForwardGroup

from .conftest import global_batch, run_spec

SPEC = run_spec(forward_ranks=2, collective_timeout=60)


@pytest.fixture(scope="module")
def group() -> Iterator[ForwardGroup]:
    with ForwardGroup.open(SPEC) as forward:
        yield forward


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def one_process(model: Any, rows: dict[str, Any], pad_id: int) -> list[torch.Tensor]:
    return sequence_logprobs(
        model, rows["prompt_ids"], rows["response_ids"], pad_id=pad_id, temperature=1.0
    )


@pytest.mark.parametrize("n", [8, 3, 1])  # 1 row: rank 1 runs a void forward
def test_two_ranks_give_the_log_probs_of_one_process(group: ForwardGroup, n: int) -> None:
    rows = global_batch(n)
    model, tokenizer = build_policy(SPEC.model, SPEC.task.build())
    expected = one_process(model, rows, tokenizer.pad_id)
    got = group.logprobs(
        rows["prompt_ids"], rows["response_ids"], pad_id=tokenizer.pad_id, temperature=1.0
    )
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert relative(g, e) <= 1e-5


def test_loaded_weights_give_the_log_probs_of_the_loaded_model(group: ForwardGroup) -> None:
    """Full tensors in, each rank keeps its shard: the log-probs of the new weights; a
    partial load (one tensor) changes only that one."""
    model, tokenizer = build_policy(SPEC.model, SPEC.task.build())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    group.load(state)
    rows = global_batch(8, seed=3)
    expected = one_process(model, rows, tokenizer.pad_id)
    got = group.logprobs(
        rows["prompt_ids"], rows["response_ids"], pad_id=tokenizer.pad_id, temperature=1.0
    )
    for a, e in zip(got, expected, strict=True):
        assert relative(a, e) <= 1e-5
    name = next(iter(state))
    with torch.no_grad():
        model.state_dict()[name].mul_(0.5)
    group.load({name: model.state_dict()[name].clone()})
    expected = one_process(model, rows, tokenizer.pad_id)
    got = group.logprobs(
        rows["prompt_ids"], rows["response_ids"], pad_id=tokenizer.pad_id, temperature=1.0
    )
    for a, e in zip(got, expected, strict=True):
        assert relative(a, e) <= 1e-5


def test_a_rank_killed_in_a_forward_fails_it_naming_the_rank(group: ForwardGroup) -> None:
    group.close()  # this process holds one group at a time
    rows = global_batch(4)
    env = {"AFA_RANK_KILL_IN_FORWARD": "1"}  # rank 1 SIGKILLs itself in its first forward
    forward = ForwardGroup.open(SPEC, env=env)
    with pytest.raises(RankFailed) as failure:
        forward.logprobs(rows["prompt_ids"], rows["response_ids"], pad_id=0, temperature=1.0)
    assert failure.value.rank == 1
    assert forward.group.closed
    forward.close()

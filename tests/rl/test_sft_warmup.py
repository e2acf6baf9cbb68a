from __future__ import annotations

import random

import attrs
import pytest
import torch

from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.rl import Problem, RLInputError, TaskError, position_match_score, sft_warmup


@attrs.frozen
class CopyFirstTask:
    """Answer: the first character of the prompt (learnable in a few dozen steps)."""

    random_answers: bool = False
    name: str = "copy-first"
    alphabet: str = "abcdef="

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            text = "".join(rng.choice("abcdef") for _ in range(4))
            answer = rng.choice("abcdef") if self.random_answers else text[0]
            out.append(Problem(prompt=text + "=", answer=answer))
        return out

    def score(self, problem: Problem, response: str) -> float:
        return position_match_score(problem.answer, response, partial_credit=0.0)


def _model(tok: CharTokenizer) -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(TinyConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2, max_seq_len=16))


def test_sft_stops_at_the_target() -> None:
    task = CopyFirstTask()
    tok = CharTokenizer(task.alphabet)
    model = _model(tok)
    result = sft_warmup(
        model,
        task,
        tok,
        target_accuracy=0.9,
        max_steps=400,
        batch_size=32,
        eval_every=10,
        eval_size=64,
        lr=1e-2,
    )
    assert result.reached_target
    assert result.accuracy >= 0.9
    assert 0 < result.steps < 400
    assert result.steps % 10 == 0
    steps = [s for s, _ in result.history]
    assert steps == list(range(0, result.steps + 1, 10))
    # It stopped at the first evaluation that met the target, not later.
    assert all(acc < 0.9 for _, acc in result.history[:-1])
    assert result.history[-1] == (result.steps, result.accuracy)


def test_sft_reports_a_missed_target_after_max_steps() -> None:
    task = CopyFirstTask(random_answers=True)  # unlearnable: answers are noise
    tok = CharTokenizer(task.alphabet)
    result = sft_warmup(
        _model(tok),
        task,
        tok,
        target_accuracy=0.95,
        max_steps=15,
        batch_size=16,
        eval_every=10,
        eval_size=32,
    )
    assert not result.reached_target
    assert result.steps == 15
    assert [s for s, _ in result.history] == [0, 10, 15]


def test_sft_argument_and_task_errors() -> None:
    task = CopyFirstTask()
    tok = CharTokenizer(task.alphabet)
    with pytest.raises(RLInputError, match="target_accuracy"):
        sft_warmup(_model(tok), task, tok, target_accuracy=0.0, max_steps=1)
    with pytest.raises(RLInputError, match="max_steps"):
        sft_warmup(_model(tok), task, tok, target_accuracy=0.5, max_steps=0)

    @attrs.frozen
    class OneProblem(CopyFirstTask):
        def sample(self, n: int, seed: int) -> list[Problem]:
            return [Problem(prompt="a=", answer="a")] * n

    with pytest.raises(TaskError, match="too few distinct problems"):
        sft_warmup(_model(tok), OneProblem(), tok, target_accuracy=1.0, max_steps=5)

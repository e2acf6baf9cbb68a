from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from asyncflow_actors.models import CharTokenizer
from asyncflow_actors.rl import (
    AdditionTask,
    FileTask,
    LongTailTask,
    Problem,
    Task,
    TaskError,
    load_jsonl_task,
    load_parquet_task,
    position_match_score,
    score_responses,
)


def test_addition_problems_are_deterministic_and_reversed() -> None:
    task = AdditionTask(min_digits=2, max_digits=3)
    problems = task.sample(50, seed=7)
    assert problems == task.sample(50, seed=7)
    assert problems != task.sample(50, seed=8)
    for p in problems:
        a, b = p.metadata["a"], p.metadata["b"]
        assert isinstance(a, int) and isinstance(b, int)
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert p.prompt == f"{a}+{b}="
        assert p.answer == str(a + b)[::-1]
    tok = CharTokenizer(task.alphabet)
    assert all(tok.decode(tok.encode(p.prompt + p.answer)) == p.prompt + p.answer for p in problems)
    assert isinstance(task, Task)


def test_addition_reward_exact_partial_and_wrong_length() -> None:
    task = AdditionTask()
    p = Problem(prompt="57+68=", answer="521")
    assert task.score(p, "521") == 1.0
    assert task.score(p, " 521 ") == 1.0
    assert task.score(p, "581") == pytest.approx(0.5 * 2 / 3)
    assert task.score(p, "000") == 0.0
    assert task.score(p, "52") == 0.0
    assert task.score(p, "5210") == 0.0
    assert position_match_score("ab", "ax", partial_credit=0.8) == pytest.approx(0.4)


def test_long_tail_lengths_are_heavy_tailed_and_bounded() -> None:
    task = LongTailTask(distribution="pareto", min_length=2, max_length=64, shape=1.2)
    lengths = task.sample_lengths(4000, seed=0)
    assert min(lengths) >= 2 and max(lengths) == 64
    assert statistics.median(lengths) <= 4  # Pareto(1.2) median = 2 * 2^(1/1.2) = 3.6
    assert statistics.mean(lengths) > 1.5 * statistics.median(lengths)  # long tail
    assert sum(n == 64 for n in lengths) > 0.01 * len(lengths)  # clipped tail piles at max
    logn = LongTailTask(distribution="lognormal", median=6.0, sigma=1.0, max_length=40)
    lengths = logn.sample_lengths(4000, seed=1)
    assert 5 <= statistics.median(lengths) <= 7
    assert max(lengths) == 40


def test_long_tail_problems_reverse_and_sort() -> None:
    rev = LongTailTask(op="reverse").sample(20, seed=3)
    for p in rev:
        text = p.prompt[2:-1]
        assert p.prompt.startswith("r:") and p.answer == text[::-1]
        assert len(text) == p.metadata["length"]
    srt = LongTailTask(op="sort").sample(20, seed=3)
    assert all(p.answer == "".join(sorted(p.prompt[2:-1])) for p in srt)
    assert LongTailTask().sample_lengths(20, seed=3) == [p.metadata["length"] for p in rev]
    tok = CharTokenizer(LongTailTask().alphabet)
    tok.encode(rev[0].prompt + rev[0].answer)
    with pytest.raises(TaskError, match="symbols"):
        LongTailTask(symbols="ab=")


def test_score_responses_checks_reward_range() -> None:
    task = AdditionTask()
    problems = task.sample(2, seed=0)
    rewards = score_responses(task, problems, [problems[0].answer, "x"])
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [1.0, 0.0]

    bad = FileTask(problems=tuple(problems), scorer=lambda p, r: 2.0)
    with pytest.raises(
        TaskError, match=r"scored response 0 .* as 2.0; expected a float in \[0, 1\]"
    ):
        score_responses(bad, problems, ["a", "b"])
    with pytest.raises(TaskError, match="2 problems and 1 responses"):
        score_responses(task, problems, ["a"])


def test_jsonl_task(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    records = [
        {"prompt": "1+1=", "answer": "2", "source": "x"},
        {"prompt": "2+2=", "answer": 4},
        {"prompt": "3+3=", "answer": "6"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    task = load_jsonl_task(path)
    assert task.name == "data.jsonl"
    assert [p.answer for p in task.problems] == ["2", "4", "6"]
    assert task.problems[0].metadata == {"source": "x"}
    drawn = task.sample(3, seed=1)
    assert sorted(p.prompt for p in drawn) == ["1+1=", "2+2=", "3+3="]  # no repeats
    assert len(task.sample(7, seed=1)) == 7
    assert task.score(task.problems[1], " 4\n") == 1.0
    assert task.score(task.problems[1], "5") == 0.0
    assert task.alphabet == "+12346="


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n\n{"question": "c", "answer": "d"}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:3: 'prompt' must be a string"):
        load_jsonl_task(path)
    path.write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:2: invalid JSON"):
        load_jsonl_task(path)
    custom = tmp_path / "custom.jsonl"
    custom.write_text('{"q": "a", "a": "b"}\n')
    assert load_jsonl_task(custom, prompt_key="q", answer_key="a").problems[0].answer == "b"


def test_parquet_task(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["1+2="], "answer": ["3"]}), str(path))
    task = load_parquet_task(path)
    assert task.problems[0] == Problem(prompt="1+2=", answer="3")


def test_task_validation() -> None:
    with pytest.raises(TaskError, match="max_digits"):
        AdditionTask(min_digits=3, max_digits=2)
    with pytest.raises(TaskError, match="no problems"):
        FileTask(problems=())
    with pytest.raises(TaskError, match="n must be"):
        AdditionTask().sample(-1, seed=0)

"""`FileTask`: prompts and answers from user data (jsonl, or parquet when pyarrow is present)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable, Mapping

import attrs

from ._errors import TaskError
from ._tasks import Problem

__all__ = ["FileTask", "exact_match_score", "load_jsonl_task", "load_parquet_task"]

Scorer = Callable[[Problem, str], float]


def exact_match_score(problem: Problem, response: str) -> float:
    """1.0 when the response equals the answer (surrounding whitespace ignored), else 0.0."""
    return 1.0 if response.strip() == problem.answer.strip() else 0.0


def _problem(record: object, where: str, prompt_key: str, answer_key: str) -> Problem:
    if not isinstance(record, Mapping):
        raise TaskError(f"{where}: expected an object, got {type(record).__name__}")
    prompt = record.get(prompt_key)
    answer = record.get(answer_key)
    if not isinstance(prompt, str):
        raise TaskError(
            f"{where}: {prompt_key!r} must be a string, got {prompt!r} (keys: {sorted(record)})"
        )
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TaskError(
            f"{where}: {answer_key!r} must be a string or number, got {answer!r} "
            f"(keys: {sorted(record)})"
        )
    metadata = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    return Problem(prompt=prompt, answer=str(answer), metadata=metadata)


@attrs.frozen
class FileTask:
    """A fixed list of problems. `sample(n, seed)` draws without replacement while it can
    (reshuffling for each further pass); `score` uses `scorer` (default: exact match)."""

    problems: tuple[Problem, ...]
    name: str = "file"
    scorer: Scorer = exact_match_score

    def __attrs_post_init__(self) -> None:
        if not self.problems:
            raise TaskError(f"task {self.name!r} has no problems; expected at least one")

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, object]],
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        name: str = "file",
        scorer: Scorer = exact_match_score,
    ) -> FileTask:
        """Problems from mappings with a string `prompt_key` and a `answer_key` (str or number);
        the other keys become metadata. Raises `TaskError` naming the bad record."""
        problems = [
            _problem(record, f"record {i}", prompt_key, answer_key)
            for i, record in enumerate(records)
        ]
        return cls(problems=tuple(problems), name=name, scorer=scorer)

    @property
    def alphabet(self) -> str:
        chars: set[str] = set()
        for problem in self.problems:
            chars.update(problem.prompt)
            chars.update(problem.answer)
        return "".join(sorted(chars))

    def sample(self, n: int, seed: int) -> list[Problem]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TaskError(f"n must be an int >= 0, got {n!r}")
        rng = random.Random(seed)
        out: list[Problem] = []
        while len(out) < n:
            order = list(range(len(self.problems)))
            rng.shuffle(order)
            out.extend(self.problems[i] for i in order[: n - len(out)])
        return out

    def score(self, problem: Problem, response: str) -> float:
        return float(self.scorer(problem, response))


def load_jsonl_task(
    path: str | os.PathLike[str],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    name: str | None = None,
    scorer: Scorer = exact_match_score,
) -> FileTask:
    """A `FileTask` from a jsonl file (one JSON object per line; blank lines skipped).
    Raises `TaskError` naming the file and line of a malformed record."""
    where = os.fspath(path)
    problems: list[Problem] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{where}:{lineno}: invalid JSON: {exc}") from exc
            problems.append(_problem(record, f"{where}:{lineno}", prompt_key, answer_key))
    return FileTask(problems=tuple(problems), name=name or os.path.basename(where), scorer=scorer)


def load_parquet_task(
    path: str | os.PathLike[str],
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    name: str | None = None,
    scorer: Scorer = exact_match_score,
) -> FileTask:
    """A `FileTask` from a parquet file; needs `pyarrow` (imported here, lazily)."""
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise ModuleNotFoundError(
            "load_parquet_task needs pyarrow; install it (pip install pyarrow) or use jsonl"
        ) from exc
    where = os.fspath(path)
    rows = pq.read_table(where).to_pylist()
    problems = [
        _problem(row, f"{where} row {i}", prompt_key, answer_key) for i, row in enumerate(rows)
    ]
    return FileTask(problems=tuple(problems), name=name or os.path.basename(where), scorer=scorer)

"""A user's dataset as the prompts of a run: read, columns mapped, prompts rendered (chat
template), checked for length once, shuffled per epoch.

Reading: jsonl by hand (no dependency), parquet and ``save_to_disk`` folders through Hugging
Face ``datasets`` (the ``datasets`` extra; parquet falls back to ``pyarrow``). Every process of
a run may read the records (the built-in model's tokenizer is made of their characters); only
the Driver renders and checks them (``DatasetTask.prepare``), and sends each prompt's record
with it, so the reward functions see every column wherever they run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..rl import Problem, TaskError
from ._settings import DatasetSettings

__all__ = ["DatasetTask", "PreparedPrompts", "read_records", "render_prompt"]

log = logging.getLogger("asyncflow_actors.tasks")

PROMPT = "prompt"
ANSWER = "answer"

# The last dataset read in this process, by settings and file identity: the preflight, the
# Driver and the stations of one process build the task each, and would read it each time.
_last_read: tuple[tuple[Any, ...], tuple[dict[str, Any], ...]] | None = None
_read_lock = threading.Lock()


def read_records(settings: DatasetSettings, path: str | None = None) -> list[dict[str, Any]]:
    """The records of ``path`` (default ``settings.path``) with the columns renamed (see
    ``DatasetSettings``). Raises ``TaskError`` naming the file and the record at fault."""
    where = path if path is not None else settings.path
    if not where:
        raise TaskError("task.dataset.path: a dataset task needs a path")
    if not os.path.exists(where):
        raise TaskError(f"{where}: no such file or folder")
    fmt = settings.format if path is None or settings.format != "auto" else "auto"
    if fmt == "auto":
        fmt = _guess_format(where)
    if fmt == "jsonl":
        raw = _read_jsonl(where)
    elif fmt == "parquet":
        raw = _read_parquet(where)
    else:
        raw = _read_hf(where, settings.split)
    return [_mapped(record, settings, f"{where} record {i}") for i, record in enumerate(raw)]


def _guess_format(where: str) -> str:
    if os.path.isdir(where):
        return "hf"
    if where.endswith(".parquet"):
        return "parquet"
    if where.endswith((".jsonl", ".json")):
        return "jsonl"
    raise TaskError(f"{where}: cannot tell the format (.jsonl, .parquet or a folder): set format")


def _read_jsonl(where: str) -> list[Any]:
    out = []
    with open(where, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TaskError(f"{where}:{lineno}: invalid JSON: {exc}") from exc
    return out


def _read_parquet(where: str) -> list[Any]:
    try:
        from datasets import Dataset
    except ImportError:
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise TaskError(
                f"{where}: parquet needs the datasets extra (pip install datasets)"
            ) from exc
        rows: list[Any] = pq.read_table(where).to_pylist()
        return rows
    return list(Dataset.from_parquet(where).to_list())


def _read_hf(where: str, split: str) -> list[Any]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as exc:
        raise TaskError(f"{where}: a saved dataset needs the datasets extra") from exc
    data: Any = load_from_disk(where)
    if isinstance(data, DatasetDict):
        if split not in data:
            raise TaskError(f"{where}: no split {split!r} (splits: {sorted(data)})")
        data = data[split]
    return list(data.to_list())


def _mapped(record: object, settings: DatasetSettings, where: str) -> dict[str, Any]:
    if not isinstance(record, Mapping):
        raise TaskError(f"{where}: expected an object, got {type(record).__name__}")
    out = {str(k): v for k, v in record.items()}
    if settings.prompt_column not in out:
        raise TaskError(
            f"{where}: no prompt column {settings.prompt_column!r} (columns: {sorted(out)}); "
            "set task.dataset.prompt_column"
        )
    out[PROMPT] = out.pop(settings.prompt_column)
    if settings.answer_column is not None and settings.answer_column in out:
        out[ANSWER] = out.pop(settings.answer_column)
    _check_prompt(out[PROMPT], where)
    return out


def _check_prompt(prompt: object, where: str) -> None:
    if isinstance(prompt, str):
        return
    ok = isinstance(prompt, list) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in prompt
    )
    if not ok or not prompt:
        raise TaskError(
            f"{where}: a prompt is a string or a list of {{'role', 'content'}} messages, "
            f"got {prompt!r}"
        )


def render_prompt(prompt: Any, tokenizer: Any, system_prompt: str | None) -> str:
    """The text a prompt is generated from: a string as it is (``system_prompt`` and a newline
    first), a conversation through the tokenizer's chat template (``add_generation_prompt``)."""
    if isinstance(prompt, str):
        return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
    messages = list(prompt)
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    inner = getattr(tokenizer, "inner", None)
    if inner is None or not getattr(inner, "chat_template", None):
        raise TaskError(
            "conversational prompts need a tokenizer with a chat template (model.hf whose "
            "tokenizer sets chat_template)"
        )
    text = inner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return str(text)


@attrs.frozen
class PreparedPrompts:
    """A dataset's prompts as rendered and checked: ``problem(index)`` is the run's
    ``index``-th prompt, the dataset in a shuffled order per epoch (``seed``), cycled."""

    problems: tuple[Problem, ...]
    shuffle: bool
    seed: int
    filtered: int = 0
    truncated: int = 0

    def problem(self, index: int) -> Problem:
        n = len(self.problems)
        epoch, at = divmod(index, n)
        if not self.shuffle:
            return self.problems[at]
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return self.problems[order[at]]


class DatasetTask:
    """The records of a dataset (``read_records``) as a ``Task``: ``prepare`` renders and
    checks them for the Driver; ``alphabet`` covers their text (for the built-in model's
    character tokenizer); ``score`` is exact match on ``answer`` for runs without reward
    functions."""

    def __init__(self, settings: DatasetSettings, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            raise TaskError(f"{settings.path}: the dataset has no records")
        self.settings = settings
        self.records = tuple(records)
        self.name = os.path.basename(str(settings.path).rstrip("/")) or "dataset"

    @classmethod
    def read(cls, settings: DatasetSettings) -> DatasetTask:
        """The task of ``settings``' records; read once per process while the file is
        unchanged (same path, inode, size, modification time): its records are shared, never changed."""
        global _last_read
        key = _file_key(settings)
        with _read_lock:
            if key is not None and _last_read is not None and _last_read[0] == key:
                return cls(settings, _last_read[1])
            records = tuple(read_records(settings))
            if key is not None:
                _last_read = (key, records)
        return cls(settings, records)

    @property
    def alphabet(self) -> str:
        chars: set[str] = set(self.settings.system_prompt or "") | {"\n"}
        for record in self.records:
            prompt = record[PROMPT]
            if isinstance(prompt, str):
                chars.update(prompt)
            else:
                for message in prompt:
                    chars.update(str(message.get("content", "")))
            chars.update(str(record.get(ANSWER, "")))
        return "".join(sorted(chars))

    def sample(self, n: int, seed: int) -> list[Problem]:
        """``n`` problems with their prompts unrendered (string prompts only)."""
        rng = random.Random(seed)
        picks = [self.records[rng.randrange(len(self.records))] for _ in range(n)]
        return [_problem(r, render_prompt(r[PROMPT], None, self.settings.system_prompt))
                for r in picks]  # fmt: skip

    def score(self, problem: Problem, response: str) -> float:
        if ANSWER not in problem.metadata:
            raise TaskError(f"task {self.name!r} has no answer column: set task.reward")
        return 1.0 if response.strip() == str(problem.metadata[ANSWER]).strip() else 0.0

    def prepare(
        self, tokenizer: Any, max_length: int | None, *, shuffle: bool | None = None
    ) -> PreparedPrompts:
        """Every record rendered (``render_prompt``) and checked against ``max_length`` tokens
        (BOS included) as ``overlong`` says. Raises ``TaskError`` for ``"error"`` and when no
        prompt is left; reports the filtered and truncated prompts once (a log warning)."""
        settings = self.settings
        problems: list[Problem] = []
        filtered = truncated = 0
        for i, record in enumerate(self.records):
            text = render_prompt(record[PROMPT], tokenizer, settings.system_prompt)
            if max_length is not None:
                length = len(tokenizer.encode(text, add_bos=True))
                if length > max_length:
                    if settings.overlong == "error":
                        raise TaskError(
                            f"{settings.path} record {i}: prompt of {length} tokens exceeds "
                            f"max_prompt_length {max_length} (task.dataset.overlong = 'error')"
                        )
                    if settings.overlong == "filter":
                        filtered += 1
                        continue
                    text = _truncate_left(tokenizer, text, max_length)
                    truncated += 1
            problems.append(_problem(record, text))
        if filtered or truncated:
            log.warning(
                "%s: %d prompts over %s tokens %s", settings.path, filtered or truncated,
                max_length, "filtered out" if filtered else "truncated on the left",
            )  # fmt: skip
        if not problems:
            raise TaskError(f"{settings.path}: every prompt exceeds max_prompt_length {max_length}")
        return PreparedPrompts(
            tuple(problems),
            settings.shuffle if shuffle is None else shuffle,
            settings.seed,
            filtered=filtered,
            truncated=truncated,
        )


def _file_key(settings: DatasetSettings) -> tuple[Any, ...] | None:
    """``settings`` and its file's identity; ``None`` for a folder (an HF dataset) or no file."""
    path = settings.path
    if not path or not os.path.isfile(path):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (repr(settings), os.path.abspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _truncate_left(tokenizer: Any, text: str, max_length: int) -> str:
    """The end of ``text`` that encodes to at most ``max_length`` tokens with its BOS."""
    ids = tokenizer.encode(text)
    keep = max_length - 1
    while keep > 0:
        kept = _decode(tokenizer, ids[-keep:])
        if len(tokenizer.encode(kept, add_bos=True)) <= max_length:
            return kept
        keep -= 1  # a decode and encode need not round-trip exactly
    raise TaskError(f"max_prompt_length {max_length} leaves no room for a prompt")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    inner = getattr(tokenizer, "inner", None)
    if inner is not None:
        return str(inner.decode(ids, skip_special_tokens=False))
    return str(tokenizer.decode(ids))


def _problem(record: Mapping[str, Any], text: str) -> Problem:
    answer = record.get(ANSWER)
    return Problem(prompt=text, answer="" if answer is None else str(answer), metadata=dict(record))

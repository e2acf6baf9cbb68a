"""Reading a run's sample ledger (``run_dir/samples.jsonl``) and checking it: exactly-once and
the staleness bound, from the data rather than from the run's counters.

    records = read_samples("runs/demo")
    check = check_samples(records, group_size=8, staleness=1)
    assert check.ok, check

The format is in ``docs/pipeline.md`` ("The sample ledger"); the Driver writes it
(``roles._ledger``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from ..roles._ledger import SAMPLES_FILE

Kind = Literal["trained", "not_trained"]
Reason = Literal["evicted", "lost", "dropped", "filtered", "unfinished", "withdrawn"]

REASONS: tuple[str, ...] = ("evicted", "lost", "dropped", "filtered", "unfinished", "withdrawn")
_TRAINED_KEYS = {
    "kind": str, "prompt_id": str, "sample_id": str, "attempt": int, "admitted_version": int,
    "oldest_version": int, "newest_version": int, "step": int, "trainer_version": int,
    "reward": float,
}  # fmt: skip
_NOT_TRAINED_KEYS = {
    "kind": str, "prompt_id": str, "attempt": int, "admitted_version": int, "reason": str,
    "reinjected": bool,
}  # fmt: skip


class SamplesFileError(ValueError):
    """A line of ``samples.jsonl`` is not a ledger record; the message names the line."""


@attrs.frozen
class SampleRecord:
    """One line of the sample ledger.

    Every record: ``kind`` (``"trained"``: one trained sample; ``"not_trained"``: one attempt at
    a prompt that was not trained), ``prompt_id``, ``attempt`` (0, 1, ...: each admission of
    the prompt), ``admitted_version`` (the policy version the attempt was admitted for).
    A trained sample also has ``sample_id`` (``"<prompt_id>/<attempt>/<index in group>"``),
    ``oldest_version`` / ``newest_version`` (its tokens' oldest and newest policy version),
    ``step`` (the trainer step that trained it), ``trainer_version`` (the trainer's version
    when it took that step: ``step - 1``) and ``reward``. An attempt not trained has ``reason``
    (``evicted``, ``lost``, ``dropped``, ``filtered``, ``unfinished``, ``withdrawn``: an
    earlier attempt reported ``lost`` was trained after all) and ``reinjected``
    (whether the prompt was admitted again, as the next attempt).
    """

    kind: Kind
    prompt_id: str
    attempt: int
    admitted_version: int
    sample_id: str | None = None
    oldest_version: int | None = None
    newest_version: int | None = None
    step: int | None = None
    trainer_version: int | None = None
    reward: float | None = None
    reason: Reason | None = None
    reinjected: bool | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SampleRecord:
        """A record from its JSON object; ``ValueError`` naming what is wrong."""
        kind = raw.get("kind")
        if kind == "trained":
            keys = _TRAINED_KEYS
        elif kind == "not_trained":
            keys = _NOT_TRAINED_KEYS
        else:
            raise ValueError(f"kind must be 'trained' or 'not_trained', got {kind!r}")
        missing = sorted(set(keys) - set(raw))
        extra = sorted(set(raw) - set(keys))
        if missing or extra:
            raise ValueError(f"a {kind} record: missing keys {missing}, unknown keys {extra}")
        for key, expected in keys.items():
            value = raw[key]
            ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
            if expected is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok:
                raise ValueError(f"{key} must be {expected.__name__}, got {value!r}")
        if kind == "not_trained" and raw["reason"] not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {raw['reason']!r}")
        values = dict(raw)
        if kind == "trained":
            values["reward"] = float(values["reward"])
            head, _, index = raw["sample_id"].rpartition("/")
            if head != f"{raw['prompt_id']}/{raw['attempt']}" or not index.isdigit():
                raise ValueError(
                    f"sample_id must be '<prompt_id>/<attempt>/<index>', got {raw['sample_id']!r}"
                )
        return cls(**values)


def read_samples(run_dir: str) -> list[SampleRecord]:
    """The records of ``run_dir/samples.jsonl`` (``run_dir`` may also name the file), in the
    order written. Raises ``SamplesFileError`` naming the first malformed line,
    ``FileNotFoundError`` if the run wrote no ledger."""
    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, SAMPLES_FILE)
    records: list[SampleRecord] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                if not isinstance(raw, dict):
                    raise ValueError(f"not a JSON object: {line.strip()[:60]!r}")
                records.append(SampleRecord.from_json(raw))
            except ValueError as exc:  # json.JSONDecodeError included
                raise SamplesFileError(f"{path}, line {number}: {exc}") from None
    return records


@attrs.frozen
class SampleCheck:
    """What ``check_samples`` found (each a sorted tuple of ids; all empty: ``ok``).

    ``lost``: prompts admitted whose fate is not recorded (an attempt neither trained in full
    nor reported ``not_trained``, a prompt id skipped, an attempt reported injected again
    with no later attempt). ``duplicated``: sample ids trained more than once. ``stale``:
    sample ids trained outside the staleness bound. ``retrained``: prompts trained in more
    than one attempt. ``prompts``, ``trained``, ``not_trained``: the counts seen.
    """

    lost: tuple[str, ...] = ()
    duplicated: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    retrained: tuple[str, ...] = ()
    prompts: int = 0
    trained: int = 0
    not_trained: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.stale or self.retrained)


def within_bound(record: SampleRecord, staleness: int) -> bool:
    """Whether a trained sample respects the staleness bound of a run at ``staleness``::

        admitted_version <= oldest_version <= newest_version <= trainer_version
        trainer_version - oldest_version <= staleness,   step == trainer_version + 1

    A sample's version is its oldest token's; the trainer at version ``v`` takes samples of
    versions ``[v - staleness, v]`` (``staleness = 0``: every token made by the very weights
    it trains, on-policy), and a rollout starts no attempt on weights older than the version
    it was admitted for."""
    if record.kind != "trained":
        return True
    admitted, oldest, newest = record.admitted_version, record.oldest_version, record.newest_version
    trainer, step = record.trainer_version, record.step
    assert oldest is not None and newest is not None and trainer is not None and step is not None
    return (
        admitted <= oldest <= newest <= trainer
        and trainer - oldest <= staleness
        and step == trainer + 1
    )


def check_samples(
    records: Iterable[SampleRecord], *, group_size: int, staleness: int
) -> SampleCheck:
    """Exactly-once and the staleness bound over a whole run's ledger (``SampleCheck``).

    Each prompt's attempts run 0, 1, ... up to its last; every one but the last must be
    reported ``not_trained`` with ``reinjected``, and the last must be trained in full
    (``group_size`` samples, indexes ``0 .. group_size - 1``) or reported ``not_trained``.
    Prompt ids are the run's prompt indexes: an id below the largest seen that no record
    names was admitted and lost (so ``records`` is a whole run's ledger)."""
    trained: dict[str, dict[int, list[SampleRecord]]] = {}
    ended: dict[str, dict[int, list[SampleRecord]]] = {}
    seen: dict[str, int] = {}
    stale: set[str] = set()
    count = {"trained": 0, "not_trained": 0}
    for record in records:
        count[record.kind] += 1
        book = trained if record.kind == "trained" else ended
        book.setdefault(record.prompt_id, {}).setdefault(record.attempt, []).append(record)
        seen[record.prompt_id] = max(seen.get(record.prompt_id, 0), record.attempt)
        if not within_bound(record, staleness):
            assert record.sample_id is not None
            stale.add(record.sample_id)
    ids: dict[str, int] = {}
    for attempts in trained.values():
        for samples in attempts.values():
            for r in samples:
                assert r.sample_id is not None
                ids[r.sample_id] = ids.get(r.sample_id, 0) + 1
    duplicated = {s for s, n in ids.items() if n > 1}
    lost: set[str] = set()
    retrained: set[str] = set()
    complete = set(range(group_size))
    for pid, last in seen.items():
        done = trained.get(pid, {})
        reports = ended.get(pid, {})
        full = [a for a, samples in done.items() if _indexes(samples) == complete]
        if len(full) > 1:
            retrained.add(pid)
        if any(_indexes(samples) != complete for samples in done.values()):
            lost.add(pid)  # an attempt trained in part: the rest of its samples went missing
        for attempt in range(last + 1):
            again = [r for r in reports.get(attempt, []) if r.reinjected]
            if attempt < last and not again and attempt not in done:
                lost.add(pid)  # an attempt with no fate before the next one
            if attempt == last and attempt not in done and not reports.get(attempt):
                lost.add(pid)
            if attempt == last and again and attempt not in done:
                lost.add(pid)  # injected again, never admitted again
    numeric = [int(p) for p in seen if p.isdigit()]
    if numeric and len(numeric) == len(seen):
        lost |= {str(i) for i in range(max(numeric) + 1)} - set(seen)
    return SampleCheck(
        lost=_sorted(lost),
        duplicated=_sorted(duplicated),
        stale=_sorted(stale),
        retrained=_sorted(retrained),
        prompts=len(seen),
        trained=count["trained"],
        not_trained=count["not_trained"],
    )


def _indexes(samples: list[SampleRecord]) -> set[int]:
    return {int((r.sample_id or "").rpartition("/")[2]) for r in samples}


def _sorted(ids: set[str]) -> tuple[str, ...]:
    """Ids in numeric order where they are numbers (prompt ids, then attempt, then index)."""

    def key(text: str) -> tuple[tuple[int, int | str], ...]:
        return tuple((0, int(p)) if p.isdigit() else (1, p) for p in text.split("/"))

    return tuple(sorted(ids, key=key))

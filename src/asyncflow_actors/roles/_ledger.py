"""The sample ledger: ``run_dir/samples.jsonl``, one JSON line per trained sample and per attempt
at a prompt that was not trained (``docs/pipeline.md``, "The sample ledger").

- **Ids.** A prompt's id is its index in the run's prompt stream (the Driver's cursor, which a
  checkpoint keeps): unique across the run and its resumes. Each admission of a prompt into a
  rollout group is an *attempt* (0, 1, ...: a prompt injected again after its group was evicted
  or lost keeps its id, its attempt grows). The Driver stores ``(prompt index, attempt, admitted
  version)`` in the group's shared ``prompt_key`` column, so every sample carries it through the
  TransferQueue; the Trainer reports what it trained with it (``TrainedSamples`` in
  ``StepDone``: ``trained_samples``), whichever Driver admitted it.
- **One writer.** The Driver writes every record (``SampleLedger``): the trained samples of each
  ``StepDone`` (once per step: a step reported again is not written again), the attempts it
  injects again or drops, and at the end the prompts still in flight (``unfinished``). Records
  are buffered as they come (a step's samples as the one ``TrainedSamples`` value) and turned
  into lines and appended by a worker thread about once a second, in order, and flushed before
  a checkpoint and when the Driver stops: neither JSON nor a write per sample on the event loop.
- **Resume.** A checkpoint records the ledger's length in records (``ledger.json``) with the
  prompts in flight; a resume cuts the file back to that length (the records after it describe
  training the resumed model does not hold, and the prompts it re-admits) and appends from
  there, so a sample is recorded once per training the final model holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import attrs
import trio

from . import _schema as S
from ._messages import StepDone, TrainedSamples
from ._worker import column, columns

log = logging.getLogger("asyncflow_actors.roles")

SAMPLES_FILE = "samples.jsonl"
MARK_FILE = "ledger.json"  # in a checkpoint directory: {"records": <records before it>}
FLUSH_EVERY_S = 1.0


def prompt_id(index: int) -> str:
    """A prompt's run-wide id: its index in the run's prompt stream."""
    return str(index)


def trained_samples(batches: Sequence[Any], oldest: Sequence[int]) -> TrainedSamples:
    """The ledger entries of a step's batches (the Trainer, in its compute thread): each
    sample's ``prompt_key``, place in its group (by queue index), oldest token version (given:
    the Trainer's staleness check computed them, in batch order), newest token version (its
    stored version when it has no token) and reward."""
    import torch

    out: dict[str, list[Any]] = {f.name: [] for f in attrs.fields(TrainedSamples)}
    for batch in batches:
        keys = columns(batch, S.PROMPT_KEY)
        keys = torch.stack(list(keys)) if isinstance(keys, list) else keys
        prompt, attempt, admitted = keys.long().t().tolist()
        out["prompt"] += prompt
        out["attempt"] += attempt
        out["admitted"] += admitted
        out["index"] += _places(batch.group_ids, batch.indexes)
        # a reduction per sample: cheaper than one over the concatenated batch (measured)
        versions = batch[S.TOKEN_VERSIONS]
        out["newest"] += [
            int(t.max()) if t.numel() else stored
            for t, stored in zip(versions, batch.versions, strict=True)
        ]
        out["reward"] += column(batch, S.REWARDS).float().tolist()
    out["oldest"] = list(oldest)
    return TrainedSamples(**{k: tuple(v) for k, v in out.items()})


def _places(groups: Sequence[int], indexes: Sequence[int]) -> list[int]:
    """Each sample's place in its group: the rank of its queue index among its group's (a
    group's rows are allocated in order, in one put, and trained whole)."""
    order = sorted(range(len(groups)), key=lambda k: (groups[k], indexes[k]))
    places = [0] * len(groups)
    previous, place = None, 0
    for k in order:
        if groups[k] != previous:
            previous, place = groups[k], 0
        places[k] = place
        place += 1
    return places


class SampleLedger:
    """The Driver's ledger (see the module docstring). ``path`` ``None``: a run without a
    ``run_dir`` (attempts are still counted: they travel in ``prompt_key``)."""

    def __init__(
        self,
        path: str | None,
        *,
        count: int = 0,
        attempts: dict[int, int] | None = None,
        step: int = 0,
    ) -> None:
        self.path = path
        self.count = count  # records in the file and buffered: a checkpoint's mark
        self.step = step  # the newest step recorded
        self.start_version = step
        self._next: dict[int, int] = dict(attempts or {})  # prompt index -> its next attempt
        self._current: dict[int, tuple[int, int]] = {}  # in flight: (attempt, admitted version)
        # a not_trained record, or a step's (version, samples): lines in the writer thread
        self._buffer: list[dict[str, Any] | tuple[int, TrainedSamples]] = []
        self._wake = trio.Event()
        self._lock = trio.Lock()
        self.closed = False

    @classmethod
    async def open(cls, run_dir: str | None, resume_from: str | None, version: int) -> SampleLedger:
        """The ledger of a run starting at ``version``; a resume cuts the file back to its
        checkpoint's mark and learns the attempts made so far."""
        if not run_dir:
            return cls(None, step=version)
        path = os.path.join(run_dir, SAMPLES_FILE)
        count, attempts = await trio.to_thread.run_sync(_recover, path, resume_from)
        return cls(path, count=count, attempts=attempts, step=version)

    # --- what the Driver tells it (no await: a checkpoint sees these and the Driver's state
    # change together)

    def next_attempt(self, index: int) -> int:
        """The attempt number prompt ``index`` gets if it is admitted now."""
        return self._next.get(index, 0)

    def admitted(self, index: int, attempt: int, version: int) -> None:
        """Prompt ``index``'s attempt ``attempt`` was admitted for ``version`` (its group
        opened)."""
        self._current[index] = (attempt, version)
        self._next[index] = max(self._next.get(index, 0), attempt + 1)

    def not_trained(self, index: int, reason: str, *, reinjected: bool) -> None:
        """Prompt ``index``'s attempt in flight ends untrained (``reason``)."""
        attempt, version = self._current.pop(index, (self.next_attempt(index), self.start_version))
        self._write(
            {
                "kind": "not_trained",
                "prompt_id": prompt_id(index),
                "attempt": attempt,
                "admitted_version": version,
                "reason": reason,
                "reinjected": reinjected,
            }
        )

    def trained(self, msg: StepDone) -> None:
        """The samples of step ``msg.version`` (once: a step recorded is not recorded again)."""
        if msg.version <= self.step:
            if len(msg.trained):
                log.warning("sample ledger: step %d reported again, not recorded", msg.version)
            return
        self.step = msg.version
        t = msg.trained
        for index, attempt in set(zip(t.prompt, t.attempt, strict=True)):
            if self._current.get(index, (-1, 0))[0] == attempt:
                del self._current[index]  # that attempt is done
        if self.path is not None and not self.closed and len(t):
            self._buffer.append((msg.version, t))
            self.count += len(t)
            self._wake.set()

    def unfinished(self, indexes: Iterable[int]) -> None:
        """The prompts still in flight when the run ends."""
        for index in sorted(set(indexes)):
            self.not_trained(index, "unfinished", reinjected=False)

    def mark(self) -> int:
        """The ledger's length in records, every record so far (flushed by ``save_mark``)."""
        return self.count

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is None or self.closed:
            return
        self._buffer.append(record)
        self.count += 1
        self._wake.set()

    # --- writing

    async def flush(self) -> None:
        """Append the buffered records (in a worker thread, in order)."""
        async with self._lock:
            buffer, self._buffer = self._buffer, []
            if buffer and self.path is not None:
                await trio.to_thread.run_sync(_append, self.path, buffer)

    async def save_mark(self, directory: str, mark: int) -> None:
        """Flush, then record ``mark`` in checkpoint ``directory`` (before the Driver's state:
        a checkpoint with a Driver state has its mark)."""
        await self.flush()
        if self.path is not None:
            await trio.to_thread.run_sync(_write_mark, directory, mark)

    async def serve(self) -> None:
        """The Driver's flushing task: the records of about a second in one append."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await trio.sleep(FLUSH_EVERY_S)
            await self.flush()

    async def rewind(self, checkpoint: str, version: int) -> None:
        """Back to checkpoint ``checkpoint`` (of ``version``) without a new Driver: what was
        buffered is dropped, the file cut back to the checkpoint's mark, the attempts relearnt
        from it (for a Driver that restores a checkpoint's state in place)."""
        async with self._lock:
            self._buffer = []
            if self.path is not None:
                self.count, self._next = await trio.to_thread.run_sync(
                    _recover, self.path, checkpoint
                )
        self._current = {}
        self.step = self.start_version = version

    async def lose_steps(
        self, versions: Collection[int], held: Iterable[int], since: str | None
    ) -> None:
        """Steps ``versions`` are lost (an auto-resume: no checkpoint holds them, and the
        restarted Trainer starts before them): their ``trained`` records are taken back (from
        the buffer, and from the file past checkpoint ``since``'s mark; ``None``: the whole
        file), and each of their attempts is recorded ``not_trained`` ("lost", injected
        again). ``held``: the prompts of lost steps never reported here (still in flight)."""
        lost: dict[int, tuple[int, int]] = {}  # prompt index -> (attempt, admitted version)
        wanted = set(versions)
        async with self._lock:
            kept: list[dict[str, Any] | tuple[int, TrainedSamples]] = []
            for entry in self._buffer:
                if isinstance(entry, tuple) and entry[0] in wanted:
                    t = entry[1]
                    self.count -= len(t)
                    lost.update(zip(t.prompt, zip(t.attempt, t.admitted, strict=True), strict=True))
                else:
                    kept.append(entry)
            self._buffer = kept
            if self.path is not None and wanted:
                mark = (read_mark(since) if since else None) or 0
                removed = await trio.to_thread.run_sync(_cut_steps, self.path, mark, wanted)
                self.count -= len(removed)
                lost.update((p, (a, adm)) for p, a, adm in removed)
        for index, (attempt, admitted) in sorted(lost.items()):
            self._write(
                {
                    "kind": "not_trained",
                    "prompt_id": prompt_id(index),
                    "attempt": attempt,
                    "admitted_version": admitted,
                    "reason": "lost",
                    "reinjected": True,
                }
            )
        for index in held:
            self.not_trained(index, "lost", reinjected=True)

    async def close(self, unfinished: Iterable[int]) -> None:
        """The end of the run: record the prompts in flight, flush, record nothing more."""
        if not self.closed:
            self.unfinished(unfinished)
            self.closed = True
        await self.flush()


def _append(path: str, buffer: list[dict[str, Any] | tuple[int, TrainedSamples]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for entry in buffer:
            if isinstance(entry, dict):
                f.write(json.dumps(entry) + "\n")
            else:
                f.writelines(_trained_lines(*entry))


def _trained_lines(step: int, t: TrainedSamples) -> list[str]:
    """The ``trained`` records of step ``step``, as lines: ``json.dumps`` of each record, but
    formatted directly (five times faster; the writer thread holds the GIL meanwhile)."""
    lines = []
    dumps, isfinite = json.dumps, math.isfinite
    for p, a, adm, i, old, new, r in zip(
        t.prompt, t.attempt, t.admitted, t.index, t.oldest, t.newest, t.reward, strict=True
    ):
        reward = repr(float(r)) if isfinite(r) else dumps(r)
        lines.append(
            f'{{"kind": "trained", "prompt_id": "{p}", "sample_id": "{p}/{a}/{i}", '
            f'"attempt": {a}, "admitted_version": {adm}, "oldest_version": {old}, '
            f'"newest_version": {new}, "step": {step}, "trainer_version": {step - 1}, '
            f'"reward": {reward}}}\n'
        )
    return lines


def _cut_steps(path: str, mark: int, versions: set[int]) -> list[tuple[int, int, int]]:
    """Remove the ``trained`` records of steps ``versions`` past the first ``mark`` records of
    the ledger file; the (prompt, attempt, admitted version) of each removed."""
    removed: list[tuple[int, int, int]] = []
    with open(path, "r+b") as f:
        start = 0
        for _ in range(mark):
            line = f.readline()
            if not line:
                break
            start += len(line)
        tail: list[bytes] = []
        for line in f:
            record = json.loads(line) if line.strip() else {}
            if record.get("kind") == "trained" and record.get("step") in versions:
                removed.append(
                    (int(record["prompt_id"]), int(record["attempt"]),
                     int(record["admitted_version"]))
                )  # fmt: skip
            else:
                tail.append(line)
        f.seek(start)
        f.truncate()
        f.writelines(tail)
    return removed


def _write_mark(directory: str, mark: int) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MARK_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"records": mark}, f)
    os.replace(path + ".tmp", path)


def read_mark(directory: str) -> int | None:
    """The ledger length (records) a checkpoint recorded (``None``: none recorded)."""
    try:
        with open(os.path.join(directory, MARK_FILE), encoding="utf-8") as f:
            return int(json.load(f)["records"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recover(path: str, resume_from: str | None) -> tuple[int, dict[int, int]]:
    """The ledger file as a run finds it: a new run starts it empty; a resume cuts it back to
    its checkpoint's mark (or, without one, to its last whole line). Its length in records and
    each prompt's next attempt (read line by line: a long run's ledger is large)."""
    if resume_from is None:
        with open(path, "w", encoding="utf-8"):
            return 0, {}
    mark = read_mark(resume_from)
    try:
        f = open(path, "r+b")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        if mark:
            log.warning("sample ledger: %s is missing; it starts again here", path)
        return 0, {}
    attempts: dict[int, int] = {}
    kept = end = 0
    with f:
        for line in f:
            if (mark is not None and kept == mark) or not line.endswith(b"\n"):
                break  # past the checkpoint, or a line cut by a crash
            if line.strip():
                record = json.loads(line)
                index = int(record["prompt_id"])
                attempts[index] = max(attempts.get(index, 0), int(record["attempt"]) + 1)
            kept += 1
            end += len(line)
        if mark is not None and kept < mark:
            log.warning("sample ledger: %s holds %d records, its checkpoint %d", path, kept, mark)
        f.truncate(end)
    return kept, attempts

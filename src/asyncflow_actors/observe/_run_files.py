"""A run's files read back for the dashboard (``asyncflow dashboard RUN_DIR``), during the run
or after it: the trace (``trace.json``, written when the observer closes), the step records
(``steps.jsonl``) and the sample completions (``completions.jsonl``).

Read on each request, in a worker thread (the dashboard calls them there); the trace is parsed
once per change of the file. A line still being written (the last, without its newline) is
skipped, never an error.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

TRACE = "trace.json"
STEPS = "steps.jsonl"
COMPLETIONS = "completions.jsonl"


class RunFiles:
    """The files of the run in ``run_dir`` (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = os.fspath(run_dir)
        self._lock = threading.Lock()
        self._trace_key: tuple[int, int] | None = None
        self._trace: dict[str, Any] = {"traceEvents": []}

    def trace(self, last: float | None = None) -> dict[str, Any]:
        """``trace.json`` (empty before the observer wrote it), or its spans that ended in its
        ``last`` seconds (the trace's own clock: the end of the run)."""
        whole = self._whole_trace()
        if last is None:
            return whole
        events = whole.get("traceEvents", [])
        ends = [e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X"]
        if not ends:
            return whole
        cutoff = max(ends) - last * 1e6
        kept = [
            e for e in events if e.get("ph") == "M" or e.get("ts", 0) + e.get("dur", 0) >= cutoff
        ]
        return {**whole, "traceEvents": kept}

    def _whole_trace(self) -> dict[str, Any]:
        path = os.path.join(self.run_dir, TRACE)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return {"traceEvents": []}
        key = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            if key != self._trace_key:
                try:
                    with open(path, encoding="utf-8") as f:
                        self._trace = json.load(f)
                except ValueError:  # being written: the last complete one stays
                    return self._trace
                self._trace_key = key
            return self._trace

    def steps(self, last: int | None = None) -> list[dict[str, Any]]:
        """The records of ``steps.jsonl`` (the ``last`` ones), oldest first."""
        return _tail(os.path.join(self.run_dir, STEPS), last)

    def completions(self, last: int | None = None) -> list[dict[str, Any]]:
        """The sample completions of ``completions.jsonl`` (the ``last`` ones), oldest first."""
        return _tail(os.path.join(self.run_dir, COMPLETIONS), last)


def _tail(path: str, last: int | None) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:  # the line being written
            continue
    return out if last is None else out[-last:] if last > 0 else []

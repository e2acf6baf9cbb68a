"""Checks shared by the observe tests: a trace is valid trace-event JSON and well formed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = json.loads((Path(__file__).parent / "trace_event_schema.json").read_text())


def validate_trace(trace: dict[str, Any]) -> None:
    """The trace-event schema, plus what viewers assume beyond it.

    Slices of one thread nest properly; every flow point lies inside a slice of its thread (so
    ``bp: "e"`` binds it); every flow has one start, one finish, and steps in time order.
    """
    jsonschema.validate(trace, SCHEMA)
    events = trace["traceEvents"]
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            # in whole nanoseconds, as Perfetto reads them: ``ts + dur`` in float microseconds
            # can land an ulp past the next slice's ``ts`` (back-to-back sync phases)
            start, end = round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)
            slices.setdefault((e["pid"], e["tid"]), []).append((start / 1000, end / 1000))
    for track, spans in slices.items():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"slices overlap without nesting on {track}"
            stack.append(end)
    flows: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] in "stf":
            inside = any(a <= e["ts"] <= b for a, b in slices.get((e["pid"], e["tid"]), ()))
            assert inside, f"flow point outside any slice: {e}"
            flows.setdefault(e["id"], []).append(e)
    for points in flows.values():
        phases = [p["ph"] for p in points]
        assert phases[0] == "s" and phases[-1] == "f" and set(phases[1:-1]) <= {"t"}, phases
        assert [p["ts"] for p in points] == sorted(p["ts"] for p in points)


def perfetto_trace_processor() -> str | None:
    """A trace_processor binary for the perfetto package, if one is available offline.

    The ``perfetto`` package downloads its binary on first use; there is no network here, so
    the check runs only where ``PERFETTO_TRACE_PROCESSOR`` names a binary.
    """
    path = os.environ.get("PERFETTO_TRACE_PROCESSOR")
    return path if path and os.path.isfile(path) else None

"""An observed pipeline run with its roles in node processes: the trace written at shutdown
holds every node's spans and covers every trained sample (the last pull comes before the nodes
stop)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from asyncflow_actors.pipeline import run_pipeline
from tests.observe.kit import validate_trace
from tests.pipeline.kit import tiny


def spans_by_name(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            out.setdefault(e["name"], []).append(e)
    return out


async def test_the_trace_of_a_run_in_node_processes_covers_every_trained_sample(
    tmp_path: Path,
) -> None:
    # The rollout and the trainer each in a process of its own: the first and the last spans
    # of every sample are recorded in node processes, the trainer's last step just before the
    # run stops them.
    config = tiny(
        "async",
        observe=True,
        run_dir=str(tmp_path),
        placement={"default": "local", "roles": {"rollout": "rollout-0", "trainer": "trainer-0"}},
    )
    result = await run_pipeline(config)
    trained = config.train.steps * config.train.prompts_per_step * config.rollout.group_size
    assert result.samples == trained

    trace = json.loads((tmp_path / "trace.json").read_text())
    validate_trace(trace)
    events = trace["traceEvents"]
    # thread names read "<worker> [<process>]"; a node's process is "<node>.<run suffix>"
    processes = {
        re.sub(r"\.[0-9a-f]+$", "", m.group(1))
        for e in events
        if e["name"] == "thread_name"
        and (m := re.search(r"\[(.+)\]$", e["args"]["name"])) is not None
    }
    assert {"rollout-0", "trainer-0", "driver"} <= processes, processes
    spans = spans_by_name(events)
    train = spans["train"]
    assert len(train) == config.train.steps  # the last step's span included
    assert sum(len(e["args"]["samples"]) for e in train) == trained
    rolled = {s for e in spans["rollout"] for s in e["args"].get("samples", ())}
    for e in train:
        assert set(e["args"]["samples"]) <= rolled, e["args"]["samples"]

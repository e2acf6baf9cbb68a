"""Spans of every process as one Chrome trace-event JSON object (loads in Perfetto).

The layout a reader of the trace sees:

- one *process* track per role (``rollout``, ``actor_fwd``, ...), ordered as the stations are;
- one *thread* track per worker of the role, named ``worker [os-process]``; a worker whose spans
  overlap without nesting (concurrent generations) gets extra lanes ``worker (2)``, ... so every
  track holds properly nested slices, as the format requires;
- complete events (``ph: "X"``) whose ``args`` carry the samples, groups and policy version;
- flow arrows (``ph: "s"/"t"/"f"``, bound to the enclosing slice) following each sample from
  station to station in time order — a span that names only a group joins the flows of that
  group's samples; waits (spans named ``tq.*``, ``flow.*`` or ``wait.*``) and spans nested in
  another span of the same sample on the same track are left out of the flows, so the arrows go
  station to station;
- counter tracks (``ph: "C"``) for the queue depths the observer polled.

The format is the Trace Event Format (catapult's ``trace-event-format`` document); Perfetto and
``chrome://tracing`` import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._tracer import SpanRecord

SpanChunk = tuple[str, int, Sequence[SpanRecord]]
"""``(process label, clock offset in ns, spans)``: the spans of one process, as collected.

A span's time on the trace's clock is ``its time - offset``.
"""

CounterPoint = tuple[int, str, Mapping[str, float]]
"""``(time in ns on the trace's clock, counter track name, {series: value})``."""

WAIT_PREFIXES = ("tq.", "flow.", "wait.")
"""Span names that mark waits: they are drawn, but flows do not pass through them."""

MAX_LISTED_IDS = 32  # sample ids listed in a span's args (the flows still cover them all)


def _lanes(spans: list[tuple[int, int, int]]) -> list[int]:
    """A lane per span (given as ``(start, end, index)``) so that each lane nests properly."""
    order = sorted(spans, key=lambda s: (s[0], -s[1]))
    stacks: list[list[int]] = []  # per lane, the end times of the open spans
    lane_of = [0] * len(spans)
    for start, end, index in order:
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                lane_of[index] = lane
                break
        else:
            stacks.append([end])
            lane_of[index] = len(stacks) - 1
    return lane_of


def _listed(ids: tuple[int | str, ...]) -> list[int | str]:
    return list(ids[:MAX_LISTED_IDS])


def chrome_trace(
    chunks: Iterable[SpanChunk],
    *,
    counters: Sequence[CounterPoint] = (),
    role_order: Sequence[str] = (),
    max_flows: int = 5000,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the trace object (``json.dump`` it to a ``.json`` file).

    ``role_order`` puts those roles' tracks first, in that order (the rest follow by first
    appearance). ``max_flows`` bounds the number of samples given flow arrows; past it, an even
    sample of the ids keeps them (every span is still in the trace).
    """
    spans: list[tuple[int, int, SpanRecord, str]] = []
    for process, offset, records in chunks:
        for rec in records:
            spans.append((rec[3] - offset, rec[4] - offset, rec, process))
    origin = min([s[0] for s in spans] + [c[0] for c in counters], default=0)

    def us(t_ns: int) -> float:
        return (t_ns - origin) / 1000.0

    first_seen: dict[str, int] = {}
    for start, _, rec, _ in sorted(spans, key=lambda s: s[0]):
        first_seen.setdefault(rec[1], start)
    rank = {role: i for i, role in enumerate(role_order)}
    roles = sorted(first_seen, key=lambda r: (rank.get(r, len(rank)), first_seen[r]))
    pid_of = {role: i + 1 for i, role in enumerate(roles)}

    events: list[dict[str, Any]] = []
    for role in roles:
        pid = pid_of[role]
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": role}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )

    # Threads: per (role, worker) the lanes of its spans, numbered in order of first appearance.
    by_worker: dict[tuple[str, str], list[int]] = {}
    for i, (_, _, rec, _) in enumerate(spans):
        by_worker.setdefault((rec[1], rec[2]), []).append(i)
    tid_of_span = [0] * len(spans)
    next_tid: dict[str, int] = {}
    workers = sorted(by_worker, key=lambda k: min(spans[i][0] for i in by_worker[k]))
    for role, worker in workers:
        members = by_worker[(role, worker)]
        lanes = _lanes([(spans[i][0], spans[i][1], j) for j, i in enumerate(members)])
        processes = sorted({spans[i][3] for i in members})
        base = next_tid.get(role, 1)
        for lane in range(max(lanes) + 1):
            tid = base + lane
            name = worker if lane == 0 else f"{worker} ({lane + 1})"
            name += f" [{', '.join(processes)}]"
            pid = pid_of[role]
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        next_tid[role] = base + max(lanes) + 1
        for j, i in enumerate(members):
            tid_of_span[i] = base + lanes[j]

    for i, (start, end, rec, _) in enumerate(spans):
        name, role, _, _, _, samples, groups, version, extra = rec
        args: dict[str, Any] = {}
        if samples:
            args["samples"] = _listed(samples)
            args["n_samples"] = len(samples)
        if groups:
            args["groups"] = _listed(groups)
        if version is not None:
            args["version"] = version
        if extra:
            args.update(extra)
        events.append(
            {
                "ph": "X",
                "name": name,
                "cat": role,
                "ts": us(start),
                "dur": max(end - start, 0) / 1000.0,
                "pid": pid_of[role],
                "tid": tid_of_span[i],
                "args": args,
            }
        )

    events.extend(_flows(spans, tid_of_span, pid_of, us, max_flows))

    if counters:
        pid = len(roles) + 1
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "queues"}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        for t_ns, name, values in counters:
            events.append(
                {
                    "ph": "C",
                    "name": name,
                    "ts": us(t_ns),
                    "pid": pid,
                    "tid": 0,
                    "args": dict(values),
                }
            )

    other = {"origin_ns": origin, **(metadata or {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _outermost(
    chain: list[int], spans: list[tuple[int, int, SpanRecord, str]], tid_of_span: list[int]
) -> list[int]:
    """The spans of ``chain`` not nested in another span of it on the same track, by start."""
    chain = sorted(chain, key=lambda i: (spans[i][0], -spans[i][1]))
    open_end: dict[tuple[str, int], int] = {}  # track -> end of the last kept span
    kept = []
    for i in chain:
        _, end, rec, _ = spans[i]
        track = (rec[1], tid_of_span[i])
        if track in open_end and end <= open_end[track]:
            continue
        open_end[track] = end
        kept.append(i)
    return kept


def _flows(
    spans: list[tuple[int, int, SpanRecord, str]],
    tid_of_span: list[int],
    pid_of: Mapping[str, int],
    us: Any,
    max_flows: int,
) -> list[dict[str, Any]]:
    """Flow events following each sample through the spans that name it (or its group)."""
    members: dict[int | str, set[int | str]] = {}  # group -> samples, from spans naming one group
    for _, _, rec, _ in spans:
        samples, groups = rec[5], rec[6]
        if samples and groups and len(groups) == 1:
            members.setdefault(groups[0], set()).update(samples)
    chains: dict[int | str, list[int]] = {}
    for i, (_, _, rec, _) in enumerate(spans):
        if rec[0].startswith(WAIT_PREFIXES):
            continue
        samples, groups = rec[5], rec[6]
        ids: Iterable[int | str] = samples or ()
        if not samples and groups:
            ids = {s for g in groups for s in members.get(g, ())}
        for sample in ids:
            chains.setdefault(sample, []).append(i)
    for sample, chain in chains.items():
        chains[sample] = _outermost(chain, spans, tid_of_span)
    followed = sorted((k for k, v in chains.items() if len(v) > 1), key=lambda k: (str(type(k)), k))
    if len(followed) > max_flows:
        stride = len(followed) / max_flows
        followed = [followed[int(j * stride)] for j in range(max_flows)]
    out: list[dict[str, Any]] = []
    for flow_id, sample in enumerate(followed, start=1):
        chain = chains[sample]
        for k, i in enumerate(chain):
            phase = "s" if k == 0 else ("f" if k == len(chain) - 1 else "t")
            rec = spans[i][2]
            out.append(
                {
                    "ph": phase,
                    "name": "sample",
                    "cat": "sample",
                    "id": flow_id,
                    "ts": us(spans[i][0]),
                    "pid": pid_of[rec[1]],
                    "tid": tid_of_span[i],
                    "bp": "e",
                    "args": {"sample": sample},
                }
            )
    return out

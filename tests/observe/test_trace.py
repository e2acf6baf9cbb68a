"""Trace spans: the tracer's on/off contract, and the Chrome trace the writer builds."""

from __future__ import annotations

import pytest

from asyncflow_actors import observe
from asyncflow_actors.observe._trace_json import chrome_trace
from tests.observe.kit import validate_trace


def test_off_tracer_records_nothing_and_returns_the_shared_no_op() -> None:
    tracer = observe.Tracer()
    span = tracer.span("x", role="r", worker="w", samples=[1, 2])
    assert span is observe.NO_SPAN
    with span as s:
        s.set(samples=3, version=1)
    assert tracer.track("r", "w").span("y") is observe.NO_SPAN
    tracer.record("z", role="r", worker="w", start_ns=0, end_ns=1)
    assert tracer.pending() == 0 and tracer.recorded == 0


def test_on_tracer_records_spans_with_ids_version_args_and_errors() -> None:
    tracer = observe.Tracer()
    tracer.enable()
    with tracer.span("rollout", role="rollout", worker="r0", group=7, version=3) as span:
        span.set(samples=(4, 5), tokens=12)
    with pytest.raises(KeyError), tracer.track("train", "t0").span("train", samples=4):
        raise KeyError("boom")
    (a, b) = tracer.drain()
    assert a[:3] == ("rollout", "rollout", "r0") and a[3] <= a[4]
    assert (a[5], a[6], a[7], a[8]) == ((4, 5), (7,), 3, {"tokens": 12})
    assert b[0] == "train" and b[5] == (4,) and b[8] == {"error": "KeyError"}
    assert tracer.pending() == 0


def test_enable_nests_and_a_full_buffer_drops_the_oldest() -> None:
    tracer = observe.Tracer()
    tracer.enable(capacity=3)
    tracer.enable()
    tracer.disable()
    assert tracer.enabled  # one enable still holds it
    for i in range(5):
        tracer.record(f"s{i}", role="r", worker="w", start_ns=i, end_ns=i + 1)
    assert [r[0] for r in tracer.drain()] == ["s2", "s3", "s4"]
    assert (tracer.recorded, tracer.dropped) == (5, 2)
    tracer.disable()
    assert not tracer.enabled
    with pytest.raises(RuntimeError):
        tracer.disable()
    with pytest.raises(ValueError, match="capacity"):
        tracer.enable(capacity=0)


def rec(name: str, role: str, worker: str, start: int, end: int, samples=None, groups=None):  # type: ignore[no-untyped-def]
    return (name, role, worker, start, end, samples, groups, None, None)


def test_overlapping_spans_of_one_worker_get_lanes_and_the_trace_validates() -> None:
    spans = [
        rec("gen", "rollout", "r0", 0, 10_000, groups=(1,)),
        rec("gen", "rollout", "r0", 5_000, 20_000, groups=(2,)),  # overlaps the first
        rec("tq.put", "rollout", "r0", 8_000, 9_000, samples=(0, 1)),  # nested in the first
        rec("gen", "rollout", "r0", 12_000, 15_000, groups=(3,)),  # fits the first lane again
    ]
    trace = chrome_trace([("driver", 0, spans)])
    validate_trace(trace)
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert sorted(names.values()) == ["r0 (2) [driver]", "r0 [driver]"]
    lanes = {
        e["args"].get("groups", [None])[0]: e["tid"]
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["name"] == "gen"
    }
    assert lanes[1] == lanes[3] != lanes[2]


def test_flows_follow_each_sample_station_to_station_skipping_waits_and_nested_spans() -> None:
    offset = 1_000_000  # the node's clock is 1 ms ahead of the driver's
    driver = [
        rec("rollout", "rollout", "r0", 0, 10_000, samples=(0, 1), groups=(9,)),
        rec("tq.put", "rollout", "r0", 8_000, 9_000, samples=(0, 1)),
        rec("tq.get", "train", "t0", 0, 60_000, samples=(0, 1)),  # a wait: no flow through it
        rec("train", "train", "t0", 60_000, 70_000, samples=(0, 1)),
        rec("reward", "reward", "w0", 12_000, 14_000, groups=(9,)),  # group only: joins 0 and 1
    ]
    node = [rec("forward", "forward", "f0", offset + 20_000, offset + 30_000, samples=(1, 0))]
    trace = chrome_trace(
        [("driver", 0, driver), ("node", offset, node)],
        role_order=("rollout", "reward", "forward", "train"),
    )
    validate_trace(trace)
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert [procs[p] for p in sorted(procs)] == ["rollout", "reward", "forward", "train"]
    fwd = next(e for e in events if e["ph"] == "X" and e["name"] == "forward")
    assert fwd["ts"] == 20.0 and fwd["dur"] == 10.0  # µs, on the driver's clock
    for sample in (0, 1):
        points = [e for e in events if e["ph"] in "stf" and e["args"]["sample"] == sample]
        assert [procs[p["pid"]] for p in points] == ["rollout", "reward", "forward", "train"]


def test_flows_are_capped_by_an_even_sample_of_ids() -> None:
    spans = [
        rec("a", "a", "w", 0, 10, samples=tuple(range(100))),
        rec("b", "b", "w", 20, 30, samples=tuple(range(100))),
    ]
    trace = chrome_trace([("p", 0, spans)], max_flows=10)
    starts = sorted(e["args"]["sample"] for e in trace["traceEvents"] if e["ph"] == "s")
    assert starts == list(range(0, 100, 10))
    listed = next(e for e in trace["traceEvents"] if e["ph"] == "X")["args"]
    assert listed["n_samples"] == 100 and len(listed["samples"]) == 32


async def test_spans_are_placed_with_the_best_clock_offset_the_observer_knows() -> None:
    """A node whose first answer was slow gave a poor clock-offset estimate; its spans from
    that pull are placed with the better estimate of later pulls, within the error bound the
    observer reports (they once stayed where the poor estimate put them, outside it)."""
    import trio

    import asyncflow_actors as afa
    from asyncflow_actors.observe import clock_ns
    from asyncflow_actors.observe._agent import Collect, Collected, ProcessInfo
    from asyncflow_actors.observe._metrics import MetricsSnapshot

    read: dict[str, int] = {}  # each agent's tick, on the observer's (this process's) clock

    class Agent(afa.Actor[Collect]):
        """A process whose clock reads ``skew`` ahead; its first answer takes ``delay``."""

        def __init__(self, name: str, skew: int, delay: float) -> None:
            self.name, self.skew, self.delay, self.calls = name, skew, delay, 0

        async def receive(self, msg: Collect, ctx: afa.ActorContext[Collect]) -> Collected:
            true = clock_ns()
            now = true + self.skew
            self.calls += 1
            spans: tuple[tuple[object, ...], ...] = ()
            if self.calls == 1:
                read[self.name] = true
                spans = (("tick", self.name, f"{self.name}-0", now, now, None, None, None, None),)
                await trio.sleep(self.delay)
            info = ProcessInfo(self.name, "host", 1, f"token-{self.name}")
            return Collected(info, now, spans, 0, MetricsSnapshot(0.0))

    config = observe.ObserveConfig(interval=3600, trace=False)
    async with afa.open_actor_system() as system, observe.open_observer(system, config) as obs:
        obs.attach(await system.spawn(lambda: Agent("steady", 0, 0.0), name="a"), name="a")
        obs.attach(await system.spawn(lambda: Agent("skewed", 5 * 10**9, 1.0), name="b"), name="b")
        for _ in range(3):
            await obs.collect()
        errors = obs.statistics().clock_error_ns
        ticks = {e["args"]["name"].split("-")[0]: e["ts"] for e in _thread_events(obs.trace())}
    assert errors["skewed"] < 500_000_000  # a faster answer came after the slow one
    placed = (ticks["skewed"] - ticks["steady"]) * 1000  # µs -> ns
    assert abs(placed - (read["skewed"] - read["steady"])) <= errors["skewed"] + errors["steady"]


def _thread_events(trace: dict[str, object]) -> list[dict[str, object]]:
    events = trace["traceEvents"]
    assert isinstance(events, list)
    names = {(e["pid"], e["tid"]): e for e in events if e["name"] == "thread_name"}
    return [{**e, "args": names[(e["pid"], e["tid"])]["args"]} for e in events if e["ph"] == "X"]

"""An observed run of the scripted pipeline, with the forward engine in a node process."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

import asyncflow_actors as afa
from asyncflow_actors import observe
from asyncflow_actors.observe import demo
from tests.observe.kit import perfetto_trace_processor, validate_trace

RUN = demo.DemoConfig(groups=8, group_size=4, batch_size=8, staleness=0, rollout_workers=2)


def span_starts(trace: dict[str, Any]) -> dict[int, dict[str, list[float]]]:
    """Per sample: start times of the spans naming it, by span name."""
    out: dict[int, dict[str, list[float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            for sample in e["args"].get("samples", ()):
                out.setdefault(sample, {}).setdefault(e["name"], []).append(e["ts"])
    return out


async def test_scripted_run_with_a_node_has_known_metrics_and_an_ordered_trace(
    tmp_path: Path,
) -> None:
    # Collections only when asked (run_demo's last one, ours, the closing one): known counts.
    config = observe.ObserveConfig(interval=3600, run_dir=str(tmp_path), graph=demo.GRAPH)
    async with afa.open_actor_system() as system:
        node = await system.start_node("engine-node", allow=["asyncflow_actors.observe"])
        async with observe.open_observer(system, config) as obs:
            agent = await obs.attach_node(node)
            result = await demo.run_demo(system, RUN, observer=obs, engine_node=node)
            snap = await obs.collect()
            stats = obs.statistics()
            node_pid = node.pid
        with pytest.raises(afa.ActorCrashed), trio.fail_after(10):
            await agent.ask(observe.Collect())  # the agent stopped with the observer

    total, steps = RUN.total, RUN.total // RUN.batch_size
    assert (result.samples, result.steps) == (total, steps)
    for role in demo.ROLES:
        assert snap.total("afa_role_samples_total", role=role) == total, role
    assert snap.total("afa_role_steps_total", role="train") == steps
    assert snap.total("afa_role_steps_total", role="forward") == steps
    tokens = sum(
        len(demo.response_of(g, j)) for g in range(RUN.groups) for j in range(RUN.group_size)
    )
    assert snap.total("afa_role_tokens_total", role="rollout") == tokens
    assert snap.total("afa_role_tokens_total", role="forward") == tokens
    assert snap.value("afa_policy_version", role="train", worker="train-0") == steps
    assert snap.value("afa_reward_mean", role="train") == 0.5
    staleness = snap.find("afa_train_staleness_versions")
    assert staleness is not None and staleness.counts[0] == total and staleness.count == total
    assert snap.value("afa_sync_total") == steps and snap.value("afa_sync_last_version") == steps
    topic = {"topic": demo.TOPIC}
    assert snap.value("afa_tq_allocated_total", **topic) == total
    assert snap.value("afa_tq_freed_total", **topic) == total
    assert snap.value("afa_tq_evicted_total", **topic) == 0
    assert snap.value("afa_tq_live_samples", **topic) == 0
    assert snap.value("afa_tq_latest_version", **topic) == steps
    assert snap.value("afa_flow_capacity_slots", flow="rollout") == RUN.batch_size
    # The node's runtime, as its agent reported it: the agent answered every pull but this one.
    processed = snap.value(
        "afa_actor_processed_total", process="engine-node", actor="observe-agent"
    )
    assert processed == stats.collections - 1
    assert snap.value("afa_trace_spans_dropped_total", process="engine-node") == 0
    assert snap.value("afa_trace_spans_total", process="engine-node") == steps  # forward.compute
    assert stats.pull_failures == stats.poll_failures == stats.exporter_errors == 0

    trace = json.loads((tmp_path / "trace.json").read_text())
    validate_trace(trace)
    events = trace["traceEvents"]
    threads = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    assert "engine-0 [engine-node]" in threads and "train-0 [driver]" in threads
    assert sum(e["ph"] == "X" and e["name"] == "forward.compute" for e in events) == steps
    # Every sample went rollout -> forward (engine on the node) -> advantage -> train, in that
    # order, up to the bound on the node's clock offset.
    slack = stats.clock_error_ns["engine-node"] / 1000.0
    starts = span_starts(trace)
    assert sorted(starts) == list(range(total))
    for sample, by_name in starts.items():
        r, f, c = by_name["rollout"][0], by_name["forward"][0], by_name["forward.compute"][0]
        a, t = by_name["advantage"][0], by_name["train"][0]
        assert r < f < a < t, (sample, by_name)
        assert f - slack <= c <= a + slack, (sample, by_name, slack)
        flow = [e for e in events if e["ph"] in "stf" and e["args"]["sample"] == sample]
        roles = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        assert [roles[p["pid"]] for p in flow] == [
            "rollout",
            "forward",
            "forward",
            "advantage",
            "train",
        ]

    # The JSONL exporter wrote every collection; the last line is the final snapshot.
    lines = list(observe.read_jsonl(tmp_path / "metrics.jsonl"))
    assert len(lines) == stats.collections + 1  # + the one when the observer closed
    assert lines[-1].total("afa_role_samples_total", role="train") == total
    assert json.loads((tmp_path / "observe.json").read_text())["graph"][0]["src"] == "rollout"
    assert node_pid is not None


async def test_observer_survives_an_agent_that_stops_answering() -> None:
    config = observe.ObserveConfig(interval=10.0, collect_timeout=2.0)
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=["asyncflow_actors.observe"])
        async with observe.open_observer(system, config) as obs:
            agent = await obs.attach_node(node)
            await obs.collect()
            await agent.stop()
            snap = await obs.collect()  # the agent is gone: counted, the rest still collected
            assert obs.statistics().pull_failures == 1
            assert snap.value("afa_process_actors", process="n") >= 1  # its last report stays
            with trio.fail_after(5):
                await obs.collect()


@pytest.mark.skipif(
    perfetto_trace_processor() is None,
    reason="the perfetto package downloads its trace_processor binary on first use and this "
    "machine is offline; set PERFETTO_TRACE_PROCESSOR to a binary to run this check",
)
async def test_trace_loads_in_perfettos_trace_processor(tmp_path: Path) -> None:
    tp = perfetto_trace_processor()
    assert tp is not None
    pytest.importorskip("perfetto", reason="the perfetto package is not installed")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    async with (
        afa.open_actor_system() as system,
        observe.open_observer(system, observe.ObserveConfig(run_dir=str(tmp_path))) as obs,
    ):
        await demo.run_demo(system, RUN, observer=obs)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    with TraceProcessor(
        trace=str(tmp_path / "trace.json"), config=TraceProcessorConfig(bin_path=tp)
    ) as tproc:
        slices = tproc.query("select count(*) as n from slice").as_pandas_dataframe()
        assert int(slices["n"][0]) == sum(e["ph"] == "X" for e in events)
        flows = tproc.query("select count(*) as n from flow").as_pandas_dataframe()
        assert int(flows["n"][0]) > 0


async def test_a_restarted_node_keeps_its_counters_and_drops_its_gauges() -> None:
    # A generous heartbeat timeout: only the kill below may restart the node.
    options = afa.NodeOptions(heartbeat_timeout=60.0)
    async with afa.open_actor_system() as system:
        node = await system.start_node("n", allow=["asyncflow_actors.observe"], options=options)
        async with observe.open_observer(system, observe.ObserveConfig(interval=3600)) as obs:
            await obs.attach_node(node)
            engine = await node.spawn(demo.ENGINE_TARGET, name="engine", kwargs={"worker": "e0"})
            for i in range(3):
                await engine.ask(demo.ComputeLogprobs((i,), ((1, 2),), 0))
            before = await obs.collect()
            assert before.value("afa_trace_spans_total", process="n") == 3
            old_pid = node.pid
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            with trio.fail_after(30):
                while node.pid in (None, old_pid):
                    await trio.sleep(0.05)
                await engine.ask(demo.ComputeLogprobs((9,), ((1,),), 0))  # respawned there
            after = await obs.collect()
            # 3 spans from the old process (kept) + 1 from the new one.
            assert after.value("afa_trace_spans_total", process="n") == 4
            # Gauges are the new process's alone: the agent and the engine.
            assert after.value("afa_process_actors", process="n") == 2
            assert obs.statistics().pull_failures == 0

"""What tracing costs: pipeline throughput with tracing on over off, and the cost of one span.

- ``observe_trace_overhead``: samples/s of a pipeline with tracing on (value) over off
  (baseline), rounds interleaved in one actor system (the order alternates each round), medians.
  Target: ratio >= 0.97.
- ``observe_trace_overhead_cpu``: the same rounds in samples per CPU-second of this process
  (every station and the TQ run in it): on a shared machine other processes' load moves wall
  time a lot more than it moves the CPU time tracing adds. The pipeline is ``asyncflow_actors.observe.demo`` with no compute delays
  (every station is pure TQ traffic, so spans are as large a share of the work as they can be);
  ``measure_overhead`` takes any ``round(trace: bool) -> Round``, to run the real pipeline.
- ``observe_span_off_ns`` / ``observe_span_on_ns``: one ``with track.span(...)`` with tracing
  off / on (recording included), against an empty ``with`` on a no-op object (baseline).
- ``observe_span_off_share``: the disabled spans' share of the pipeline's time per sample (spans
  per sample x off cost x samples/s): what tracing costs when it is off.
- ``observe_trace_overhead_pipeline``: the same measurement on the real pipeline
  (``asyncflow_actors.pipeline``: async GRPO of a tiny policy, every role in this process),
  trained samples/s with ``observe = true`` (an observer, spans of every station) over without.

``PYTHONPATH=benchmarks python benchmarks/bench_observe.py [--rounds N] [--node]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import attrs
import trio
from common import emit

import asyncflow_actors as afa
from asyncflow_actors import observe
from asyncflow_actors.observe import demo

PIPELINE = demo.DemoConfig(groups=384, group_size=4, batch_size=16, staleness=1, rollout_workers=2)


@attrs.frozen
class Round:
    samples: int
    wall_s: float
    cpu_s: float


async def measure_overhead(
    round_: Callable[[bool], Awaitable[Round]], rounds: int
) -> tuple[list[Round], list[Round]]:
    """Run ``round_(trace)`` ``rounds`` times each way, alternating which goes first."""
    on: list[Round] = []
    off: list[Round] = []
    for i in range(rounds):
        for trace in (True, False) if i % 2 == 0 else (False, True):
            (on if trace else off).append(await round_(trace))
    return on, off


def span_ns(enabled: bool, n: int = 200_000) -> float:
    tracer = observe.Tracer()
    if enabled:
        tracer.enable(capacity=n + 1)
    track = tracer.track("train", "train-0")
    samples = tuple(range(16))
    t0 = time.perf_counter_ns()
    for i in range(n):
        with track.span("train", samples=samples, version=i):
            pass
    return (time.perf_counter_ns() - t0) / n


def empty_with_ns(n: int = 200_000) -> float:
    nothing = observe.NO_SPAN
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with nothing:
            pass
    return (time.perf_counter_ns() - t0) / n


async def pipeline_overhead(rounds: int) -> None:
    """``measure_overhead`` on the real pipeline: observe on (value) against off."""
    import tempfile

    from asyncflow_actors.pipeline import PipelineConfig, run_pipeline

    def config(trace: bool, run_dir: str) -> PipelineConfig:
        return PipelineConfig.from_dict(
            {
                "mode": "async",
                "progress": "none",
                "plot": False,
                "observe": trace,
                "run_dir": run_dir if trace else None,
                "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
                "task": {"options": {"min_digits": 1, "max_digits": 2}},
                "rollout": {"group_size": 4, "max_new_tokens": 4},
                "train": {"steps": 8, "prompts_per_step": 8},
                "placement": {"default": "local"},
            }
        )

    async def one_round(trace: bool) -> Round:
        with tempfile.TemporaryDirectory() as run_dir:
            cpu = time.process_time()
            result = await run_pipeline(config(trace, run_dir))
            cpu = time.process_time() - cpu
        return Round(result.samples, result.seconds, cpu)

    await one_round(True)  # warm up
    on, off = await measure_overhead(one_round, rounds)
    on_rates, off_rates = [r.samples / r.wall_s for r in on], [r.samples / r.wall_s for r in off]
    emit("observe_trace_overhead_pipeline", statistics.median(on_rates), "samples/s",
         statistics.median(off_rates))  # fmt: skip
    print(f"# pipeline on: {[round(x) for x in on_rates]} off: {[round(x) for x in off_rates]}",
          file=sys.stderr)  # fmt: skip


async def main(rounds: int, on_node: bool) -> None:
    async with afa.open_actor_system() as system:
        node = None
        if on_node:
            node = await system.start_node("engine", allow=["asyncflow_actors.observe"])

        async def one_round(trace: bool) -> Round:
            config = observe.ObserveConfig(trace=trace, interval=0.5)
            async with observe.open_observer(system, config) as obs:
                if node is not None:
                    await obs.attach_node(node)
                cpu = time.process_time()
                result = await demo.run_demo(system, PIPELINE, observer=obs, engine_node=node)
                cpu = time.process_time() - cpu
            return Round(result.samples, result.seconds, cpu)

        await one_round(True)  # warm up: imports, first TQ, caches
        on, off = await measure_overhead(one_round, rounds)
    for name, unit, rate in (
        ("observe_trace_overhead", "samples/s", lambda r: r.samples / r.wall_s),
        ("observe_trace_overhead_cpu", "samples/cpu-s", lambda r: r.samples / r.cpu_s),
    ):
        on_rates, off_rates = [rate(r) for r in on], [rate(r) for r in off]
        emit(name, statistics.median(on_rates), unit, statistics.median(off_rates))
        print(
            f"# {name} on: {[round(x) for x in on_rates]} off: {[round(x) for x in off_rates]}",
            file=sys.stderr,
        )
    off_med = statistics.median(r.samples / r.wall_s for r in off)
    base = statistics.median(empty_with_ns() for _ in range(5))
    off_ns = statistics.median(span_ns(False) for _ in range(5))
    on_ns = statistics.median(span_ns(True) for _ in range(5))
    emit("observe_span_off_ns", off_ns, "ns", base)
    emit("observe_span_on_ns", on_ns, "ns", base)
    # Spans per sample in the demo: rollout (+ put, acquire) per group, and per batch forward,
    # its engine span, advantage, train, three gets and three sync phases.
    per_sample = 3 / PIPELINE.group_size + 10 / PIPELINE.batch_size
    emit("observe_span_off_share", per_sample * off_ns * 1e-9 * off_med * 100, "%")
    await pipeline_overhead(max(3, rounds // 2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--node", action="store_true", help="forward engine on a node process")
    args = parser.parse_args()
    trio.run(main, args.rounds, args.node)

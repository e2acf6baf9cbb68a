"""A hypothesis state machine over weight syncs, engine decoding and failures.

Two or three engine doubles (lazy or eager, each decoding all the time: every token encodes the
weight version it came from) receive syncs of random pause modes, some of which meet a fault: the
sender cancelled at a phase, a receiver killed at a bucket, a pause past its deadline, a
corrupted bucket. A plain model predicts each sync's outcome and each engine's version. The
promises checked after every step: every engine is resumed and decoding; every receiver holds
exactly one complete version (nothing staged or pending left); no token ever came from weights of
two versions or from a paused engine; the broadcast never started before every pause was
acknowledged; and the next sync succeeds (a fault-free sync always does).

The actor system runs in a helper thread under a ``MockClock``; a rule's coroutine runs with the
clock jumping (autojump) and the clock stands still between rules.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import (
    CheckpointConfig,
    CheckpointEngine,
    PauseMode,
    PhaseDeadlines,
    SyncFailed,
    plan_buckets,
)
from asyncflow_actors.checkpoint._manifest import spec_of
from tests.checkpoint.doubles import DoubleActor, World, weights_of

T = TypeVar("T")

DEADLINES = PhaseDeadlines(pause=10, prepare=10, topology=10, broadcast=10, finalize=10, resume=10)
BATCH, TICK = 4, 1.0
SETTLE = 3 * BATCH * TICK  # long enough for every engine to pass a batch boundary
SLOW = 50.0  # a pause this much slower than the pause deadline
CANCEL_BEFORE_COMMIT = ("SyncPause", "SyncPrepare", "PutBucket", "SyncFinalize")


class Harness:
    """The actor system in a helper thread; ``run`` executes a coroutine there."""

    def __init__(self, loads: list[str], bucket_bytes: int) -> None:
        self.clock = trio.testing.MockClock()
        self.world = World()
        self.loads = loads
        self.bucket_bytes = bucket_bytes
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._thread_main, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _thread_main(self) -> None:
        try:
            trio.run(self._main, clock=self.clock)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._done = trio.Event()
        async with afa.open_actor_system() as system:
            refs = []
            for i, load in enumerate(self.loads):
                refs.append(
                    await system.spawn(
                        lambda i=i, load=load: DoubleActor(  # type: ignore[misc]
                            load=load,
                            tick=TICK,
                            batch_tokens=BATCH,
                            offload=False,
                            index=i,
                            world=self.world,
                        ),
                        name=f"engine-{i}",
                        restart=afa.Restart.PERMANENT,
                    )
                )
            config = CheckpointConfig(
                bucket_bytes=self.bucket_bytes, deadlines=DEADLINES, offload=False
            )
            self.engine = CheckpointEngine(refs, config)
            self.token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._done.wait()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        async def jumping() -> T:
            self.clock.autojump_threshold = 0
            try:
                return await fn(*args)
            finally:
                self.clock.autojump_threshold = math.inf

        return trio.from_thread.run(jumping, trio_token=self.token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._done.set, trio_token=self.token)
        self._thread.join(20)
        assert not self._thread.is_alive(), "the actor system did not shut down"
        if self._error is not None:
            raise self._error


@attrs.frozen
class Fault:
    kind: str  # "none" | "cancel" | "kill" | "slow" | "corrupt"
    engine: int = 0
    bucket: int = 0
    message: str = ""


FAULTS = st.one_of(
    st.just(Fault("none")),
    st.builds(
        Fault, st.just("cancel"), message=st.sampled_from([*CANCEL_BEFORE_COMMIT, "SyncResume"])
    ),
    st.builds(Fault, st.just("kill"), st.integers(0, 2), st.integers(0, 6)),
    st.builds(Fault, st.just("slow"), st.integers(0, 2)),
    st.builds(Fault, st.just("corrupt"), st.integers(0, 2), st.integers(0, 6)),
)


class SyncMachine(RuleBasedStateMachine):
    harness: Harness | None = None

    @initialize(
        loads=st.lists(st.sampled_from(["lazy", "eager"]), min_size=2, max_size=3),
        bucket_bytes=st.sampled_from([64, 200, 4096]),
    )
    def start(self, loads: list[str], bucket_bytes: int) -> None:
        self.harness = Harness(loads, bucket_bytes)
        self.n = len(loads)
        self.versions = [-1] * self.n
        self.next_version = 0
        specs = [spec_of(name, t) for name, t in weights_of(0).items()]
        self.buckets = len(plan_buckets(specs, bucket_bytes).buckets)
        self.tokens = [0] * self.n

    def teardown(self) -> None:
        if self.harness is not None:
            self.harness.close()

    def expect(self, fault: Fault) -> str:
        if fault.kind == "cancel":
            return "ok" if fault.message == "SyncResume" else "cancelled"
        if fault.kind == "slow":
            return "failed:pause"
        if fault.kind in ("kill", "corrupt") and fault.bucket < self.buckets:
            return "failed:broadcast" if fault.kind == "kill" else "failed:finalize"
        return "ok"

    @rule(mode=st.sampled_from(list(PauseMode)), fault=FAULTS)
    def sync(self, mode: PauseMode, fault: Fault) -> None:
        assert self.harness is not None
        engine_index = fault.engine % self.n
        version = self.next_version
        self.next_version += 1
        world = self.harness.world

        async def attempt() -> str:
            world.log.clear()
            if fault.kind == "cancel":
                world.cancel_on = fault.message
            elif fault.kind == "kill":
                world.crash_engine, world.crash_on_bucket = engine_index, fault.bucket
            elif fault.kind == "slow":
                world.engines[engine_index].pause_delay = SLOW
            elif fault.kind == "corrupt":
                world.corrupt_engine, world.corrupt_bucket = engine_index, fault.bucket
            engine = self.harness.engine  # type: ignore[union-attr]
            engine.config = attrs.evolve(engine.config, pause_mode=mode)
            outcome = "ok"
            with trio.CancelScope() as world.scope:
                try:
                    await engine.sync(version, weights_of(version))
                except SyncFailed as exc:
                    outcome = f"failed:{exc.phase}"
            if world.scope.cancelled_caught:
                outcome = "cancelled"
            world.cancel_on = world.crash_engine = world.corrupt_engine = None
            await trio.sleep(SETTLE + (SLOW if fault.kind == "slow" else 0))
            world.engines[engine_index].pause_delay = 0.0
            return outcome

        expected = self.expect(fault)
        before = list(self.tokens)
        assert self.harness.run(attempt) == expected, fault
        if expected == "ok":
            self.versions = [version] * self.n
        elif fault.kind == "kill":
            self.versions[engine_index] = -1  # a fresh incarnation
        self.engines_run_on_one_complete_version()
        for i in range(self.n):  # resumed: every engine decoded since (a killed one anew)
            assert self.tokens[i] > before[i] or (fault.kind == "kill" and i == engine_index), i
        log = world.log
        if any(kind == "bucket" for kind, _ in log):
            first = next(i for i, (kind, _) in enumerate(log) if kind == "bucket")
            assert {("acked", i) for i in range(self.n)} <= set(log[:first])

    @rule(seconds=st.sampled_from([1.0, SETTLE]))
    def decode(self, seconds: float) -> None:
        assert self.harness is not None
        self.harness.run(trio.sleep, seconds)

    @invariant()
    def engines_run_on_one_complete_version(self) -> None:
        if self.harness is None:
            return
        world = self.harness.world

        async def inspect() -> list[Any]:
            await trio.lowlevel.checkpoint()
            return [
                (
                    e.paused,
                    e.version,
                    list(e.violations),
                    len(e.tokens),
                    world.receivers[i].statistics(),
                )
                for i, e in sorted(world.engines.items())
            ]

        states = self.harness.run(inspect)
        assert len(states) == self.n
        for i, (paused, version, violations, tokens, stats) in enumerate(states):
            assert not paused and not stats.paused, f"engine {i} left paused"
            assert stats.sync_id is None and stats.pending_version is None, stats
            assert version == self.versions[i], (i, version, self.versions)
            assert not violations, violations
            self.tokens[i] = tokens


SyncMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSyncProtocol = SyncMachine.TestCase

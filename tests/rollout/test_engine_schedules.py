"""A hypothesis schedule of generate / pause / resume / load_weights / cancel calls, replayed
against a running torch engine.

The model is `version_model`: each token reveals the version of the weights that produced it,
so "every token's version is the version of the weights that produced it" is checked token by
token. Promises checked: every request is answered exactly once (or was cancelled by its
caller); nothing is generated while paused; when a pause returns, ``DRAIN`` has finished every
request submitted before it, ``WAIT_BATCH`` and ``ABORT`` every running one (``ABORT`` with its
prefix), ``KEEP`` holds the running ones frozen; aborted requests resume from their prefix with
the reduced budget; versions never go backwards within a completion.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_actors.checkpoint import PauseMode
from asyncflow_actors.rollout import (
    Completion,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingConfig,
    open_torch_engine,
)

from .kit import version_head, version_model, version_token

ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 40)),
    st.tuples(st.just("pause"), st.sampled_from(list(PauseMode))),
    st.tuples(st.just("resume")),
    st.tuples(st.just("load")),
    st.tuples(st.just("run"), st.integers(1, 8)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
)

MODEL = version_model()


class Replay:
    def __init__(self, engine: Any, nursery: trio.Nursery) -> None:
        self.engine = engine
        self.nursery = nursery
        self.version = 0
        self.paused: PauseMode | None = None
        self.requests: dict[str, GenerationRequest] = {}
        self.answers: dict[str, list[Completion]] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.cancelled: set[str] = set()
        self.count = 0

    async def caller(self, req: GenerationRequest, *, task_status: Any) -> None:
        with trio.CancelScope() as scope:
            self.scopes[req.request_id] = scope
            task_status.started()
            completion = await self.engine.generate(req)
            self.answers.setdefault(req.request_id, []).append(completion)
            if completion.finish_reason is FinishReason.ABORTED:
                assert len(completion.token_ids) < req.sampling.max_new_tokens
                await self.submit(req.continue_from(completion))

    async def submit(self, req: GenerationRequest) -> None:
        self.requests[req.request_id] = req
        await self.nursery.start(self.caller, req)

    def pending(self) -> set[str]:
        return {
            rid
            for rid in self.requests
            if rid not in self.cancelled
            and not any(
                a.finish_reason is not FinishReason.ABORTED for a in self.answers.get(rid, [])
            )
        }

    async def step(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        engine = self.engine
        if kind == "submit":
            self.count += 1
            await self.submit(
                GenerationRequest(
                    [1], SamplingConfig(op[1], seed=self.count), request_id=f"q{self.count}"
                )
            )
        elif kind == "pause":
            before = self.pending()
            ack = await engine.pause(op[1])
            await trio.testing.wait_all_tasks_blocked()
            if self.paused is not None:
                assert ack.mode is self.paused  # idempotent: the first pause's acknowledgement
                return
            self.paused = op[1]
            stats = engine.statistics()
            assert stats.paused and ack.version == self.version
            if op[1] is PauseMode.DRAIN:
                assert not (before & self.pending()) and stats.running == 0
            elif op[1] in (PauseMode.ABORT, PauseMode.WAIT_BATCH):
                assert stats.running == 0 and ack.in_flight == 0
            else:
                # KEEP freezes what runs when the pause lands: the acknowledgement counts exactly
                # those (the decode thread may finish a request between any earlier look and the
                # pause, so the count is compared with the engine's own state, not a sample
                # taken before), and "run" checks that nothing moves while paused.
                assert ack.in_flight == stats.running
                assert stats.running <= len(before)
        elif kind == "resume":
            await engine.resume()
            self.paused = None
        elif kind == "load":
            self.version += 1
            await engine.load_weights(
                {"lm_head.weight": version_head(MODEL, self.version)}, self.version
            )
            assert engine.version == self.version
        elif kind == "run":
            tokens = engine.statistics().generated_tokens
            await trio.sleep(op[1] * 1e-3)
            if self.paused is not None:
                assert engine.statistics().generated_tokens == tokens
        elif kind == "cancel":
            live = sorted(self.pending())
            if live:
                rid = live[op[1] % len(live)]
                self.cancelled.add(rid)
                self.scopes[rid].cancel()

    def check_final(self) -> None:
        for rid, req in self.requests.items():
            answers = self.answers.get(rid, [])
            if rid in self.cancelled:
                assert len(answers) <= 1
                continue
            assert answers, rid
            *partial, done = answers
            assert all(a.finish_reason is FinishReason.ABORTED for a in partial)
            assert done.finish_reason is not FinishReason.ABORTED and done.resumes == len(partial)
            assert len(done.token_ids) <= req.sampling.max_new_tokens
            if done.finish_reason is FinishReason.LENGTH:
                assert len(done.token_ids) == req.sampling.max_new_tokens
            assert done.token_ids[: len(req.prefix_ids)] == req.prefix_ids
            assert done.versions[: len(req.prefix_ids)] == req.prefix_versions
            assert done.token_ids == tuple(version_token(v) for v in done.versions)
            assert list(done.versions) == sorted(done.versions)
            assert set(done.versions) <= set(range(self.version + 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=25))
def test_engine_schedule(schedule: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        config = EngineConfig(max_batch=3, max_run_seconds=5e-4, max_resumes=100)
        MODEL.lm_head.weight.data.copy_(version_head(MODEL, 0))
        async with open_torch_engine(MODEL, config) as engine:
            async with trio.open_nursery() as nursery:
                replay = Replay(engine, nursery)
                for op in schedule:
                    await replay.step(op)
                await engine.resume()
            replay.check_final()

    trio.run(main)

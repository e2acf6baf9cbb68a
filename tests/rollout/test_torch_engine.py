"""The built-in engine: exact decoding, continuous batching, pause modes, partial rollout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch
import trio
import trio.lowlevel
import trio.testing

from asyncflow_actors.checkpoint import PauseMode, SyncTarget
from asyncflow_actors.models import token_logprobs
from asyncflow_actors.rollout import (
    Completion,
    EngineClosed,
    EngineConfig,
    FinishReason,
    GenerationEngine,
    GenerationRequest,
    RequestError,
    ResumeLimitError,
    SamplingConfig,
    WeightLoadError,
    generate_samples,
    generate_with_resume,
    open_torch_engine,
)

from .kit import EOS, tiny_model, version_head, version_model, version_token


def requests(n: int, *, temperature: float = 1.0, budget: int = 24) -> list[GenerationRequest]:
    out = []
    for i in range(n):
        prompt = [1] + [3 + (i * 7 + j) % 20 for j in range(1 + i % 5)]
        sampling = SamplingConfig(
            max_new_tokens=budget - (i % 3) * 5, temperature=temperature, top_k=i % 2 * 8, seed=i
        )
        out.append(GenerationRequest(prompt, sampling, request_id=f"r{i}"))
    return out


async def run_all(engine: GenerationEngine, reqs: list[GenerationRequest]) -> dict[str, Completion]:
    results: dict[str, Completion] = {}

    async def one(req: GenerationRequest) -> None:
        results[req.request_id] = await engine.generate(req)

    async with trio.open_nursery() as nursery:
        for req in reqs:
            nursery.start_soon(one, req)
    return results


async def test_engine_is_a_sync_target_and_generation_engine() -> None:
    async with open_torch_engine(tiny_model()) as engine:
        assert isinstance(engine, SyncTarget)
        assert isinstance(engine, GenerationEngine)
        assert engine.version == 0


async def test_cached_decoding_matches_full_recomputation() -> None:
    model = tiny_model()
    reqs = requests(6, temperature=1.0) + [
        attrs.evolve(r, request_id=f"g{i}", sampling=attrs.evolve(r.sampling, temperature=0.0))
        for i, r in enumerate(requests(4))
    ]
    async with open_torch_engine(model, EngineConfig(max_batch=4, eos_id=EOS)) as engine:
        results = await run_all(engine, reqs)
    for req in reqs:
        done = results[req.request_id]
        ids = torch.tensor([list(req.prompt_ids) + list(done.token_ids)])
        n = len(done.token_ids)
        full = token_logprobs(model, ids, response_length=n).logprobs[0]
        if req.sampling.top_k == 0 or req.sampling.greedy:
            # the sampling distribution is the plain softmax: logprobs agree with a full pass
            torch.testing.assert_close(torch.tensor(done.logprobs), full, atol=1e-4, rtol=0)
        if req.sampling.greedy:
            logits = model(ids)[0, len(req.prompt_ids) - 1 : -1]
            assert done.token_ids == tuple(logits.argmax(-1).tolist())
        assert done.finish_reason is (
            FinishReason.STOP if done.token_ids[-1] == EOS else FinishReason.LENGTH
        )
        assert n <= req.sampling.max_new_tokens
        assert done.versions == (0,) * n


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(max_batch=3, eos_id=EOS, kv_capacity=40),  # compaction on the way
        EngineConfig(max_batch=4, eos_id=EOS, batching="static"),
        EngineConfig(max_batch=4, eos_id=EOS, kv_cache=False),
    ],
    ids=["continuous", "static", "no-cache"],
)
async def test_batched_generation_equals_one_at_a_time(config: EngineConfig) -> None:
    model = tiny_model()
    reqs = requests(10)
    async with open_torch_engine(model, EngineConfig(max_batch=1, eos_id=EOS)) as engine:
        alone = {r.request_id: await engine.generate(r) for r in reqs}
    async with open_torch_engine(model, config) as engine:
        together = await run_all(engine, reqs)
    for req in reqs:
        a, b = alone[req.request_id], together[req.request_id]
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )


async def test_a_long_request_does_not_hold_back_short_ones() -> None:
    model = tiny_model()
    long = GenerationRequest([1, 4], SamplingConfig(80, seed=0), request_id="long")
    short = [GenerationRequest([1, 5 + i], SamplingConfig(4, seed=i)) for i in range(12)]
    order: list[str] = []

    async def one(req: GenerationRequest) -> None:
        await engine.generate(req)
        order.append(req.request_id)

    async with open_torch_engine(model, EngineConfig(max_batch=2)) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, long)
            while engine.statistics().running == 0:
                await trio.lowlevel.checkpoint()
            for req in short:
                nursery.start_soon(one, req)
        steps = engine.statistics().steps
    # all twelve short ones went through the second slot while the long one ran
    assert order[-1] == "long"
    assert steps == 80


async def test_samples_of_a_prompt_are_reproducible_and_distinct() -> None:
    model = tiny_model()
    req = GenerationRequest([1, 4, 5], SamplingConfig(12, n=4, seed=7), request_id="p")
    async with open_torch_engine(model, EngineConfig(max_batch=3)) as engine:
        first = await generate_samples(engine, req)
        second = await generate_samples(engine, req)
    assert [c.request_id for c in first] == ["p/0", "p/1", "p/2", "p/3"]
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({c.token_ids for c in first}) > 1


class OneByOne:
    """An engine without ``generate_many``: ``generate_samples`` runs a task per sample."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerationRequest) -> Completion:
        return await self.engine.generate(request)


async def test_a_group_at_once_matches_a_task_per_sample() -> None:
    req = GenerationRequest([1, 4, 5], SamplingConfig(12, n=6, seed=7), request_id="p")
    async with open_torch_engine(tiny_model(), EngineConfig(max_batch=4)) as engine:
        grouped = await generate_samples(engine, req)
        single = await generate_samples(OneByOne(engine), req)  # type: ignore[arg-type]
        many = await engine.generate_many(req.expand())
    assert [c.request_id for c in grouped] == [f"p/{i}" for i in range(6)]
    # the same tokens; the log-probs up to float rounding (other rows share the batch)
    for a, b, c in zip(grouped, single, many, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-5)


async def test_generate_samples_resumes_what_an_abort_returned_from_a_group() -> None:
    model = version_model()
    req = GenerationRequest([1, 3], SamplingConfig(60, n=5, seed=2))
    config = EngineConfig(max_batch=3, max_run_seconds=1e-3)
    out: list[Completion] = []
    async with open_torch_engine(model, config) as engine:

        async def run() -> None:
            out.extend(await generate_samples(engine, req))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while engine.statistics().generated_tokens < 9:
                await trio.sleep(0.001)
            ack = await engine.pause(PauseMode.ABORT)
            await engine.load_weights({"lm_head.weight": version_head(model, 1)}, 1)
            await engine.resume()
    assert ack.aborted == 3  # the three rows running; the other two waited
    assert [c.finish_reason for c in out] == [FinishReason.LENGTH] * 5
    assert sorted(c.resumes for c in out) == [0, 0, 1, 1, 1]
    for c in out:
        assert len(c.token_ids) == 60
        assert c.token_ids == tuple(version_token(v) for v in c.versions)
        assert (c.oldest_version, c.newest_version) == ((0, 1) if c.resumes else (1, 1))


async def test_cancelling_generate_many_drops_every_request() -> None:
    req = GenerationRequest([1, 3], SamplingConfig(60, n=5, seed=2))
    config = EngineConfig(max_batch=3, max_run_seconds=1e-3)
    async with open_torch_engine(tiny_model(), config) as engine:
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await engine.generate_many(req.expand())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            while engine.statistics().generated_tokens < 3:  # 60 a sample: none finished
                await trio.sleep(0.001)
            scope.cancel()
        assert scope.cancelled_caught
        stats = engine.statistics()
        assert (stats.waiting, stats.completed) == (0, 0)
        while engine.statistics().running:  # the rows free at the stretch's end
            await trio.sleep(0.001)
        again = await engine.generate_many(req.expand()[:2])
    assert [c.finish_reason for c in again] == [FinishReason.LENGTH] * 2


async def test_stream_deltas_add_up_to_the_completion() -> None:
    config = EngineConfig(max_run_seconds=1e-4)
    request = GenerationRequest([1, 3], SamplingConfig(30, seed=1))
    async with (
        open_torch_engine(tiny_model(), config) as engine,
        engine.open_stream(request) as stream,
    ):
        deltas = [d async for d in stream]
        completion = stream.completion
    assert len(deltas) > 1
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason is completion.finish_reason
    assert sum((d.token_ids for d in deltas), ()) == completion.token_ids
    assert sum((d.versions for d in deltas), ()) == completion.versions


async def test_load_weights_checks_everything_before_changing_anything() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    async with open_torch_engine(model) as engine:
        bad_shape = {
            "norm.weight": torch.ones(3),
            "lm_head.weight": torch.zeros_like(before["lm_head.weight"]),
        }
        with pytest.raises(WeightLoadError, match=r"norm\.weight"):
            await engine.load_weights(bad_shape, 1)
        with pytest.raises(WeightLoadError, match="nope"):
            await engine.load_weights({"nope": torch.ones(1), "norm.weight": torch.ones(32)}, 1)
        assert engine.version == 0
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
        # a subset, in another dtype: converted, swapped, versioned
        await engine.load_weights({"norm.weight": torch.full((32,), 2.0, dtype=torch.float64)}, 5)
        assert engine.version == 5
        assert torch.equal(model.norm.weight, torch.full((32,), 2.0))
        assert engine.statistics().weight_loads == 1


async def test_load_while_running_swaps_between_steps() -> None:
    model = version_model()
    config = EngineConfig(max_batch=4, max_run_seconds=1e-3)
    request = GenerationRequest([1], SamplingConfig(100, seed=0))
    async with open_torch_engine(model, config) as engine, engine.open_stream(request) as stream:
        seen = 0
        async for delta in stream:
            seen += len(delta.token_ids)
            if seen >= 10 and engine.version == 0:
                await engine.load_weights({"lm_head.weight": version_head(model, 1)}, 1)
        done = stream.completion
    assert done.versions[:10] == (0,) * 10
    assert 0 < done.versions.index(1) < 100
    assert done.token_ids == tuple(version_token(v) for v in done.versions)
    assert (done.oldest_version, done.newest_version) == (0, 1)
    assert list(done.versions) == sorted(done.versions)


async def test_a_load_returns_once_swapped_not_after_the_running_rows_next_stretch() -> None:
    """A long tail keeps decoding while new weights load; the groups waiting for them start
    when the swap is in, not when the tail's stretch ends (here: never before the tail
    finishes, as ``max_run_seconds`` is long)."""
    model = version_model(max_seq_len=4096)  # a tail far longer than the load takes
    config = EngineConfig(max_batch=4, max_run_seconds=60.0)
    request = GenerationRequest([1], SamplingConfig(4000, seed=0))
    async with open_torch_engine(model, config) as engine, engine.open_stream(request):
        while engine.statistics().running == 0:
            await trio.sleep(1e-3)  # admitted: its first stretch runs
        await engine.load_weights({"lm_head.weight": version_head(model, 1)}, 1)
        stats = engine.statistics()
        assert (stats.version, stats.running, stats.completed) == (1, 1, 0)
        # leaving the block cancels the tail (``test_load_while_running_swaps_between_steps``
        # follows a request to its end across a load)


async def test_drain_finishes_everything_submitted_before_it() -> None:
    async with open_torch_engine(tiny_model(), EngineConfig(max_batch=2)) as engine:
        results: dict[str, Completion] = {}

        async def one(req: GenerationRequest) -> None:
            results[req.request_id] = await engine.generate(req)

        async with trio.open_nursery() as nursery:
            for req in requests(5):
                nursery.start_soon(one, req)
            await trio.sleep(0.01)
            ack = await engine.pause(PauseMode.DRAIN)
            await trio.testing.wait_all_tasks_blocked()  # the callers saw their results
            assert sorted(results) == [f"r{i}" for i in range(5)]
            assert ack == (await engine.pause(PauseMode.DRAIN))  # idempotent
            assert (ack.mode, ack.in_flight, ack.aborted) == (PauseMode.DRAIN, 0, 0)
            late = GenerationRequest([1, 3], SamplingConfig(3), request_id="late")
            nursery.start_soon(one, late)
            await trio.sleep(0.05)
            assert "late" not in results  # waits while paused
            assert engine.statistics().paused and engine.statistics().waiting == 1
            await engine.resume()
            await engine.resume()  # idempotent
    assert all(c.finish_reason is not FinishReason.ABORTED for c in results.values())
    assert "late" in results


async def test_wait_batch_lets_queued_requests_wait() -> None:
    async with open_torch_engine(tiny_model(), EngineConfig(max_batch=2)) as engine:
        results: dict[str, Completion] = {}

        async def one(req: GenerationRequest) -> None:
            results[req.request_id] = await engine.generate(req)

        async with trio.open_nursery() as nursery:
            for req in requests(5, budget=40):
                nursery.start_soon(one, req)
            while engine.statistics().running < 2:
                await trio.sleep(0.001)
            ack = await engine.pause(PauseMode.WAIT_BATCH)
            await trio.testing.wait_all_tasks_blocked()
            assert ack.in_flight == 0
            stats = engine.statistics()
            assert len(results) == 2 and stats.waiting == 3 and stats.running == 0
            await engine.resume()
    assert len(results) == 5


async def test_abort_returns_prefixes_that_resume_with_the_reduced_budget() -> None:
    model = version_model()
    async with open_torch_engine(model, EngineConfig(max_batch=4, max_run_seconds=1e-3)) as engine:
        aborted: list[Completion] = []
        reqs = [GenerationRequest([1, 3 + i], SamplingConfig(60, seed=i)) for i in range(3)]

        async def one(req: GenerationRequest) -> None:
            aborted.append(await engine.generate(req))

        async with trio.open_nursery() as nursery:
            for req in reqs:
                nursery.start_soon(one, req)
            while engine.statistics().generated_tokens < 9:
                await trio.sleep(0.001)
            ack = await engine.pause(PauseMode.ABORT)
        assert (ack.mode, ack.aborted, ack.in_flight) == (PauseMode.ABORT, 3, 0)
        assert engine.statistics().aborted == 3
        await engine.load_weights({"lm_head.weight": version_head(model, 1)}, 1)
        await engine.resume()
        finals = []
        for first in aborted:
            req = next(r for r in reqs if r.request_id == first.request_id)
            assert first.finish_reason is FinishReason.ABORTED
            assert 0 < len(first.token_ids) < 60 and set(first.versions) == {0}
            resumed = req.continue_from(first)
            assert resumed.remaining_tokens == 60 - len(first.token_ids)
            final = await engine.generate(resumed)
            finals.append(final)
            assert final.token_ids[: len(first.token_ids)] == first.token_ids
            assert final.logprobs[: len(first.token_ids)] == first.logprobs
            assert len(final.token_ids) == 60 and final.finish_reason is FinishReason.LENGTH
            assert final.versions == (0,) * len(first.token_ids) + (1,) * (
                60 - len(first.token_ids)
            )
            assert final.token_ids == tuple(version_token(v) for v in final.versions)
            assert (final.oldest_version, final.newest_version, final.resumes) == (0, 1, 1)
            assert final.staleness(1) == 1


async def test_resumed_sample_matches_an_uninterrupted_one_on_the_same_weights() -> None:
    model = tiny_model()
    req = GenerationRequest([1, 4, 9], SamplingConfig(40, seed=3))
    async with open_torch_engine(model, EngineConfig(max_run_seconds=1e-3)) as engine:
        whole = await engine.generate(req)
        async with trio.open_nursery() as nursery:
            box: list[Completion] = []

            async def one() -> None:
                box.append(await engine.generate(req))

            nursery.start_soon(one)
            while engine.statistics().generated_tokens < whole.token_ids.__len__() + 5:
                await trio.sleep(0.0005)
            await engine.pause(PauseMode.ABORT)
        await engine.resume()
        (part,) = box
        assert part.finish_reason is FinishReason.ABORTED and 0 < len(part.token_ids) < 40
        again = await engine.generate(req.continue_from(part))
    assert again.token_ids == whole.token_ids
    torch.testing.assert_close(
        torch.tensor(again.logprobs), torch.tensor(whole.logprobs), atol=1e-4, rtol=0
    )


async def test_keep_freezes_requests_and_continues_them_on_the_new_weights() -> None:
    model = version_model()
    async with open_torch_engine(model, EngineConfig(max_batch=4, max_run_seconds=1e-3)) as engine:
        results: list[Completion] = []

        async def one(i: int) -> None:
            results.append(
                await engine.generate(GenerationRequest([1, 3 + i], SamplingConfig(50, seed=i)))
            )

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
            while engine.statistics().generated_tokens < 6:
                await trio.sleep(0.001)
            ack = await engine.pause(PauseMode.KEEP)
            assert (ack.in_flight, ack.aborted) == (3, 0)
            frozen = engine.statistics().generated_tokens
            await trio.sleep(0.05)
            assert engine.statistics().generated_tokens == frozen and not results
            await engine.load_weights({"lm_head.weight": version_head(model, 1)}, 1)
            assert engine.statistics().generated_tokens == frozen
            await engine.resume()
    assert len(results) == 3
    for done in results:
        assert done.finish_reason is FinishReason.LENGTH and len(done.token_ids) == 50
        assert done.oldest_version == 0 and done.newest_version == 1
        assert done.token_ids == tuple(version_token(v) for v in done.versions)


async def test_cancelled_request_frees_its_slot() -> None:
    async with open_torch_engine(tiny_model(), EngineConfig(max_batch=1)) as engine:
        with trio.move_on_after(0.01):
            await engine.generate(GenerationRequest([1, 3], SamplingConfig(90, seed=0)))
        done = await engine.generate(GenerationRequest([1, 3], SamplingConfig(5, seed=0)))
        assert len(done.token_ids) == 5
        stats = engine.statistics()
        assert (stats.running, stats.waiting, stats.completed) == (0, 0, 1)


async def test_requests_pending_at_close_fail_with_engine_closed() -> None:
    failures: list[BaseException] = []

    async def one(engine: GenerationEngine) -> None:
        try:
            await engine.generate(GenerationRequest([1, 3], SamplingConfig(90)))
        except EngineClosed as exc:
            failures.append(exc)

    config = EngineConfig(max_batch=1)
    async with trio.open_nursery() as nursery, open_torch_engine(tiny_model(), config) as engine:
        for _ in range(3):
            nursery.start_soon(one, engine)
        await trio.sleep(0.01)
    assert len(failures) == 3
    with pytest.raises(EngineClosed):
        await engine.generate(GenerationRequest([1, 3], SamplingConfig(3)))


async def test_invalid_requests_are_refused_at_submission() -> None:
    async with open_torch_engine(
        tiny_model(max_seq_len=32), EngineConfig(max_resumes=1, eos_id=EOS)
    ) as engine:
        with pytest.raises(RequestError, match="max_seq_len"):
            await engine.generate(GenerationRequest([1] * 10, SamplingConfig(30)))
        with pytest.raises(RequestError, match="outside"):
            await engine.generate(GenerationRequest([1, 99], SamplingConfig(3)))
        with pytest.raises(RequestError, match="stop token"):
            await engine.generate(
                GenerationRequest(
                    [1],
                    SamplingConfig(5),
                    prefix_ids=[EOS],
                    prefix_logprobs=[0.0],
                    prefix_versions=[0],
                )
            )
        with pytest.raises(ResumeLimitError):
            await engine.generate(GenerationRequest([1], SamplingConfig(5), resumes=2))
        assert engine.statistics().waiting == 0


async def test_generate_with_resume_rides_through_aborts() -> None:
    model = version_model()
    async with open_torch_engine(model, EngineConfig(max_run_seconds=1e-3)) as engine:
        box: list[Completion] = []

        async def one() -> None:
            box.append(
                await generate_with_resume(
                    engine, GenerationRequest([1], SamplingConfig(40, seed=0))
                )
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            for version in (1, 2):
                while engine.statistics().generated_tokens < 10 * version:
                    await trio.sleep(0.0005)
                await engine.pause(PauseMode.ABORT)
                await engine.load_weights({"lm_head.weight": version_head(model, version)}, version)
                await engine.resume()
    (done,) = box
    assert done.resumes == 2 and len(done.token_ids) == 40
    assert done.token_ids == tuple(version_token(v) for v in done.versions)
    assert set(done.versions) == {0, 1, 2}


class _StepCPU(trio.abc.Instrument):
    """The CPU time the trio thread spends in each task step (waiting for a CPU, or for the
    GIL, costs none: a loaded machine does not inflate it, work done on the loop does)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.task = ""
        self._t0: float | None = None  # the step that adds the instrument has no "before"

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0 = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._t0 is None:
            return
        spent = time.thread_time() - self._t0
        if spent > self.longest:
            self.longest, self.task = spent, task.name


async def test_event_loop_stays_responsive_while_decoding() -> None:
    # Long stretches in the decode thread (0.3 s): an engine decoding on the event loop would
    # spend that much of the loop thread's CPU in one task step. The decoding must outlast one
    # stretch; how many requests that takes depends on the machine's speed (a fast one decoded
    # 64 x 120 tokens in 0.29 s), so waves of them go in until it has.
    model = tiny_model(d_model=64, n_layers=2, max_seq_len=128)
    config = EngineConfig(max_batch=32, max_run_seconds=0.3)
    steps = _StepCPU()
    ticks = waves = 0
    decode_cpu = 0.0
    async with open_torch_engine(model, config) as engine:
        trio.lowlevel.add_instrument(steps)
        try:
            while decode_cpu <= 0.45 and waves < 10:
                reqs = [
                    GenerationRequest([1, 3 + i % 9], SamplingConfig(120, seed=64 * waves + i))
                    for i in range(64)
                ]
                waves += 1
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run_all, engine, reqs)
                    cpu0, loop0 = time.process_time(), time.thread_time()
                    while engine.statistics().completed < 64 * waves:
                        await trio.sleep(0.002)
                        ticks += 1
                    decode_cpu += (time.process_time() - cpu0) - (time.thread_time() - loop0)
        finally:
            trio.lowlevel.remove_instrument(steps)
    assert decode_cpu > 0.3  # the decoding outlasted one stretch, in another thread
    assert steps.longest < 0.05, (steps.longest, steps.task)  # no step of the loop did the work
    assert ticks > 10  # and the loop kept running meanwhile


def test_a_prompt_shared_by_a_group_is_prefilled_once() -> None:
    """The admissions of a step that share a prompt (a group's samples) cost one prefill row,
    and each of their rows then decodes as if prefilled alone."""
    from asyncflow_actors.rollout._torch_engine import _TinyBackend

    model = tiny_model()
    backend = _TinyBackend(model, EngineConfig(max_batch=4, eos_id=EOS))
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        first = backend.prefill([(0, [1, 4, 5]), (2, [1, 6]), (3, [1, 4, 5]), (1, [1, 4, 5])])
        assert shapes == [(2, 3)]  # two distinct prompts, three columns
        nxt = backend.decode([(slot, 7) for slot in range(4)])
    hook.remove()
    for row, prompt in enumerate([[1, 4, 5], [1, 6], [1, 4, 5], [1, 4, 5]]):
        torch.testing.assert_close(
            first[row], model(torch.tensor([prompt]))[0, -1], atol=1e-4, rtol=0
        )
    for slot, prompt in enumerate([[1, 4, 5], [1, 4, 5], [1, 6], [1, 4, 5]]):
        alone = model(torch.tensor([[*prompt, 7]]))[0, -1]
        torch.testing.assert_close(nxt[slot], alone, atol=1e-4, rtol=0)


def test_a_process_exiting_right_after_a_cancelled_engine_exits_cleanly(tmp_path: Path) -> None:
    """The engine's block waits for its decode thread: a process that exits under a running
    decode step aborts (``terminate called without an active exception``, status 134)."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import trio\n"
        "from asyncflow_actors.rollout import EngineConfig, GenerationRequest, SamplingConfig\n"
        "from asyncflow_actors.rollout import generate_samples, open_torch_engine\n"
        "from tests.rollout.kit import tiny_model\n"
        "async def main():\n"
        "    config = EngineConfig(max_batch=256, max_run_seconds=5.0)\n"
        "    with trio.move_on_after(0.3):\n"
        "        model = tiny_model()\n"
        "        async with open_torch_engine(model, config) as engine:\n"
        "            req = GenerationRequest([1, 3], SamplingConfig(60, n=256, seed=1))\n"
        "            while True:\n"
        "                await generate_samples(engine, req)\n"
        "trio.run(main)\n"
    )
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for _ in range(3):  # the exit hits a decode step most times, not every time
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr

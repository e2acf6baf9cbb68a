"""The sender side of a vLLM weight update: how ``VLLMEngine.load_weights`` reaches vLLM's workers.

Two backends, both driven through vLLM's weight-update calls (``start_weight_update``,
``update_weights``, ``finish_weight_update(weight_version)``):

- ``afa_shm`` (the default, CPU and GPU): the tensors go into shared-memory segments
  (``_vllm_shm``) that vLLM's workers map and load themselves (``_vllm_worker``); vLLM's
  channel carries names, shapes, offsets and checksums only, as plain values: no pickle.
  Two phases: *stage* (every worker maps, checks and validates, the model untouched), then
  *commit* (every worker loads). A failure while staging raises ``WeightLoadError`` and the
  old weights keep serving; a failure inside a commit raises ``WeightCommitError`` (the
  adapter then refuses to serve: which weights a half-failed commit left is unknown).
- ``ipc`` / ``npu_ipc`` (CUDA / Ascend, co-located): vLLM's own trainer-side engine with CUDA
  IPC handles, which vLLM pickles between its own processes
  (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): an explicit opt-in, see ``open_vllm_engine``.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import trio

from ._asyncio_bridge import AsyncioThread
from ._types import EngineError, WeightLoadError
from ._vllm_shm import SegmentPool, write_segments

__all__ = ["WeightCommitError", "send_ipc", "send_shm", "worker_reason"]


class WeightCommitError(EngineError):
    """vLLM failed while loading staged weights: its model may hold a mix of versions."""


async def send_shm(
    llm: Any,
    bridge: AsyncioThread,
    weights: Mapping[str, torch.Tensor],
    version: int,
    *,
    pool: SegmentPool,
    segment_bytes: int,
    checksum: bool,
    timings: dict[str, float] | None = None,
) -> int:
    """Stage ``weights`` in vLLM's workers through shared memory, then commit them labelled
    ``version``; returns the bytes sent (``timings``, if given, gets the seconds of each phase:
    ``write``, ``stage``, ``commit``, ``label``). The caller holds vLLM paused (no step runs between
    the commit and the label). Cancellation before the commit abandons the update."""
    clock = _Clock(timings)
    plan = await trio.to_thread.run_sync(
        functools.partial(
            write_segments,
            dict(weights),
            pool=pool,
            segment_bytes=segment_bytes,
            checksum=checksum,
        )
    )
    clock.lap("write")
    try:
        # one round trip: vLLM's start_weight_update and update_weights in the worker
        await bridge.call(
            functools.partial(llm.collective_rpc, "afa_stage", args=(plan.to_wire(),))
        )
        clock.lap("stage")
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await _abandon(llm, bridge)
        if isinstance(exc, Exception):
            raise WeightLoadError(
                f"vLLM refused the weights of version {version}: {worker_reason(exc)}"
            ) from exc
        raise
    # committed and labelled whole, even if the caller is cancelled meanwhile
    with trio.CancelScope(shield=True):
        try:
            # one round trip: the commit and vLLM's finish_weight_update in the worker
            await bridge.call(functools.partial(llm.collective_rpc, "afa_commit"))
        except Exception as exc:
            await _abandon(llm, bridge)
            raise WeightCommitError(
                f"vLLM failed loading the weights of version {version}: {worker_reason(exc)}"
            ) from exc
        clock.lap("commit")
        await bridge.call(llm.update_weight_version, str(version))
        clock.lap("label")
    return plan.nbytes


class _Clock:
    """Seconds between laps, into ``timings`` (when given)."""

    def __init__(self, timings: dict[str, float] | None) -> None:
        self.timings = timings
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[name] = now - self.last
        self.last = now


async def _abandon(llm: Any, bridge: AsyncioThread) -> None:
    """End a failed update so the next one can start (the worker may have ended it already,
    then vLLM's refusal is expected and ignored)."""
    try:
        await bridge.call(llm.finish_weight_update)
    except Exception:
        pass


def worker_reason(exc: BaseException) -> str:
    """The worker's own message out of vLLM's wrapping of a failed ``collective_rpc``."""
    text = str(exc).strip()
    found = re.search(r"failed with error '(.*)', please check", text, re.DOTALL)
    if found:
        return found.group(1)
    return text.splitlines()[-1] if text else type(exc).__name__


def send_ipc(
    llm: Any, bridge: AsyncioThread, backend: str, weights: Mapping[str, torch.Tensor], version: int
) -> None:
    """Worker thread: vLLM's trainer-side IPC engine drives the four weight-update calls. The
    tensors are moved to this process's accelerator first (CUDA/NPU IPC shares device memory
    with the co-located vLLM workers)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    device = torch.accelerator.current_accelerator()
    on_device = {n: t.detach().to(device).contiguous() for n, t in weights.items()}
    if backend == "npu_ipc":
        from vllm_ascend.distributed.weight_transfer.npu_ipc_engine import (
            NPUIPCTrainerInitInfo as InitInfo,
        )
    else:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo as InitInfo
    client = _BridgeClient(llm, bridge, str(version))
    engine = WeightTransferTrainerFactory.trainer_init(
        InitInfo(rank=0), client=client, source=_mapping_source(on_device)
    )
    engine.send_weights()


class _BridgeClient:
    """vLLM's ``VLLMWeightSyncClient`` over our asyncio thread (called from a worker thread)."""

    def __init__(self, llm: Any, bridge: AsyncioThread, version: str) -> None:
        self.llm = llm
        self.bridge = bridge
        self.version = version

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
        label = weight_version if weight_version is not None else self.version
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

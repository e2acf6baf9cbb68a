"""Opening the vLLM engine: ``open_vllm_engine`` (trio) and its blocking halves
``start_vllm_engine`` / ``close_vllm_engine`` (``docs/engines.md`` §6)."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._asyncio_bridge import AsyncioThread
from ._vllm_engine import VLLMEngine, WeightTransfer
from ._vllm_lora import VLLMLora

__all__ = ["VLLM_SHUTDOWN_S", "close_vllm_engine", "open_vllm_engine", "start_vllm_engine"]

# how long vLLM may take to shut down (its own bound: its workers take ~10 s to exit on CPU)
VLLM_SHUTDOWN_S = 10.0

_WORKER_EXTENSION = "asyncflow_actors.rollout._vllm_worker.WorkerExtension"
_AUTO: Any = object()  # eos_id: the model config's


def _engine_args(
    engine_args: Mapping[str, Any], weight_transfer: WeightTransfer | None, lora: VLLMLora | None
) -> dict[str, Any]:
    from vllm.config import WeightTransferConfig

    args = dict(engine_args)
    if lora is not None:
        for key, value in lora.engine_args().items():
            args.setdefault(key, value)
    if weight_transfer is not None:
        args.setdefault("weight_transfer_config", WeightTransferConfig(backend=weight_transfer))
    if weight_transfer in ("ipc", "npu_ipc"):
        # inherited by vLLM's engine-core process: see open_vllm_engine
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    args.setdefault("worker_extension_cls", _WORKER_EXTENSION)
    args.setdefault("logprobs_mode", "processed_logprobs")
    return args


def start_vllm_engine(
    engine_args: Mapping[str, Any],
    *,
    weight_transfer: WeightTransfer | None = "afa_shm",
    version: int = 0,
    max_resumes: int = 4,
    eos_id: Any = _AUTO,
    trust_vllm_ipc_pickle: bool = False,
    segment_bytes: int = 256 << 20,
    checksum: bool = True,
    lora: VLLMLora | None = None,
) -> VLLMEngine:
    """Blocking form of ``open_vllm_engine`` (no trio run needed: e.g. a test session's
    shared engine); ``close_vllm_engine`` shuts it down. Arguments as ``open_vllm_engine``."""
    if weight_transfer in ("ipc", "npu_ipc") and not trust_vllm_ipc_pickle:
        raise ValueError(
            f"weight_transfer={weight_transfer!r} makes vLLM pickle CUDA/NPU IPC handles between "
            "its own processes (VLLM_ALLOW_INSECURE_SERIALIZATION=1); pass "
            "trust_vllm_ipc_pickle=True to allow it, or use weight_transfer='afa_shm'"
        )
    if lora is not None and weight_transfer != "afa_shm":
        raise ValueError(f"lora= syncs through weight_transfer='afa_shm', not {weight_transfer!r}")
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = _engine_args(engine_args, weight_transfer, lora)
    bridge = AsyncioThread()
    bridge.start()
    llm: Any = None
    try:

        async def create() -> Any:
            made = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
            await made.update_weight_version(str(version))
            if weight_transfer == "afa_shm":
                from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

                await made.init_weight_transfer_engine(
                    WeightTransferInitRequest(init_info={"checksum": checksum})
                )
            if lora is not None:
                _check_targets(lora, await made.collective_rpc("afa_lora_modules"))
            return made

        llm = bridge.call_blocking(create)
        if eos_id is _AUTO:
            eos = getattr(llm.model_config.hf_config, "eos_token_id", None)
            eos_id = eos if isinstance(eos, int) else None
        return VLLMEngine(
            llm,
            bridge,
            weight_transfer=weight_transfer,
            version=version,
            max_resumes=max_resumes,
            eos_id=eos_id,
            segment_bytes=segment_bytes,
            checksum=checksum,
            lora=lora,
        )
    except BaseException:
        if llm is not None:
            llm.shutdown(timeout=VLLM_SHUTDOWN_S)
        bridge.stop()
        raise


# vLLM serves LoRA on these too, but as embeddings / a padded vocabulary: not synced here
_UNSYNCED = ("embed_tokens", "lm_head")


def _check_targets(lora: VLLMLora, served: list[list[str]]) -> None:
    """Refuse an adapter on modules vLLM's LoRA does not serve in this model (each worker's
    answer: its module names), or that our sync does not carry (``_UNSYNCED``)."""
    unsynced = [m for m in lora.target_modules if m in _UNSYNCED]
    if unsynced:
        raise ValueError(
            f"LoRA-only sync into vLLM carries linear projections, not {unsynced} "
            "(sync merged weights instead)"
        )
    for names in served:
        missing = [m for m in lora.target_modules if m not in names]
        if missing:
            raise ValueError(
                f"vLLM's LoRA does not serve target_modules {missing} in this model (it serves "
                f"{', '.join(names)})"
            )


def close_vllm_engine(engine: VLLMEngine) -> None:
    """Shut vLLM down (blocking; bounded by vLLM's own shutdown timeout)."""
    engine._closed = True
    engine._resumed.set()
    try:
        engine.llm.shutdown(timeout=VLLM_SHUTDOWN_S)
    finally:
        engine._bridge.stop()
        engine.segments.close()


@asynccontextmanager
async def open_vllm_engine(
    engine_args: Mapping[str, Any],
    *,
    weight_transfer: WeightTransfer | None = "afa_shm",
    version: int = 0,
    max_resumes: int = 4,
    eos_id: Any = _AUTO,
    trust_vllm_ipc_pickle: bool = False,
    segment_bytes: int = 256 << 20,
    checksum: bool = True,
    lora: VLLMLora | None = None,
) -> AsyncIterator[VLLMEngine]:
    """Start vLLM's ``AsyncLLM`` from ``AsyncEngineArgs(**engine_args)`` on a dedicated asyncio
    thread; shut it down when the block exits.

    ``engine_args`` name the model folder (``model=``) and vLLM's settings; this sets
    ``weight_transfer_config`` from ``weight_transfer``, ``worker_extension_cls`` to our
    ``WorkerExtension`` and ``logprobs_mode="processed_logprobs"`` unless given.
    ``weight_transfer``: ``"afa_shm"`` (default: shared memory, no pickle), ``"ipc"`` /
    ``"npu_ipc"`` (vLLM's CUDA/NPU IPC, which pickles the IPC handles between vLLM's own
    processes: it needs ``trust_vllm_ipc_pickle=True``) or ``None`` (no ``load_weights``).
    ``eos_id``: the id that ends a sample besides ``stop_token_ids`` (default: the model
    config's ``eos_token_id``; ``None``: none). ``segment_bytes`` / ``checksum``: the
    shared-memory segments of ``afa_shm`` (size, CRC-32). ``lora``: serve the base model with
    this adapter and sync the adapter alone (``_vllm_lora``; LoRA on in vLLM, ``afa_shm``
    only); a ``target_modules`` entry vLLM's LoRA does not serve in this model is refused
    here (``ValueError``).
    """
    engine = await trio.to_thread.run_sync(
        functools.partial(
            start_vllm_engine,
            engine_args,
            weight_transfer=weight_transfer,
            version=version,
            max_resumes=max_resumes,
            eos_id=eos_id,
            trust_vllm_ipc_pickle=trust_vllm_ipc_pickle,
            segment_bytes=segment_bytes,
            checksum=checksum,
            lora=lora,
        )
    )
    try:
        yield engine
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(close_vllm_engine, engine)

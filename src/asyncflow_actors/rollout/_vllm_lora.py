"""LoRA-only weight sync into vLLM: the sender side (``VLLMEngine`` with ``lora=``).

vLLM serves the base model from its folder and our adapter under one LoRA id
(``ADAPTER_ID``); every sync sends the adapter tensors alone (``lora_A`` / ``lora_B``, about
``r * (in + out)`` values a module) through the same shared-memory segments as a full update
(``_vllm_shm``: checksummed, only plain metadata on vLLM's channel, no pickle), in two phases:

1. *stage* (vLLM keeps generating on the old adapter): every worker maps and checks the
   segments, checks each tensor against the served model (a target module vLLM's LoRA supports,
   ``A: (r, in)``, ``B: (out, r)``) and builds the adapter from in-memory tensors (vLLM's
   ``LoRAModel.from_lora_tensors``: no folder, no file). A refusal raises ``WeightLoadError``
   and the old adapter keeps serving.
2. *commit* (vLLM held paused between two steps): the adapter under ``ADAPTER_ID`` is replaced
   in place and the weight version relabelled, so a step never mixes two adapters and every
   token's version is right, as with full weights. A failure here is ``WeightCommitError``.

The swap is in place (one id) rather than a new id per version so that the pause modes keep
their meaning (``KEEP``: frozen requests go on under the *new* adapter, as under new full
weights) and vLLM never holds more adapters than ``max_loras=1``. Each version's requests carry
their own LoRA *name* (``afa-lora-v<version>``): vLLM keys its prefix cache on it, so a new
request never reuses keys and values an older adapter computed.

Before the first sync requests carry no adapter: the base model, which is what a fresh PEFT
adapter computes (``lora_B`` starts at zero).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import trio

from ._asyncio_bridge import AsyncioThread
from ._types import WeightLoadError
from ._vllm_shm import SegmentPool, write_segments
from ._vllm_weights import worker_reason

__all__ = ["ADAPTER_ID", "VLLMLora", "adapter_tensors", "stage_adapter"]

#: The LoRA id our adapter is served under (vLLM's ids start at 1).
ADAPTER_ID = 1
#: vLLM's ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``).
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The trainer's PEFT names carry the adapter's name (``lora_A.default.weight``); PEFT's
# files and vLLM do not (``lora_A.weight``).
_ADAPTER = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Where vLLM would load the adapter from if it ever lost it: no such folder (a clear
# ``LoRAAdapterNotFoundError``, never a download). It never does: one id, one slot, and
# only our commit replaces it.
_NO_FOLDER = "/afa-lora-in-memory"


def _positive(_: Any, attribute: Any, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(x) for x in value)


@attrs.frozen
class VLLMLora:
    """The adapter vLLM serves: PEFT's ``r``, ``alpha`` and ``target_modules`` (module name
    suffixes, as ``model.lora``). vLLM applies ``alpha / r`` as PEFT does."""

    r: int = attrs.field(validator=_positive)
    alpha: float = attrs.field(converter=float, validator=_positive)
    target_modules: tuple[str, ...] = attrs.field(converter=_names)

    def __attrs_post_init__(self) -> None:
        if self.r > _RANKS[-1]:
            raise ValueError(f"vLLM serves LoRA ranks up to {_RANKS[-1]}, got r={self.r}")
        if not self.target_modules:
            raise ValueError("target_modules is empty")

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine arguments for serving it: LoRA on, the smallest ``max_lora_rank``
        vLLM allows that holds ``r``, one adapter at a time."""
        rank = next(x for x in _RANKS if x >= self.r)
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}

    def to_wire(self) -> dict[str, Any]:
        """PEFT's ``adapter_config.json`` fields vLLM reads (plain values)."""
        return {"r": self.r, "lora_alpha": self.alpha, "target_modules": list(self.target_modules)}

    def request(self, version: int) -> Any:
        """The ``LoRARequest`` of requests made while ``version`` serves."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"afa-lora-v{version}", ADAPTER_ID, f"{_NO_FOLDER}/v{version}")


def adapter_tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` under PEFT's file names (``...q_proj.lora_A.weight``). Raises
    ``WeightLoadError`` naming a tensor that is not an adapter's (a LoRA sync sends adapters
    only: ``CheckpointConfig(lora_only=True)``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        found = _ADAPTER.match(name)
        if found is None:
            raise WeightLoadError(
                f"{name!r} is not a LoRA adapter tensor (this vLLM engine serves an adapter: "
                "sync with lora_only)"
            )
        out[f"{found['module']}.lora_{found['ab']}.weight"] = tensor
    return out


async def stage_adapter(
    llm: Any,
    bridge: AsyncioThread,
    lora: VLLMLora,
    weights: Mapping[str, torch.Tensor],
    version: int,
    *,
    pool: SegmentPool,
    segment_bytes: int,
    checksum: bool,
) -> int:
    """Phase 1: write the adapter into ``pool``'s segments and have every worker stage it
    (``afa_lora_stage``); returns the bytes sent. ``WeightLoadError`` if a worker refuses it
    (nothing staged anywhere). The caller commits (``afa_lora_commit``) or drops
    (``afa_lora_drop``) it."""
    tensors = adapter_tensors(weights)
    plan = await trio.to_thread.run_sync(
        functools.partial(
            write_segments, tensors, pool=pool, segment_bytes=segment_bytes, checksum=checksum
        )
    )
    try:
        await bridge.call(
            functools.partial(
                llm.collective_rpc, "afa_lora_stage", args=(plan.to_wire(), lora.to_wire())
            )
        )
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            await drop_adapter(llm, bridge)
        if isinstance(exc, Exception):
            raise WeightLoadError(
                f"vLLM refused the adapter of version {version}: {worker_reason(exc)}"
            ) from exc
        raise
    return plan.nbytes


async def drop_adapter(llm: Any, bridge: AsyncioThread) -> None:
    """Forget a staged adapter in every worker (the engine may be dead: then nothing to do)."""
    try:
        await bridge.call(functools.partial(llm.collective_rpc, "afa_lora_drop"))
    except Exception:
        pass

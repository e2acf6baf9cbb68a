"""Settings of a multi-rank trainer (torch-free: they travel to every rank as plain data)."""

from __future__ import annotations

import os
from typing import Any

import attrs

from ._settings import LoraSettings as LoraSettings
from ._settings import SettingsError

RANKS_DIR = "ranks"  # a rank group's DCP checkpoint inside a run checkpoint


def _one_of(*choices: str) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise SettingsError(f"{attribute.name} must be one of {list(choices)}, got {value!r}")

    return check


def _positive_or_none(inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SettingsError(f"{attribute.name} must be an int >= 1 or unset, got {value!r}")


@attrs.frozen
class ParallelSettings:
    """How the trainer's ranks train: ``ranks`` processes, ``sharding`` ``"fsdp"`` (FSDP2:
    parameters, gradients and optimizer state sharded) or ``"ddp"`` (replicated; small models),
    ``dtype`` ``"fp32"`` or ``"bf16"`` (compute in bf16, fp32 master weights and gradient
    reductions), ``gradient_checkpointing`` (HF policies), ``micro_batch_size`` (rows per
    forward within a rank: gradient accumulation), ``timeout_s`` for every collective;
    ``launcher`` ``"process"`` (ranks 1..N-1 are child processes of rank 0's) or ``"ray"``
    (Ray actors in a placement group: ``ray_strategy``, one bundle of ``ray_rank_resources``
    per rank, the cluster at ``ray_address``)."""

    ranks: int = 1
    sharding: str = attrs.field(default="fsdp", validator=_one_of("fsdp", "ddp"))
    dtype: str = attrs.field(default="fp32", validator=_one_of("fp32", "bf16"))
    gradient_checkpointing: bool = False
    micro_batch_size: int | None = attrs.field(default=None, validator=_positive_or_none)
    timeout_s: float = 300.0
    launcher: str = attrs.field(default="process", validator=_one_of("process", "ray"))
    ray_strategy: str = "PACK"
    ray_rank_resources: dict[str, float] = attrs.field(factory=lambda: {"CPU": 1.0})
    ray_address: str = "auto"


def parallel_of(train: Any) -> ParallelSettings:
    """The ``ParallelSettings`` of a run's ``TrainSettings``."""
    return ParallelSettings(
        ranks=train.ranks,
        sharding=train.sharding,
        dtype=train.dtype,
        gradient_checkpointing=train.gradient_checkpointing,
        micro_batch_size=train.micro_batch_size,
        timeout_s=train.collective_timeout,
        launcher=train.rank_launcher,
        ray_strategy=train.ray_strategy,
        ray_rank_resources=dict(train.ray_rank_resources),
        ray_address=train.ray_address,
    )


def uses_ranks(spec: Any) -> bool:
    """Whether a run's trainer is a rank group (``_ranked``): more than one rank, a setting
    only the rank group implements (bf16, micro-batches, checkpointing, LoRA), or a resume
    from a rank group's checkpoint (on any number of ranks: DCP reshards)."""
    train = spec.train
    resume = spec.resume_from
    return bool(
        (resume is not None and os.path.isdir(os.path.join(resume, RANKS_DIR)))
        or train.ranks > 1
        or train.dtype != "fp32"
        or train.micro_batch_size is not None
        or train.gradient_checkpointing
        or spec.model.lora.enabled
    )

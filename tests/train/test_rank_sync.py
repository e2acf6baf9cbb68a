"""Weight sync from a 2-rank FSDP2 trainer: parameters gathered one at a time as their
buckets are packed, through the CheckpointEngine's protocol, to the checkpoint tests'
receiver doubles: what they load is the trainer's whole model, bit for bit; LoRA syncs send the
adapters only, or the base weights with the adapters merged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig, PhaseDeadlines
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import LoraSettings, ParallelSettings
from asyncflow_actors.roles._rank_sync import ShardedSyncEngine
from tests.checkpoint.doubles import DoubleActor, GetWeights, World

from .conftest import global_batch, run_spec

FAST = PhaseDeadlines(pause=30, prepare=30, topology=30, broadcast=30, finalize=30, resume=30)


@pytest.fixture(scope="module")
def ranks() -> Iterator[DistributedLearner]:
    with DistributedLearner.open(run_spec(), ParallelSettings(ranks=2)) as learner:
        yield learner


def specs_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()}


async def receive(
    learner: DistributedLearner, expected: dict[str, torch.Tensor], **config: Any
) -> Any:
    """Sync ``learner`` to two receiver doubles; check they hold ``expected``; the result."""
    merged = config.pop("merged", False)
    async with afa.open_actor_system() as system:
        specs = specs_of(expected)

        def double(i: int) -> DoubleActor:
            return DoubleActor(index=i, world=World(), specs=specs, tick=0, load="eager",
                               offload=True)  # fmt: skip

        refs = [await system.spawn(lambda i=i: double(i), name=f"engine-{i}") for i in range(2)]
        cfg = CheckpointConfig(deadlines=FAST, bucket_bytes=4096, **config)
        engine = ShardedSyncEngine(learner, refs, cfg, merged=merged)
        result = await engine.sync(3)
        for ref in refs:
            got = await ref.ask(GetWeights())
            assert set(got) == set(expected)
            for name, value in expected.items():
                assert torch.equal(got[name], value), name
    return result


async def test_a_sharded_trainer_syncs_its_whole_model(ranks: DistributedLearner) -> None:
    ranks.setup(run_spec(), ParallelSettings(ranks=2))
    ranks.step(global_batch())
    full = ranks.full_state_dict()
    result = await receive(ranks, full)
    assert result.buckets > 2 and result.payload_bytes == sum(v.nbytes for v in full.values())
    ranks.step(global_batch(seed=3))  # the group is still in step: nobody left in a gather


async def test_lora_syncs_the_adapters_or_the_merged_weights(
    ranks: DistributedLearner, hf_folder: Path
) -> None:
    from asyncflow_actors.roles._lora import adapter_state, merged_state

    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    ranks.setup(run_spec(hf=str(hf_folder)), ParallelSettings(ranks=2), lora)
    ranks.step(global_batch())
    full = ranks.full_state_dict()
    adapters = await receive(ranks, adapter_state(full), lora_only=True)
    merged = await receive(ranks, merged_state(full, lora), merged=True)
    assert adapters.payload_bytes < merged.payload_bytes / 10

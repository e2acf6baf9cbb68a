"""A trainer of 2 ranks (FSDP2 on gloo) takes the update one process takes on the same global
batch, for every loss aggregation; bf16 steps; LoRA trains only the adapters; the weight sync
from the shards delivers the whole model (or the adapters, or the merged weights). One group
serves the whole module (a group costs a process start)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig, PhaseDeadlines
from asyncflow_actors.rl import AGG_MODES
from asyncflow_actors.roles._compute import Learner
from asyncflow_actors.roles._distributed import DistributedLearner
from asyncflow_actors.roles._rank_settings import LoraSettings, ParallelSettings
from asyncflow_actors.roles._rank_sync import ShardedSyncEngine
from tests.checkpoint.doubles import DoubleActor, GetWeights, World

from .conftest import global_batch, run_spec

TWO = ParallelSettings(ranks=2)


@pytest.fixture(scope="module")
def ranks() -> Iterator[DistributedLearner]:
    with DistributedLearner.open(run_spec(), TWO) as learner:
        yield learner


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize(
    ("agg", "extra", "parallel", "rows"),
    [(agg, {}, TWO, 8) for agg in AGG_MODES]
    + [("token-mean", {}, ParallelSettings(ranks=2, micro_batch_size=1), 8),
       ("seq-mean-token-sum", {"mini_batches": 2}, ParallelSettings(ranks=2, micro_batch_size=2), 8),
       ("seq-mean-token-mean", {}, ParallelSettings(ranks=2, sharding="ddp"), 8),
       # 3 rows in micro-batches of 1: rank 1 runs a void pass (FSDP's collectives match)
       ("token-mean", {}, ParallelSettings(ranks=2, micro_batch_size=1), 3)],
)  # fmt: skip
def test_two_ranks_update_as_one_process_does(
    ranks: DistributedLearner,
    agg: str,
    extra: dict[str, int],
    parallel: ParallelSettings,
    rows: int,
) -> None:
    """Same gradients (<= 1e-5 relative, every parameter) and weights after AdamW: the loss is
    normalised over the global batch, not per rank. AdamW's first step is
    ``lr * g / (|g| + eps)``: where |g| is near eps (1e-8) any rounding moves it by up to lr,
    in one process as in two, so those few elements are left out of the weight check (and
    after two updates, whose second gradient is taken at those weights, only the gradients
    are compared)."""
    spec = run_spec(agg, **extra)
    ranks.setup(spec, parallel)
    reference = Learner(spec, spec.task.build())
    data = global_batch(rows)
    expected = reference.step(data)
    metrics = ranks.step(data)
    assert metrics["updates"] == expected["updates"]
    grads = ranks.gradients()
    state = ranks.full_state_dict()
    for name, param in reference.model.named_parameters():
        assert param.grad is not None
        assert relative(grads[name], param.grad) <= 1e-5, name
        if metrics["updates"] > 1:
            continue
        steady = param.grad.abs() > 1e-5
        assert relative(state[name][steady], param.detach()[steady]) <= 1e-5, name
    assert metrics["normaliser"] > 0


def test_a_bf16_step_keeps_fp32_master_weights(ranks: DistributedLearner, hf_folder: Path) -> None:
    spec = run_spec(hf=str(hf_folder))
    ranks.setup(spec, ParallelSettings(ranks=2, dtype="bf16", gradient_checkpointing=True))
    before = ranks.full_state_dict()
    metrics = ranks.step(global_batch())
    after = ranks.full_state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_memory_sums_the_shards_of_every_rank(ranks: DistributedLearner) -> None:
    """The parameters' bytes over the ranks are the whole model's; AdamW's state, nothing
    before the first step, then two moments a trainable element (and a step count a
    parameter on each rank)."""
    ranks.setup(run_spec(), TWO)
    full = ranks.full_state_dict()
    before = ranks.memory()
    assert before["parameter_bytes"] == before["trainable_bytes"]
    assert before["parameter_bytes"] == sum(v.nbytes for v in full.values())
    assert before["optimizer_bytes"] == 0
    ranks.step(global_batch())
    moments = 2 * before["trainable_bytes"]
    steps = 2 * len(full) * 8  # at most 8 bytes a step count, on each rank
    assert moments <= ranks.memory()["optimizer_bytes"] <= moments + steps


def test_lora_trains_only_the_adapters(ranks: DistributedLearner, hf_folder: Path) -> None:
    spec = run_spec(hf=str(hf_folder))
    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    ranks.setup(spec, TWO, lora)
    before = ranks.full_state_dict()
    ranks.step(global_batch())
    after = ranks.full_state_dict()
    memory = ranks.memory()  # the optimizer holds the adapters' state only
    adapter_bytes = sum(v.nbytes for k, v in after.items() if ".lora_" in k)
    assert memory["trainable_bytes"] == adapter_bytes < memory["parameter_bytes"] / 10
    assert 2 * adapter_bytes <= memory["optimizer_bytes"] < 3 * adapter_bytes
    adapters = [k for k in after if ".lora_" in k]
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    for name, value in after.items():
        if name not in adapters:
            assert torch.equal(before[name], value), name  # frozen base weights
    assert any(not torch.equal(before[k], after[k]) for k in adapters if ".lora_B." in k)


def test_a_lora_export_merges_the_adapters_or_keeps_them(
    ranks: DistributedLearner, hf_folder: Path, tmp_path: Path
) -> None:
    from asyncflow_actors.roles._lora import merged_state
    from asyncflow_actors.rollout import load_causal_lm

    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    ranks.setup(run_spec(hf=str(hf_folder)), TWO, lora)
    ranks.step(global_batch())
    state = ranks.full_state_dict()
    merged = load_causal_lm(ranks.export(str(tmp_path / "merged")))
    expected = merged_state(state, lora)
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6)
    name = "model.layers.0.self_attn.q_proj.weight"
    base = state["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.equal(merged.state_dict()[name], base)  # the trained adapter folded in
    adapter = Path(ranks.export(str(tmp_path / "adapter"), merge=False))
    assert (adapter / "adapter_model.safetensors").exists()


# -- weight sync from the shards: parameters gathered one at a time as their buckets are packed,
# through the CheckpointEngine's protocol, to the checkpoint tests' receiver doubles

FAST = PhaseDeadlines(pause=30, prepare=30, topology=30, broadcast=30, finalize=30, resume=30)


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


async def test_a_failed_sync_leaves_the_receivers_and_the_group_as_they_were(
    ranks: DistributedLearner,
) -> None:
    """A corrupted bucket fails the commit: no receiver switches (they keep their old
    weights), and every rank finished the gather order (the group steps on)."""
    from asyncflow_actors.checkpoint import SyncFailed
    from tests.checkpoint.doubles import weights_of

    ranks.setup(run_spec(), ParallelSettings(ranks=2))
    full = ranks.full_state_dict()
    specs = specs_of(full)
    world = World(corrupt_bucket=1, corrupt_engine=0)
    async with afa.open_actor_system() as system:
        refs = [
            await system.spawn(
                lambda i=i: DoubleActor(index=i, world=world, specs=specs, tick=0, load="eager",
                                        offload=True),  # type: ignore[misc]
                name=f"engine-{i}",
            )
            for i in range(2)
        ]  # fmt: skip
        cfg = CheckpointConfig(deadlines=FAST, bucket_bytes=4096)
        with pytest.raises(SyncFailed):
            await ShardedSyncEngine(ranks, refs, cfg).sync(1)
        old = weights_of(-1, specs)
        for ref in refs:
            got = await ref.ask(GetWeights())
            assert all(torch.equal(got[k], old[k]) for k in old)
    assert ranks.step(global_batch())["normaliser"] > 0

"""The trainer's ranks on CPU (FSDP2, gloo): step time, sync time, LoRA sync bytes, bf16.

The model: a ``TinyDecoder`` of 8 layers, d_model 512 (25 M parameters, 101 MB in fp32)
exported as a Hugging Face ``LlamaForCausalLM`` folder, built locally (no hub). The global
batch: 16 rows of a 16-token prompt and a 48-token response, token-mean loss, AdamW. Every rank
runs one torch thread (on a 2-core host, 2 ranks use both cores, 1 rank one). Figures are
medians of ``STEPS`` measured steps after one warm-up step (syncs likewise). JSON lines:

- ``trainer_step_2ranks`` (s per global batch, FSDP2 over 2 ranks); baseline: 1 rank; the
  ratio is the scaling (2 cores: ideal 0.5).
- ``trainer_step_cpu_2ranks`` (s): rank 0's CPU time per step with 2 ranks; baseline: 1 rank
  (its share of the work, whatever the host's load; ideal 0.5 plus the collectives).
- ``trainer_sync_s_2ranks`` (s): a whole weight sync (``ShardedSyncEngine``: parameters
  all-gathered bucket by bucket as they are packed, the actor transport, 64 MiB buckets) to one
  receiver actor in rank 0's process; baseline: the same from 1 rank.
- ``trainer_lora_sync_bytes`` (bytes): a LoRA (r 8, q/k/v/o) adapters-only sync's payload;
  baseline: the full model's (what a merged sync sends).
- ``trainer_bf16_step`` (s): a 2-rank step with ``dtype = "bf16"``; baseline: fp32.

Run: ``PYTHONPATH=benchmarks:src python benchmarks/bench_trainer.py`` (about 2-3 minutes).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio
from common import emit

import asyncflow_actors as afa
from asyncflow_actors.checkpoint import CheckpointConfig
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.roles import (
    AlgorithmSettings,
    DistributedLearner,
    LoraSettings,
    ModelSettings,
    ParallelSettings,
    RunSpec,
    ShardedSyncEngine,
    TrainSettings,
)
from asyncflow_actors.rollout import export_hf

STEPS = 3
ROWS, PROMPT, RESPONSE = 16, 16, 48


def build_model(folder: Path) -> None:
    tokenizer = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    config = TinyConfig(vocab_size=tokenizer.vocab_size, d_model=512, n_layers=8, n_heads=8,
                        max_seq_len=128)  # fmt: skip
    export_hf(folder, TinyDecoder(config), tokenizer)


def batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 12, (PROMPT,), generator=g) for _ in range(ROWS)]
    responses = [torch.randint(3, 12, (RESPONSE,), generator=g) for _ in range(ROWS)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "old_logprobs": [torch.full((RESPONSE,), -2.5) for _ in range(ROWS)],
        "behaviour_logprobs": [torch.full((RESPONSE,), -2.5) for _ in range(ROWS)],
        "advantages": [torch.full((RESPONSE,), 1.0 - 2 * (k % 2)) for k in range(ROWS)],
    }


def spec(folder: Path) -> RunSpec:
    return RunSpec(
        mode="async", staleness=1, stage_barrier=False, colocated=False,
        model=ModelSettings(hf=str(folder)), algorithm=AlgorithmSettings(),
        train=TrainSettings(lr=1e-5),
    )  # fmt: skip


def step_time(learner: DistributedLearner) -> tuple[float, float]:
    """Median wall seconds of a step, and rank 0's CPU seconds (every thread of it)."""
    data = batch()
    learner.step(data)  # warm-up
    times, cpu = [], []
    for _ in range(STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        learner.step(data)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def sync(learner: DistributedLearner, **config: Any) -> tuple[float, int]:
    """Median seconds of a whole sync to one receiver, and its payload bytes."""
    from sync_targets import BenchReceiver

    async def main() -> tuple[float, int]:
        async with afa.open_actor_system() as system:
            state = await trio.to_thread.run_sync(learner.full_state_dict)
            keep = CheckpointConfig(**config).tensor_filter()
            specs = {k: list(v.shape) for k, v in state.items() if keep(k)}
            del state
            ref = await system.spawn(lambda: BenchReceiver(specs), name="receiver")
            cfg = CheckpointConfig(bucket_bytes=64 << 20, **config)
            engine = ShardedSyncEngine(learner, [ref], cfg)
            times, payload = [], 0
            for version in range(STEPS + 1):
                t0 = time.perf_counter()
                result = await engine.sync(version)
                if version:  # the first one warms up
                    times.append(time.perf_counter() - t0)
                payload = result.payload_bytes
            return statistics.median(times), payload

    return trio.run(main)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build_model(folder)
        run = spec(folder)
        with DistributedLearner.open(run, ParallelSettings(ranks=1)) as one:
            step_1, cpu_1 = step_time(one)
            sync_1, _ = sync(one)
        with DistributedLearner.open(run, ParallelSettings(ranks=2)) as two:
            step_2, cpu_2 = step_time(two)
            sync_2, full_bytes = sync(two)
            two.setup(run, ParallelSettings(ranks=2, dtype="bf16"))
            step_bf16, _ = step_time(two)
            lora = LoraSettings(
                r=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")
            )
            two.setup(run, ParallelSettings(ranks=2), lora)
            _, lora_bytes = sync(two, lora_only=True)
        emit("trainer_step_2ranks", step_2, "s", step_1)
        emit("trainer_step_cpu_2ranks", cpu_2, "s", cpu_1)
        emit("trainer_sync_s_2ranks", sync_2, "s", sync_1)
        emit("trainer_lora_sync_bytes", lora_bytes, "bytes", full_bytes)
        emit("trainer_bf16_step", step_bf16, "s", step_2)


if __name__ == "__main__":
    sys.exit(main())

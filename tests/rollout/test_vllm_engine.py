"""The vLLM adapter: the asyncio bridge and the request/version mapping run everywhere; the
engine itself only where vLLM imports and a GPU (or an Ascend NPU) exists."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from asyncflow_actors.checkpoint import PauseMode
from asyncflow_actors.rollout import FinishReason, GenerationRequest, SamplingConfig
from asyncflow_actors.rollout._asyncio_bridge import AsyncioThread, TrioSink
from asyncflow_actors.rollout._vllm_engine import versions_from_spans, vllm_sampling_kwargs


@pytest.fixture
def bridge() -> Any:
    thread = AsyncioThread()
    thread.start()
    yield thread
    thread.stop()


async def test_bridge_calls_coroutines_on_its_own_loop(bridge: AsyncioThread) -> None:
    async def where(x: int) -> tuple[int, bool]:
        await asyncio.sleep(0)
        return x * 2, asyncio.get_running_loop() is bridge._loop

    assert await bridge.call(where, 21) == (42, True)

    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await bridge.call(fail)
    # a worker thread may block on it
    assert await trio.to_thread.run_sync(bridge.call_blocking, where, 2) == (4, True)


async def test_cancelling_the_trio_caller_cancels_the_asyncio_task(bridge: AsyncioThread) -> None:
    seen: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with trio.move_on_after(0.05) as scope:
        await bridge.call(slow)
    assert scope.cancelled_caught
    await trio.to_thread.run_sync(bridge.call_blocking, asyncio.sleep, 0.01)
    assert seen == ["cancelled"]


async def test_sink_feeds_trio_in_order_without_blocking_asyncio(bridge: AsyncioThread) -> None:
    sink: TrioSink[int] = TrioSink()

    async def produce() -> None:
        for i in range(100):
            sink.put(i)

    await bridge.call(produce)
    sink.send.close()
    assert [i async for i in sink.receive] == list(range(100))


def test_versions_from_spans() -> None:
    @attrs.frozen
    class Span:
        version: str
        start: int
        end: int

    assert versions_from_spans([Span("3", 0, 2), Span("4", 2, 5)], 5, 9) == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 3, 7) == [7, 7, 7]


def test_sampling_kwargs_carry_the_reduced_budget_and_a_resume_seed() -> None:
    req = GenerationRequest(
        [1, 2], SamplingConfig(10, temperature=0.7, top_k=5, stop_token_ids=[9], seed=3, n=2)
    )
    first = vllm_sampling_kwargs(req.expand()[1])
    assert first["max_tokens"] == 10 and first["top_k"] == 5 and first["stop_token_ids"] == [9]
    assert first["logprobs"] == 0 and first["n"] == 1
    resumed = attrs.evolve(
        req.expand()[1],
        prefix_ids=[4, 4],
        prefix_logprobs=[0, 0],
        prefix_versions=[0, 0],
        resumes=1,
    )
    again = vllm_sampling_kwargs(resumed)
    assert again["max_tokens"] == 8 and again["seed"] != first["seed"]
    assert vllm_sampling_kwargs(req.expand()[0])["seed"] != first["seed"]


def _device_available() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    if torch.cuda.is_available():
        return True
    return importlib.util.find_spec("torch_npu") is not None


needs_vllm = pytest.mark.skipif(
    not _device_available(), reason="vLLM needs `vllm` installed and a CUDA GPU or an Ascend NPU"
)


@needs_vllm
async def test_vllm_engine_pause_modes_versions_and_weight_transfer(tmp_path: Path) -> None:
    from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder
    from asyncflow_actors.rollout import export_hf, llama_weights_from_tiny, open_vllm_engine

    tok = CharTokenizer("0123456789+=")
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=2, n_heads=2, max_seq_len=128)
    first, second = TinyDecoder(cfg), TinyDecoder(cfg)
    export_hf(tmp_path / "m", first, tok)
    backend = "ipc" if torch.cuda.is_available() else "npu_ipc"
    args = {
        "model": str(tmp_path / "m"),
        "enforce_eager": True,
        "gpu_memory_utilization": 0.2,
        "max_model_len": 128,
        "dtype": "float32",
    }
    long = SamplingConfig(100, temperature=1.0, seed=1, stop_token_ids=[])
    async with open_vllm_engine(
        args, weight_transfer=backend, trust_vllm_ipc_pickle=True
    ) as engine:
        done = await engine.generate(GenerationRequest(tok.encode("1+2=", add_bos=True), long))
        assert set(done.versions) == {0} and len(done.token_ids) == len(done.logprobs)
        box: list[Any] = []
        req = GenerationRequest(
            tok.encode("12+3=", add_bos=True), attrs.evolve(long, max_new_tokens=110)
        )
        async with trio.open_nursery() as nursery:

            async def one() -> None:
                box.append(await engine.generate(req))

            nursery.start_soon(one)
            while engine.statistics().generated_tokens < len(done.token_ids) + 5:
                await trio.sleep(0.001)
            ack = await engine.pause(PauseMode.ABORT)
        (part,) = box
        assert ack.mode is PauseMode.ABORT and part.finish_reason is FinishReason.ABORTED
        await engine.load_weights(llama_weights_from_tiny(second.state_dict(), cfg), 1)
        await engine.resume()
        final = await engine.generate(req.continue_from(part))
        k = len(part.token_ids)
        assert final.token_ids[:k] == part.token_ids
        assert final.versions == (0,) * k + (1,) * (len(final.token_ids) - k)
        assert len(final.token_ids) <= 110

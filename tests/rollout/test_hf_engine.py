"""The Hugging Face engine on a tiny LlamaForCausalLM saved in code and loaded offline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from asyncflow_actors.checkpoint import PauseMode
from asyncflow_actors.models import CharTokenizer, TinyConfig, TinyDecoder, token_logprobs
from asyncflow_actors.rollout import (
    Completion,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingConfig,
    WeightLoadError,
    export_hf,
    llama_weights_from_tiny,
    open_hf_engine,
    open_torch_engine,
)

TOKENIZER = CharTokenizer("0123456789+=")


def tiny(seed: int) -> TinyDecoder:
    torch.manual_seed(seed)
    # head size 64 (d=128, 2 heads): a shape vLLM's attention kernels also serve
    config = TinyConfig(
        vocab_size=TOKENIZER.vocab_size, d_model=128, n_layers=2, n_heads=2, max_seq_len=64
    )
    model = TinyDecoder(config)
    with torch.no_grad():  # larger than the default init, so that differences show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.08)
    return model


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    export_hf(tmp_path / "model", tiny(0), TOKENIZER)
    return tmp_path / "model"


def prompts() -> list[list[int]]:
    return [TOKENIZER.encode(text, add_bos=True) for text in ("12+34=", "7+5=", "100+99=", "3=")]


async def test_saved_folder_loads_offline_and_matches_the_tiny_model(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok("12+3=", add_special_tokens=False)["input_ids"] == TOKENIZER.encode("12+3=")
    assert (tok.eos_token_id, tok.pad_token_id) == (TOKENIZER.eos_id, TOKENIZER.pad_id)
    ids = torch.tensor([TOKENIZER.encode("1+2=345+6789=0", add_bos=True)])
    ours = token_logprobs(tiny(0), ids).logprobs
    theirs = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)[0, :-1].gather(
        1, ids[0, 1:, None]
    )[:, 0]
    torch.testing.assert_close(theirs, ours[0, 1:], atol=1e-4, rtol=0)


async def test_hf_engine_generates_what_the_torch_engine_does(folder: Path) -> None:
    reqs = [
        GenerationRequest(p, SamplingConfig(20, temperature=t, seed=i), request_id=f"r{i}")
        for i, (p, t) in enumerate(zip(prompts() * 2, [0.0] * 4 + [1.0] * 4, strict=True))
    ]

    async def run(engine: object) -> dict[str, Completion]:
        out: dict[str, Completion] = {}

        async def one(r: GenerationRequest) -> None:
            out[r.request_id] = await engine.generate(r)  # type: ignore[attr-defined]

        async with trio.open_nursery() as nursery:
            for r in reqs:
                nursery.start_soon(one, r)
        return out

    config = EngineConfig(max_batch=3, eos_id=TOKENIZER.eos_id)
    async with open_hf_engine(folder, config) as engine:
        assert engine.tokenizer is not None
        hf = await run(engine)
    async with open_torch_engine(tiny(0), config) as engine:
        ours = await run(engine)
    for r in reqs:
        assert hf[r.request_id].token_ids == ours[r.request_id].token_ids
        torch.testing.assert_close(
            torch.tensor(hf[r.request_id].logprobs),
            torch.tensor(ours[r.request_id].logprobs),
            atol=1e-4,
            rtol=0,
        )


async def test_hf_engine_loads_mapped_tiny_weights_and_resumes_partial_rollouts(
    folder: Path,
) -> None:
    other = tiny(1)
    req = GenerationRequest(prompts()[0], SamplingConfig(40, temperature=0.0))
    async with open_hf_engine(folder) as engine:
        assert engine.config.eos_id == TOKENIZER.eos_id  # from the model's config
    # no end-of-sequence id: only the budget stops it, so the abort lands mid-sample
    async with open_hf_engine(folder, EngineConfig(max_run_seconds=1e-3)) as engine:
        with pytest.raises(WeightLoadError, match="shape"):
            await engine.load_weights({"lm_head.weight": torch.zeros(3, 3)}, 1)
        box: list[Completion] = []

        async def one() -> None:
            box.append(await engine.generate(req))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            while engine.statistics().generated_tokens < 5:
                await trio.sleep(0.0005)
            ack = await engine.pause(PauseMode.ABORT)
        assert ack.aborted == 1
        await engine.load_weights(llama_weights_from_tiny(other.state_dict(), other.config), 1)
        await engine.resume()
        (part,) = box
        assert part.finish_reason is FinishReason.ABORTED
        done = await engine.generate(req.continue_from(part))
    k = len(part.token_ids)
    assert done.versions == (0,) * k + (1,) * (40 - k)
    # the continuation is what the new weights produce after the old prefix
    ids = torch.tensor([list(req.prompt_ids) + list(done.token_ids)])
    new = token_logprobs(other, ids, response_length=40).logprobs[0, k:]
    torch.testing.assert_close(torch.tensor(done.logprobs[k:]), new, atol=1e-4, rtol=0)


def test_llama_weight_names_cover_the_model() -> None:
    from transformers import LlamaForCausalLM

    from asyncflow_actors.rollout import llama_config_from_tiny

    model = tiny(0)
    mapped = llama_weights_from_tiny(model.state_dict(), model.config)
    assert set(mapped) == set(LlamaForCausalLM(llama_config_from_tiny(model.config)).state_dict())
    with pytest.raises(KeyError, match="nope"):
        llama_weights_from_tiny({"nope": torch.zeros(1)}, model.config)


async def test_groups_submitted_a_few_scheduling_rounds_apart_decode_in_one_wave(
    folder: Path,
) -> None:
    # A rollout's groups reach the engine from their own tasks, a scheduler round or two
    # apart: an idle engine lets them all join before it starts, so a static wave holds
    # every group (one prefill, then the decode steps) instead of the first group alone
    # followed by a second wave of the rest.
    config = EngineConfig(max_batch=16, eos_id=None)

    async def group(engine: object, i: int, rounds: int) -> None:
        for _ in range(rounds):
            await trio.lowlevel.checkpoint()
        params = SamplingConfig(3, temperature=1.0, seed=i)
        await engine.generate_many(  # type: ignore[attr-defined]
            [GenerationRequest(prompts()[i % 4], params, request_id=f"{i}-{k}") for k in range(4)]
        )

    async with open_hf_engine(folder, config) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(group, engine, i, i % 3)
        stats = engine.statistics()
    assert stats.completed == 16
    assert stats.steps == 3, "one wave: a prefill and two decode steps"

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from asyncflow_actors.models import (
    SamplingError,
    SamplingParams,
    TinyConfig,
    TinyDecoder,
    generate,
    sample_next,
    token_logprobs,
)

EOS = 2


def _model(seed: int = 0) -> TinyDecoder:
    torch.manual_seed(seed)
    model = TinyDecoder(TinyConfig(vocab_size=11, d_model=32, n_heads=4, max_seq_len=24))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.3)
    return model


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -0.5}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(SamplingError, match=needle):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sample_next_greedy_and_temperature_logprobs() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens, logp = sample_next(logits, SamplingParams(1, temperature=0.0))
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logp, F.log_softmax(logits, -1)[[0, 1], [1, 0]])
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, SamplingParams(1, temperature=0.5), generator=gen)
    expected = F.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp, expected)


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, SamplingParams(1, top_p=0.7), generator=gen)
    # Mass 0.5 < 0.7 before token 1, 0.8 >= 0.7 before token 2: the nucleus is {0, 1}.
    assert set(tokens.tolist()) == {0, 1}
    for token, value in ((0, math.log(0.5 / 0.8)), (1, math.log(0.3 / 0.8))):
        assert torch.allclose(logp[tokens == token], torch.tensor(value), atol=1e-6)
    frac0 = float((tokens == 0).float().mean())
    assert abs(frac0 - 0.625) < 0.04  # 0.5 / 0.8, 4000 draws: std ~ 0.008


def test_generate_with_and_without_cache_agree() -> None:
    model = _model()
    prompts = [[1, 3, 4, 5], [1, 6], [1, 7, 8]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    fast = generate(
        model, prompts, params, pad_id=0, eos_id=EOS, generator=torch.Generator().manual_seed(3)
    )
    slow = generate(
        model,
        prompts,
        params,
        pad_id=0,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(3),
        use_kv_cache=False,
    )
    assert torch.equal(fast.response_ids, slow.response_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)
    again = generate(
        model, prompts, params, pad_id=0, eos_id=EOS, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(fast.response_ids, again.response_ids)


def test_generate_stops_at_eos_and_pads_after_it() -> None:
    model = _model()
    bias = torch.zeros(11)
    bias[EOS] = 2.0  # some rows stop early, others run to max_new_tokens
    model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    prompts = [[1, 3 + i % 8] for i in range(16)]
    out = generate(
        model,
        prompts,
        SamplingParams(6),
        pad_id=0,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(0),
    )
    responses = out.responses()
    assert 0 < int(out.finished.sum()) < 16
    for row, finished in zip(responses, out.finished.tolist(), strict=True):
        assert (EOS in row) == finished
        if finished:
            assert row.index(EOS) == len(row) - 1
        else:
            assert len(row) == 6
    assert torch.all(out.response_ids[~out.response_mask] == 0)
    assert torch.all(out.logprobs[~out.response_mask] == 0)
    assert torch.all(out.logprobs[out.response_mask] < 0)


def test_generate_eos_finishes_rows() -> None:
    # A model whose head always prefers EOS finishes every row after one token.
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS].fill_(0.0)
    hidden_bias = torch.zeros(11)
    hidden_bias[EOS] = 50.0
    model.lm_head.register_forward_hook(lambda m, i, o: o + hidden_bias)
    out = generate(model, [[1, 3], [1]], SamplingParams(5), pad_id=0, eos_id=EOS)
    assert out.response_ids.tolist() == [[EOS], [EOS]]
    assert out.finished.all()
    assert out.responses() == [[EOS], [EOS]]


def test_generate_logprobs_match_token_logprobs() -> None:
    model = _model()
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    out = generate(
        model,
        [[1, 3, 4], [1, 9]],
        params,
        pad_id=0,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(5),
    )
    batch = out.to_batch()
    ref = token_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        response_length=batch.response_length,
        temperature=0.7,
    ).logprobs
    torch.testing.assert_close(ref * batch.response_mask, out.logprobs, atol=1e-5, rtol=0)


def test_generate_rejects_too_long_requests() -> None:
    model = _model()
    with pytest.raises(SamplingError, match="max_seq_len"):
        generate(model, [[1] * 20], SamplingParams(max_new_tokens=5), pad_id=0, eos_id=EOS)

"""Requests, completions, sampling settings and the per-request sampler."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from asyncflow_actors.actors.remote._typeinfo import register_types
from asyncflow_actors.actors.remote._wire import MessageRegistry, decode, encode
from asyncflow_actors.rollout import (
    Completion,
    EngineConfig,
    EngineStatistics,
    FinishReason,
    GenerationRequest,
    RequestError,
    SamplingConfig,
)
from asyncflow_actors.rollout._config import EngineConfigError
from asyncflow_actors.rollout._sampler import (
    Draws,
    _sample_mixed,
    new_generator,
    sample_from,
    sample_rows,
)


def test_sampling_config_refuses_bad_fields() -> None:
    for kwargs in (
        {"max_new_tokens": 0},
        {"max_new_tokens": 4, "temperature": -1.0},
        {"max_new_tokens": 4, "top_p": 0.0},
        {"max_new_tokens": 4, "top_k": -1},
        {"max_new_tokens": 4, "n": 0},
        {"max_new_tokens": 4, "stop_token_ids": [-3]},
        {"max_new_tokens": 4.0},
        {"max_new_tokens": 4, "top_k": True},
    ):
        with pytest.raises(RequestError):
            SamplingConfig(**kwargs)  # type: ignore[arg-type]


def test_request_expand_and_continue_from() -> None:
    req = GenerationRequest([1, 2, 3], SamplingConfig(10, n=3, seed=4), request_id="p")
    samples = req.expand()
    assert [(s.request_id, s.sample_index) for s in samples] == [("p/0", 0), ("p/1", 1), ("p/2", 2)]
    partial = Completion("p/1", (1, 2, 3), (7, 8), (-0.5, -0.25), (3, 4), FinishReason.ABORTED, 1)
    resumed = samples[1].continue_from(partial)
    assert (resumed.prefix_ids, resumed.prefix_versions, resumed.resumes) == ((7, 8), (3, 4), 1)
    assert resumed.remaining_tokens == 8
    assert (partial.oldest_version, partial.newest_version, partial.staleness(6)) == (3, 4, 3)
    with pytest.raises(RequestError, match="aborted"):
        samples[1].continue_from(Completion("p/1", (1,), (), (), (), FinishReason.STOP))
    with pytest.raises(RequestError, match="not of request"):
        samples[0].continue_from(partial)
    with pytest.raises(RequestError, match="empty prompt"):
        GenerationRequest([], SamplingConfig(3))
    with pytest.raises(RequestError, match="leaves nothing"):
        GenerationRequest(
            [1],
            SamplingConfig(2),
            prefix_ids=[4, 5],
            prefix_logprobs=[0, 0],
            prefix_versions=[0, 0],
        )
    assert Completion("x", (1,), (), (), (), FinishReason.ABORTED).oldest_version is None


def test_values_cross_the_wire() -> None:
    registry = MessageRegistry()
    register_types(registry, GenerationRequest, Completion, EngineStatistics)
    req = GenerationRequest(
        [1, 2],
        SamplingConfig(5, stop_token_ids=[9], seed=1),
        prefix_ids=[4],
        prefix_logprobs=[-1.5],
        prefix_versions=[2],
    )
    done = Completion("a", (1, 2), (4, 5), (-1.5, -0.5), (2, 3), FinishReason.LENGTH, resumes=1)
    for value in (req, done):
        frames = encode({}, value, registry=registry)
        assert decode(frames, registry=registry, max_message_bytes=1 << 20)[1] == value


def test_engine_config_from_toml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.toml"
    path.write_text('[rollout.engine]\nmax_batch = 8\nbatching = "static"\neos_id = 2\n')
    cfg = EngineConfig.from_toml(path, table="rollout.engine")
    assert (cfg.max_batch, cfg.batching, cfg.eos_id) == (8, "static", 2)
    with pytest.raises(EngineConfigError, match="unknown keys"):
        EngineConfig.from_dict({"max_bach": 3})
    with pytest.raises(EngineConfigError):
        EngineConfig(batching="dynamic")  # type: ignore[arg-type]


def test_sampler_is_reproducible_per_row_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    params = [
        SamplingConfig(4, temperature=0.7 + 0.1 * i, top_k=i * 3, top_p=1 - 0.1 * i)
        for i in range(5)
    ]
    batch = sample_rows(logits, params, [new_generator(9, i, 0) for i in range(5)])
    for i in range(5):
        alone = sample_rows(logits[i : i + 1], params[i : i + 1], [new_generator(9, i, 0)])
        assert (alone[0][0], alone[1][0]) == (batch[0][i], batch[1][i])
    # a generator advanced by k draws continues the sequence
    g = new_generator(9, 1, 0)
    first = [sample_rows(logits[:1], params[:1], [g])[0][0] for _ in range(4)]
    g2 = new_generator(9, 1, 2)
    assert [sample_rows(logits[:1], params[:1], [g2])[0][0] for _ in range(2)] == first[2:]


def test_sampler_draws_from_the_filtered_distribution_and_reports_its_logprob() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 2
    params = SamplingConfig(4, temperature=0.8, top_k=6, top_p=0.8)
    logp = F.log_softmax(logits[0] / 0.8, -1)
    kept = logp.argsort(descending=True)[:6]
    probs = logp[kept].softmax(-1)
    nucleus = kept[: int(((probs.cumsum(-1) - probs) < 0.8).sum())]
    expected = F.log_softmax(logp[nucleus], -1)
    g = new_generator(0, 0, 0)
    counts: dict[int, int] = {}
    tokens, logprobs = sample_rows(logits.expand(3000, -1), [params] * 3000, [g] * 3000)
    for token, lp in zip(tokens, logprobs, strict=True):
        assert token in nucleus.tolist()
        assert math.isclose(lp, float(expected[nucleus.tolist().index(token)]), abs_tol=1e-5)
        counts[token] = counts.get(token, 0) + 1
    for j, token in enumerate(nucleus.tolist()):
        # 3000 draws: binomial standard deviation below 0.01
        assert abs(counts.get(token, 0) / 3000 - float(expected[j].exp())) < 0.04


def test_greedy_rows_take_the_argmax_with_its_plain_logprob() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    tokens, logprobs = sample_rows(
        logits, [SamplingConfig(2, temperature=0.0)] * 2, [new_generator(0, i, 0) for i in range(2)]
    )
    assert tokens == [1, 0]
    torch.testing.assert_close(torch.tensor(logprobs), F.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_draws_are_the_numbers_of_one_draw_per_token() -> None:
    # the engine draws a chunk at a time: the same numbers, across chunk boundaries and skips
    for skip in (0, 3, 40):
        g = new_generator(5, 2, skip)
        one_by_one = [float(torch.rand((), generator=g)) for _ in range(100)]
        draws = Draws(5, 2, skip)
        assert [draws.take() for _ in range(100)] == one_by_one


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (0.0, 0, 1.0),
        (1.3, 5, 1.0),
        (0.9, 0, 0.8),
        (0.8, 7, 0.9),
        (1.0, 40, 1.0),
        (1.0, 30, 0.95),
    ],
)
def test_rows_alike_sample_exactly_as_the_per_row_path(
    temperature: float, top_k: int, top_p: float
) -> None:
    # the fast path of rows sharing their parameters picks the very tokens and logprobs of the
    # general one (per-row parameter tensors), at the same uniform numbers
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 30, generator=gen) * 3
    logits[0, 5] = -math.inf
    uniform = torch.rand(64, generator=gen)
    params = [SamplingConfig(4, temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
              for i in range(64)]  # fmt: skip
    fast = sample_from(logits, params, uniform.tolist())
    general = _sample_mixed(logits, params, uniform)
    assert fast == general


def test_token_sequences_are_stored_as_tuples_of_plain_numbers() -> None:
    # plain ints and floats are kept as they are; numpy, torch and bool values are converted
    request = GenerationRequest(
        torch.tensor([3, 4]),  # type: ignore[arg-type]
        SamplingConfig(4, stop_token_ids=[True, 2]),  # type: ignore[list-item]
        prefix_ids=[5],
        prefix_logprobs=[torch.tensor(-1.5)],  # type: ignore[list-item]
        prefix_versions=(7,),
    )
    for values, expected, kind in [
        (request.prompt_ids, (3, 4), int),
        (request.sampling.stop_token_ids, (1, 2), int),
        (request.prefix_ids, (5,), int),
        (request.prefix_logprobs, (-1.5,), float),
        (request.prefix_versions, (7,), int),
    ]:
        assert values == expected
        assert type(values) is tuple and all(type(v) is kind for v in values)

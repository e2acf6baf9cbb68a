from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncflow_actors.models import (
    KVCache,
    KVCacheError,
    ModelInputError,
    TinyConfig,
    TinyDecoder,
    decode_step,
    entropy_from_logits,
    left_pad,
    pack_batch,
    token_logprobs,
)

ATOL = 1e-5


def _model(seed: int = 0, **kwargs: int) -> TinyDecoder:
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=13, d_model=32, n_layers=2, n_heads=4, max_seq_len=40, **kwargs)
    model = TinyDecoder(cfg)
    # Larger weights than the default init so that differences show up in the logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.3)
    return model


def test_forward_shape_and_causality() -> None:
    model = _model()
    tokens = torch.randint(0, 13, (3, 7), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (3, 7, 13)
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 13
    other = model(changed)
    torch.testing.assert_close(other[:, :5], logits[:, :5], atol=ATOL, rtol=0)
    assert not torch.allclose(other[:, 5:], logits[:, 5:], atol=1e-3)


def test_left_and_right_padding_do_not_change_real_logits() -> None:
    model = _model()
    rows = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    alone = [model(torch.tensor([r]))[0] for r in rows]
    ids, mask = left_pad(rows, pad_id=0)
    padded = model(ids, attention_mask=mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(padded[i, -len(row) :], alone[i], atol=ATOL, rtol=0)
    # Right padding: pads after the tokens, default positions still count real tokens.
    right = torch.zeros(3, 5, dtype=torch.long)
    rmask = torch.zeros(3, 5, dtype=torch.bool)
    for i, row in enumerate(rows):
        right[i, : len(row)] = torch.tensor(row)
        rmask[i, : len(row)] = True
    out = model(right, attention_mask=rmask)
    assert torch.isfinite(out).all()
    for i, row in enumerate(rows):
        torch.testing.assert_close(out[i, : len(row)], alone[i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # 2, 1: grouped-query attention
def test_kv_cache_incremental_decoding_matches_full_forward(kv_heads: int) -> None:
    model = _model(n_kv_heads=kv_heads)
    rows = [[3, 4, 5, 6], [7, 8], [9]]
    continuation = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    ids, mask = left_pad(rows, pad_id=0)
    cache = KVCache.allocate(model.config, 3, 10)
    step_logits = [model(ids, attention_mask=mask, kv_cache=cache)[:, -1]]
    for t in range(continuation.shape[1]):
        step_logits.append(model(continuation[:, t : t + 1], kv_cache=cache)[:, -1])
    assert cache.length == ids.shape[1] + 3
    assert cache.num_tokens.tolist() == [7, 5, 4]
    for i, row in enumerate(rows):
        full = model(torch.tensor([row + continuation[i].tolist()]))[0]
        expected = full[len(row) - 1 :]
        got = torch.stack([s[i] for s in step_logits])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_kv_cache_reset_select_and_compact() -> None:
    model = _model()
    ids, mask = left_pad([[3, 4, 5], [6, 7]], pad_id=0)
    cache = KVCache.allocate(model.config, 2, 12)
    model(ids, attention_mask=mask, kv_cache=cache)
    # Row 1 finishes; a new sequence [8, 9] starts in its slot (continuous batching).
    cache.reset_rows(torch.tensor([1]))
    chunk = torch.tensor([[10, 0], [8, 9]])
    chunk_mask = torch.tensor([[True, False], [True, True]])
    out = model(chunk, attention_mask=chunk_mask, kv_cache=cache)
    torch.testing.assert_close(
        out[0, 0], model(torch.tensor([[3, 4, 5, 10]]))[0, -1], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(out[1], model(torch.tensor([[8, 9]]))[0], atol=1e-4, rtol=0)
    assert cache.length == 5
    cache.compact()
    assert cache.length == 4  # row 0 holds 4 valid tokens, row 1 two
    assert cache.valid.sum(dim=1).tolist() == [4, 2]
    nxt = model(torch.tensor([[12], [12]]), kv_cache=cache)[:, -1]
    torch.testing.assert_close(
        nxt[0], model(torch.tensor([[3, 4, 5, 10, 12]]))[0, -1], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(nxt[1], model(torch.tensor([[8, 9, 12]]))[0, -1], atol=1e-4, rtol=0)
    only = cache.select(torch.tensor([1]))
    last = model(torch.tensor([[5]]), kv_cache=only)[:, -1]
    torch.testing.assert_close(
        last[0], model(torch.tensor([[8, 9, 12, 5]]))[0, -1], atol=1e-4, rtol=0
    )


def test_cache_full_and_bad_inputs_raise_typed_errors() -> None:
    model = _model()
    cache = KVCache.allocate(model.config, 1, 3)
    model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    with pytest.raises(KVCacheError, match="cache full"):
        model(torch.tensor([[4]]), kv_cache=cache)
    with pytest.raises(KVCacheError, match="batch of 2 rows"):
        model(torch.tensor([[4], [5]]), kv_cache=KVCache.allocate(model.config, 1, 3))
    with pytest.raises(ModelInputError, match="token ids"):
        model(torch.tensor([[13]]))
    with pytest.raises(ModelInputError, match="int64"):
        model(torch.tensor([[1.0]]))
    with pytest.raises(ModelInputError, match="max_seq_len"):
        model(torch.tensor([[1]]), positions=torch.tensor([[40]]))
    with pytest.raises(ModelInputError, match="attention_mask shape"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.tensor([[True]]))


def test_token_logprobs_match_log_softmax_and_slices() -> None:
    model = _model()
    batch = pack_batch([[1, 3, 4], [1, 5]], [[6, 7, 2], [8]], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 3, 4, 6, 7, 2], [0, 1, 5, 8, 0, 0]]
    assert batch.response_mask.tolist() == [[True, True, True], [True, False, False]]
    full = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    resp = token_logprobs(
        model, batch.input_ids, batch.attention_mask, response_length=3, with_entropy=True
    )
    logits = model(batch.input_ids, attention_mask=batch.attention_mask)
    manual = F.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(full.logprobs[:, 1:], manual, atol=ATOL, rtol=0)
    assert full.logprobs[:, 0].abs().max() == 0
    torch.testing.assert_close(resp.logprobs, full.logprobs[:, -3:], atol=ATOL, rtol=0)
    assert resp.entropy is not None
    torch.testing.assert_close(
        resp.entropy, entropy_from_logits(logits[:, -4:-1]), atol=ATOL, rtol=0
    )
    hot = token_logprobs(
        model, batch.input_ids, batch.attention_mask, response_length=3, temperature=2.0
    )
    manual_hot = F.log_softmax(logits[:, -4:-1] / 2.0, dim=-1).gather(
        -1, batch.input_ids[:, -3:, None]
    )[..., 0]
    torch.testing.assert_close(hot.logprobs, manual_hot, atol=ATOL, rtol=0)
    resp.logprobs.sum().backward()
    assert model.embed.weight.grad is not None


def test_rotary_positions_are_relative() -> None:
    # Shifting every position by the same offset leaves attention (and the logits) unchanged.
    model = _model()
    tokens = torch.tensor([[3, 4, 5, 6]])
    base = model(tokens, positions=torch.arange(4)[None])
    shifted = model(tokens, positions=torch.arange(4)[None] + 9)
    torch.testing.assert_close(base, shifted, atol=1e-4, rtol=0)


def test_kv_cache_insert_and_view_for_continuous_batching() -> None:
    model = _model()
    cache = KVCache.allocate(model.config, 3, 16)
    ids, mask = left_pad([[3, 4], [5, 6, 7, 8, 9]], pad_id=0)
    model(ids, attention_mask=mask, kv_cache=cache.view(2))  # rows 0 and 1 running
    assert cache.length == 5 and cache.valid[2].sum() == 0
    cache.reset_rows(torch.tensor([0]))
    # a sequence prefilled on its own joins row 0 (lower columns) and row 2 (past `length`)
    scratch = KVCache.allocate(model.config, 2, 7)
    ids2, mask2 = left_pad([[10, 11, 12], [6, 5, 4, 3, 2, 1, 7]], pad_id=0)
    model(ids2, attention_mask=mask2, kv_cache=scratch)
    cache.insert(0, scratch, 0)
    cache.insert(2, scratch, 1)
    assert cache.length == 7 and cache.num_tokens.tolist() == [3, 5, 7]
    with pytest.raises(KVCacheError, match="reset_rows"):
        cache.insert(0, scratch, 0)
    nxt = model(torch.tensor([[9], [9], [9]]), kv_cache=cache)[:, -1]
    for row, seq in enumerate([[10, 11, 12, 9], [5, 6, 7, 8, 9, 9], [6, 5, 4, 3, 2, 1, 7, 9]]):
        torch.testing.assert_close(nxt[row], model(torch.tensor([seq]))[0, -1], atol=1e-4, rtol=0)
    view = cache.view(1)
    model(torch.tensor([[4]]), kv_cache=view)
    assert cache.length == view.length == 9  # the view shares the write pointer
    with pytest.raises(KVCacheError, match="view"):
        view.compact()
    cache.compact()
    assert cache.length == 8


def test_kv_cache_insert_rows_places_a_prefilled_batch_as_inserting_row_by_row_would() -> None:
    """``insert_rows`` copies a batch prefilled together (padding columns stay invalid), one
    source row possibly into several rows: decoding continues exactly as from scratch."""
    model = _model()
    scratch = KVCache.allocate(model.config, 2, 5)
    prompts = [[10, 11, 12], [6, 5, 4, 3, 2]]
    ids, mask = left_pad(prompts, pad_id=0)
    model(ids, attention_mask=mask, kv_cache=scratch)
    cache = KVCache.allocate(model.config, 4, 16)
    model(torch.tensor([[3, 4]]), kv_cache=cache.view(1))  # row 0 runs; the pointer is at 2
    cache.insert_rows([3, 1, 2], scratch, [0, 1, 0])
    assert cache.length == 5 and cache.num_tokens.tolist() == [2, 5, 3, 3]
    nxt = model(torch.tensor([[9], [9], [9], [9]]), kv_cache=cache)[:, -1]
    for row, seq in enumerate([[3, 4, 9], prompts[1] + [9], prompts[0] + [9], prompts[0] + [9]]):
        torch.testing.assert_close(nxt[row], model(torch.tensor([seq]))[0, -1], atol=1e-4, rtol=0)
    with pytest.raises(KVCacheError, match="reset_rows"):
        cache.insert_rows([2], scratch, [0])
    with pytest.raises(KVCacheError, match="not distinct"):
        cache.insert_rows([0, 0], scratch, [0, 1])
    with pytest.raises(KVCacheError, match="2 rows given for 1"):
        cache.insert_rows([0, 3], scratch, [0])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_step_is_the_one_token_forward_bit_for_bit(kv_heads: int) -> None:
    """``decode_step`` is the engine's and ``generate``'s per-token forward without the
    argument checks: the same numbers as ``model(tokens[:, None], ...)[:, -1]`` and the same
    cache afterwards, padding rows (``real`` false) and a view of the low rows included."""
    model = _model(n_kv_heads=kv_heads)
    rows = [[3, 4, 5, 6], [7, 8], [9], [5, 5, 5]]
    ids, mask = left_pad(rows, pad_id=0)
    gen = torch.Generator().manual_seed(0)
    caches = [KVCache.allocate(model.config, 5, 12) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids, attention_mask=mask, kv_cache=cache.view(4))
        for step in range(6):
            tokens = torch.randint(1, 13, (3,), generator=gen)
            real = torch.tensor([True, step % 2 == 0, step != 3])  # rows 1 and 2 skip steps
            expected = model(tokens[:, None], attention_mask=real[:, None],
                             kv_cache=caches[0].view(3))[:, -1]  # fmt: skip
            got = decode_step(model, tokens, real, caches[1].view(3))
            assert torch.equal(got, expected), step
    for a, b in zip(
        caches[0].keys + caches[0].values, caches[1].keys + caches[1].values, strict=True
    ):
        assert torch.equal(a, b)
    assert torch.equal(caches[0].valid, caches[1].valid)
    assert torch.equal(caches[0].num_tokens, caches[1].num_tokens)
    assert caches[0].length == caches[1].length == ids.shape[1] + 6


def test_decode_step_refuses_a_position_past_max_seq_len() -> None:
    model = _model()
    cache = KVCache.allocate(model.config, 1, 64)
    with torch.no_grad():
        model(torch.ones((1, 40), dtype=torch.long), kv_cache=cache)
        with pytest.raises(ModelInputError, match="max_seq_len=40"):
            decode_step(
                model, torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), cache
            )
    assert cache.length == 40  # nothing reserved

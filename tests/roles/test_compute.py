"""The stations' vectorized helpers agree with their per-row definitions."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncflow_actors.roles._compute import group_advantages, right_pad
from asyncflow_actors.roles._settings import AlgorithmSettings


@given(lengths=st.lists(st.integers(0, 6), max_size=9), width=st.integers(0, 8))
def test_right_pad_puts_each_row_left_aligned_in_zeros(lengths: list[int], width: int) -> None:
    rows = [torch.arange(1, n + 1, dtype=torch.int64) * (k + 1) for k, n in enumerate(lengths)]
    out = right_pad(rows, width)
    assert out.shape == (len(rows), width) and out.dtype == torch.float32
    for k, row in enumerate(rows):
        keep = min(width, len(row))
        assert torch.equal(out[k, :keep], row[:keep].float())
        assert not out[k, keep:].any()


def test_group_advantages_are_one_value_per_sequence_over_its_tokens() -> None:
    out = group_advantages(AlgorithmSettings(), torch.tensor([1.0, 0.0, 1.0, 1.0]),
                           [0, 0, 1, 1], [2, 1, 3, 0])  # fmt: skip
    assert [t.shape[0] for t in out] == [2, 1, 3, 0]
    assert out[0][0] > 0 > out[1][0] and torch.all(out[0] == out[0][0])
    assert not out[2].any()  # equal rewards in a group: no advantage

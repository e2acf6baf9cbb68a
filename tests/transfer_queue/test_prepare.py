"""``prepare``: every row of a put is checked and normalized, the rows after the first too."""

from __future__ import annotations

import pytest
import torch

from asyncflow_actors.transfer_queue import SchemaError, TopicSpec
from asyncflow_actors.transfer_queue.client._batch import prepare

SPEC = TopicSpec.from_dict(
    {
        "consumers": ["trainer"],
        "columns": {
            "ids": {"dtype": "int64", "shape": [None]},
            "pairs": {"dtype": "float32", "shape": [None, 2]},
            "anything": {},
        },
    },
    name="t",
)


def ids(*lengths: int) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.int64) for n in lengths]


def test_rows_of_one_kind_are_taken_as_they_are_with_their_sizes() -> None:
    rows = ids(3, 0, 5)
    prepared = prepare(SPEC, {"ids": rows}, shared=False)
    out = prepared.columns["ids"]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(out, rows, strict=True))  # no copy
    assert out[1] is rows[1] and out[2] is rows[2]
    assert prepared.sizes["ids"] == [24, 0, 40]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.zeros(2, dtype=torch.int32), "dtype"),
        (torch.zeros(2, 2, dtype=torch.int64), "shape"),
        (torch.zeros(()), "dtype"),
        ([1, 2], "tensors"),
    ],
)
def test_a_later_row_unlike_the_first_is_refused(bad: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        prepare(SPEC, {"ids": [*ids(3, 4), bad]}, shared=False)


def test_a_later_row_with_a_wrong_fixed_dimension_is_refused() -> None:
    good = torch.zeros(3, 2)
    with pytest.raises(SchemaError, match="shape"):
        prepare(SPEC, {"pairs": [good, good, torch.zeros(3, 3)]}, shared=False)


def test_later_rows_are_detached_and_made_contiguous() -> None:
    leaf = torch.zeros(4, requires_grad=True)
    strided = torch.arange(8, dtype=torch.float32).reshape(2, 4)[:, ::2]
    rows = [torch.zeros(2).reshape(1, 2), (leaf * 2).reshape(2, 2), strided]
    assert not rows[2].is_contiguous()
    prepared = prepare(SPEC, {"pairs": rows}, shared=False)
    out = prepared.columns["pairs"]
    assert not out[1].requires_grad and out[1].grad_fn is None
    assert out[2].is_contiguous() and out[2].tolist() == [[0.0, 2.0], [4.0, 6.0]]
    assert prepared.sizes["pairs"] == [8, 16, 16]


def test_a_column_without_a_declared_type_takes_rows_of_any_kind() -> None:
    rows = [torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(3, 3), "text"]
    prepared = prepare(SPEC, {"anything": rows}, shared=False)
    assert [type(r) for r in prepared.columns["anything"]] == [torch.Tensor] * 3 + [str]

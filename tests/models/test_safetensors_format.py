from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.models import (
    SafetensorsError,
    deserialize_safetensors,
    load_safetensors,
    save_safetensors,
    serialize_safetensors,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=gen),
        "half": torch.randn(5, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64).reshape(7, 1),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int8),
        "strided": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_round_trip_with_metadata(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    path = tmp_path / "t.safetensors"
    save_safetensors(path, tensors, metadata={"config": '{"a": 1}', "note": "x"})
    content = load_safetensors(path)
    _assert_same(content.tensors, tensors)
    assert content.metadata == {"config": '{"a": 1}', "note": "x"}


def test_layout_header_is_aligned_and_data_contiguous() -> None:
    data = serialize_safetensors(_sample_tensors(), metadata={"k": "v"})
    (size,) = struct.unpack("<Q", data[:8])
    assert (8 + size) % 8 == 0
    header = json.loads(data[8 : 8 + size])
    assert header.pop("__metadata__") == {"k": "v"}
    spans = sorted(tuple(info["data_offsets"]) for info in header.values())
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == len(data) - 8 - size
    assert header["w"] == {
        "dtype": "F32",
        "shape": [3, 4],
        "data_offsets": header["w"]["data_offsets"],
    }
    assert header["half"]["dtype"] == "BF16"


def test_compatible_with_the_safetensors_package(tmp_path: Path) -> None:
    st_torch = pytest.importorskip("safetensors.torch")
    safetensors = pytest.importorskip("safetensors")
    tensors = _sample_tensors()
    ours = tmp_path / "ours.safetensors"
    save_safetensors(ours, tensors, metadata={"config": "{}"})
    _assert_same(st_torch.load_file(str(ours)), tensors)
    with safetensors.safe_open(str(ours), framework="pt") as fh:
        assert fh.metadata() == {"config": "{}"}

    theirs = tmp_path / "theirs.safetensors"
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    st_torch.save_file(contiguous, str(theirs), metadata={"format": "pt"})
    content = load_safetensors(theirs)
    _assert_same(content.tensors, tensors)
    assert content.metadata == {"format": "pt"}
    # Byte-level agreement of the payload: same tensors give the same bytes per tensor.
    assert deserialize_safetensors(st_torch.save(contiguous)).tensors.keys() == tensors.keys()


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=8).filter(
            lambda s: s != "__metadata__"
        ),
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 4), max_size=3),
            st.integers(0, 2**31 - 1),
        ),
        max_size=5,
    )
)
def test_round_trip_property(spec: dict[str, tuple[torch.dtype, list[int], int]]) -> None:
    tensors = {}
    for name, (dtype, shape, seed) in spec.items():
        gen = torch.Generator().manual_seed(seed)
        tensors[name] = (torch.randn(shape, generator=gen) * 50).to(dtype)
    _assert_same(deserialize_safetensors(serialize_safetensors(tensors)).tensors, tensors)


def _with_header(header: dict[str, object], payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + payload


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"\x01\x02", "shorter than"),
        (struct.pack("<Q", 1000) + b"{}", "header size"),
        (_with_header([], b""), "JSON object"),  # type: ignore[arg-type]
        (
            _with_header({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "unknown dtype",
        ),
        (
            _with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
            "do not hold 8 bytes",
        ),
        (
            _with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
            "contiguous",
        ),
        (
            _with_header({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
            "cover 4",
        ),
        (
            _with_header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b""),
            "shape",
        ),
        (_with_header({"__metadata__": {"k": 1}}, b""), "__metadata__"),
    ],
)
def test_malformed_files_raise(data: bytes, needle: str) -> None:
    with pytest.raises(SafetensorsError, match=needle):
        deserialize_safetensors(data)


def test_unstorable_inputs_raise() -> None:
    with pytest.raises(SafetensorsError, match="dtype"):
        serialize_safetensors({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(SafetensorsError, match="str to str"):
        serialize_safetensors({}, metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(SafetensorsError, match="__metadata__"):
        serialize_safetensors({"__metadata__": torch.zeros(1)})

"""Tensor dtypes on the wire, and ``RawTensor``: a tensor as bytes, without torch."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ._wire_registry import MalformedMessage

if TYPE_CHECKING:  # imported lazily: a node that only moves bytes never loads torch or numpy
    import numpy as np
    import torch


# ---------------------------------------------------------------------------------------- dtypes

_TORCH_DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
)
_ITEMSIZE: Final = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "bits8": 1, "bits16": 2,
}  # fmt: skip
"""Item size of every wire dtype name, known without importing torch (for ``RawTensor``)."""

_torch_tables: tuple[dict[str, torch.dtype], dict[torch.dtype, str]] | None = None


def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """(wire name -> torch dtype, and back) for the dtypes this torch has; imports torch."""
    global _torch_tables
    if _torch_tables is None:
        import torch

        by_name = {
            n: d
            for n in _TORCH_DTYPE_NAMES
            if isinstance(d := getattr(torch, n, None), torch.dtype)
        }
        _torch_tables = (by_name, {d: n for n, d in by_name.items()})
    return _torch_tables


def __getattr__(name: str) -> Any:
    if name == "TORCH_DTYPES":  # wire name -> torch dtype (imports torch)
        return _torch_dtypes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RawTensor:
    """A tensor as bytes: dtype name, shape and a buffer, without torch.

    Decoding with ``raw_tensors`` yields these instead of torch tensors (a storage unit only
    moves bytes), and encoding one sends its buffer as-is, so a tensor can pass through a
    process without being materialized. ``rows(a, b)`` slices the first dimension with no
    copy; ``concat_rows`` joins row blocks (one copy); ``to_torch()`` imports torch.
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: memoryview) -> None:
        self.dtype = dtype
        self.shape = shape
        self.data = data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _ITEMSIZE[self.dtype]

    def rows(self, start: int, stop: int) -> RawTensor:
        size = self.row_bytes
        return RawTensor(
            self.dtype, (stop - start, *self.shape[1:]), self.data[start * size : stop * size]
        )

    @staticmethod
    def concat_rows(parts: Sequence[RawTensor]) -> RawTensor:
        """Concatenate along the first dimension (parts must agree on dtype and row shape)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for part in parts[1:]:
            if part.dtype != first.dtype or part.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"cannot concatenate {part.dtype}{list(part.shape)} rows with "
                    f"{first.dtype}{list(first.shape)} rows"
                )
        data = memoryview(b"".join(part.data for part in parts))
        rows = sum(part.shape[0] for part in parts)
        return RawTensor(first.dtype, (rows, *first.shape[1:]), data)

    def to_torch(self) -> torch.Tensor:
        import torch

        dtype = _torch_dtypes()[0][self.dtype]
        if self.data.nbytes == 0:
            return torch.empty(self.shape, dtype=dtype)
        if not self.data.readonly:  # (a copy-on-write mapping): no warning to silence
            return torch.frombuffer(self.data, dtype=torch.uint8).view(dtype).reshape(self.shape)
        with warnings.catch_warnings():  # costs more than the rest: only where it warns
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            u8 = torch.frombuffer(self.data, dtype=torch.uint8)
        return u8.view(dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"RawTensor({self.dtype}, {list(self.shape)}, {self.nbytes} bytes)"


_NUMPY_KINDS: Final = frozenset("biufc")
_numpy_dtypes: dict[str, np.dtype[Any]] = {}  # validated dtype strings seen on the wire


def _numpy_dtype(s: object) -> np.dtype[Any]:
    import numpy as np

    if type(s) is str:
        dt = _numpy_dtypes.get(s)
        if dt is not None:
            return dt
        if len(s) <= 8:
            try:
                dt = np.dtype(s)
            except Exception:
                dt = None
            # Only canonical strings of plain numeric dtypes, which also bounds this cache.
            if dt is not None and dt.kind in _NUMPY_KINDS and dt.shape == () and dt.str == s:
                _numpy_dtypes[s] = dt
                return dt
    raise MalformedMessage(f"invalid numpy dtype {s!r}: expected a numeric dtype string")

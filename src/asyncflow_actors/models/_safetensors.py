"""The safetensors file format, written and read without the `safetensors` package.

Layout: an unsigned little-endian 64-bit header size N; N bytes of JSON mapping each tensor
name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data that
follows) plus an optional `"__metadata__"` map of str to str; then the raw little-endian
tensor bytes, contiguous, without gaps. The header is padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping

import attrs
import torch
from torch import Tensor

__all__ = [
    "SafetensorsError",
    "SafetensorsFile",
    "deserialize_safetensors",
    "load_safetensors",
    "save_safetensors",
    "serialize_safetensors",
]

_MAX_HEADER = 100 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class SafetensorsError(ValueError):
    """Bytes are not a valid safetensors file, or a tensor cannot be stored in one."""


@attrs.frozen
class SafetensorsFile:
    """Tensors (CPU) and the string metadata of a safetensors file."""

    tensors: dict[str, Tensor]
    metadata: dict[str, str]


def _check_host() -> None:
    if sys.byteorder != "little":
        raise SafetensorsError("safetensors I/O here supports little-endian hosts only")


def serialize_safetensors(
    tensors: Mapping[str, Tensor], *, metadata: Mapping[str, str] | None = None
) -> bytes:
    """The bytes of a safetensors file holding `tensors` (copied to CPU) and `metadata`.

    Tensors are laid out by decreasing element size, then by name, so every tensor starts
    aligned to its element size. Raises `SafetensorsError` for an unsupported dtype, a
    non-string metadata entry or the reserved name `__metadata__`.
    """
    _check_host()
    entries: list[tuple[str, Tensor]] = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise SafetensorsError(f"tensor name must be a str other than __metadata__: {name!r}")
        if tensor.dtype not in _NAMES:
            raise SafetensorsError(
                f"tensor {name!r} has dtype {tensor.dtype}, not storable; "
                f"expected one of {sorted(_NAMES, key=str)}"
            )
        entries.append((name, tensor))
    entries.sort(key=lambda item: (-item[1].element_size(), item[0]))

    header: dict[str, object] = {}
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise SafetensorsError(
                    f"metadata must map str to str, got {key!r}: {type(value).__name__}"
                )
        header["__metadata__"] = dict(metadata)
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in entries:
        data = _tensor_bytes(tensor)
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def _tensor_bytes(tensor: Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def deserialize_safetensors(data: bytes | bytearray | memoryview) -> SafetensorsFile:
    """Parse safetensors bytes; the tensors are CPU copies. Raises `SafetensorsError`."""
    _check_host()
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise SafetensorsError(f"file is {len(view)} bytes, shorter than the 8-byte header size")
    (size,) = struct.unpack("<Q", view[:8])
    if size > _MAX_HEADER or 8 + size > len(view):
        raise SafetensorsError(
            f"header size {size} exceeds the file ({len(view)} bytes) or the {_MAX_HEADER}-byte cap"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + size]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"header must be a JSON object, got {type(header).__name__}")

    raw_meta = header.pop("__metadata__", None) or {}
    if not isinstance(raw_meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()
    ):
        raise SafetensorsError(f"__metadata__ must map str to str, got {raw_meta!r}")

    buffer = bytearray(view[8 + size :])
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, Tensor] = {}
    for name, info in header.items():
        dtype, shape, begin, end = _parse_entry(name, info)
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected or end > len(buffer):
            raise SafetensorsError(
                f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {expected} bytes "
                f"of {_NAMES[dtype]} {shape} within a data section of {len(buffer)} bytes"
            )
        spans.append((begin, end, name))
        tensors[name] = _tensor_from(buffer, begin, expected, dtype, shape)
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise SafetensorsError(
                f"tensor {name!r} starts at byte {begin}; expected {position} "
                "(data must be contiguous without gaps or overlaps)"
            )
        position = end
    if position != len(buffer):
        raise SafetensorsError(
            f"data section is {len(buffer)} bytes but the tensors cover {position}"
        )
    return SafetensorsFile(tensors=tensors, metadata=dict(raw_meta))


def _parse_entry(name: str, info: object) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name!r}: entry must be an object, got {info!r}")
    dtype = _DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if dtype is None:
        raise SafetensorsError(
            f"tensor {name!r}: unknown dtype {info.get('dtype')!r}; expected one of "
            f"{sorted(_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(f"tensor {name!r}: shape must be a list of ints >= 0, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SafetensorsError(
            f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
            f"got {offsets!r}"
        )
    return dtype, shape, offsets[0], offsets[1]


def _tensor_from(
    buffer: bytearray, begin: int, nbytes: int, dtype: torch.dtype, shape: list[int]
) -> Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=begin)
    if begin % dtype.itemsize != 0:
        raw = raw.clone()  # a misaligned start cannot be reinterpreted in place
    return raw.view(dtype).reshape(shape)


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` and `metadata` to `path` as a safetensors file (atomic replace)."""
    data = serialize_safetensors(tensors, metadata=metadata)
    target = os.fspath(path)
    tmp = f"{target}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)


def load_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Read a safetensors file from `path` (tensors on CPU). Raises `SafetensorsError`."""
    with open(path, "rb") as fh:
        return deserialize_safetensors(fh.read())

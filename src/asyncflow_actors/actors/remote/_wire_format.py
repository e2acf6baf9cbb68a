"""The wire format's constants and tags, shared by the encoder (``_wire``) and the decoder."""

from __future__ import annotations

from typing import Final

import msgspec

WIRE_VERSION: Final = 2  # 2: lists of small tensors packed in one body (``TENSORS``)
DEFAULT_INLINE_THRESHOLD: Final = 4096
"""Bodies smaller than this many bytes travel inside the header; larger ones as data frames.

Measured (``wire_inline_*`` in ``benchmarks/bench_wire.py``): CPU cost is the same either way up
to 64 KiB, and a tcp round trip is no slower inline up to ~8 KiB (one frame less), so bodies up to
a page go inline, as owned copies, and larger ones keep zero copy and alignment.
"""
DEFAULT_MAX_FRAMES: Final = 65536
MAX_DEPTH: Final = 64
"""Deepest nesting of containers accepted in a payload (and in ``meta``), on both sides."""
_MAX_DIMS: Final = 32
_MAX_DIM: Final = 1 << 48


class _Tag:
    __slots__ = ("code", "ext", "label")

    def __init__(self, code: int, label: str) -> None:
        self.code = code
        self.label = label
        self.ext = msgspec.msgpack.Ext(code, b"")

    def __repr__(self) -> str:
        return f"<tag {self.label}>"


_TUPLE: Final = _Tag(1, "tuple")
_OBJECT: Final = _Tag(2, "object")
_ENUM: Final = _Tag(3, "enum")
_TENSOR: Final = _Tag(4, "tensor")
_NDARRAY: Final = _Tag(5, "ndarray")
_BYTES: Final = _Tag(6, "bytes")
_REF: Final = _Tag(7, "ref")
_SET: Final = _Tag(8, "set")
_FROZENSET: Final = _Tag(9, "frozenset")
_TENSORS: Final = _Tag(10, "tensors")
_TAGS: Final = {
    t.code: t
    for t in (_TUPLE, _OBJECT, _ENUM, _TENSOR, _NDARRAY, _BYTES, _REF, _SET, _FROZENSET, _TENSORS)
}
PACK_MIN: Final = 4
"""A list of at least this many small tensors of one dtype travels as one ``TENSORS`` node."""

_SCALARS: Final = frozenset({type(None), bool, int, float, str})
_INLINE: Final = frozenset({type(None), bool, int, float, str, bytes})
_BYTES_LIKE: Final = (bytes, bytearray, memoryview)

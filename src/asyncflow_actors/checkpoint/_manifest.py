"""The manifest of a sync: which tensors, and where each byte of them goes in which bucket.

Tensors are packed in the order given into buckets of at most ``bucket_bytes`` bytes. A tensor
that fits in the space left in the current bucket goes there (its start aligned to
``ALIGNMENT`` bytes, so a receiver can view it in place as its dtype); one that does not starts
a new bucket; one larger than a whole bucket is split across consecutive buckets. Empty tensors
take no bytes (they are named in the manifest all the same). With ``split=False`` (the file
transport: one safetensors file per bucket) every tensor lies whole in one bucket, which may then
exceed ``bucket_bytes`` by the size of a single large tensor.

The manifest is a plain value (frozen attrs classes of ints and strs), sent to every receiver
before the broadcast. Checksums are not in it: they are computed while packing and sent with the
finalize request; the prepare request that carries the manifest names their algorithm
(``docs/weight_sync.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import attrs

from ._errors import ManifestError

if TYPE_CHECKING:
    import torch

#: Byte alignment of every tensor's start inside a bucket (the largest element size, complex128).
ALIGNMENT: Final = 16

#: dtypes a sync carries, by torch name; each travels as its raw little-endian bytes.
DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (e.g. ``"bfloat16"``); ``ManifestError`` if unknown."""
    import torch

    dtype = getattr(torch, name, None) if name in DTYPE_NAMES else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"dtype {name!r} is not one of {list(DTYPE_NAMES)} (in this torch)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ManifestError(f"dtype {dtype} cannot be synced; expected one of {list(DTYPE_NAMES)}")
    return name


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


def _pieces(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    return tuple(pieces)


def _tensors(tensors: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    return tuple(tensors)


def _buckets(buckets: Iterable[BucketSpec]) -> tuple[BucketSpec, ...]:
    return tuple(buckets)


@attrs.frozen
class TensorSpec:
    """A tensor of the manifest: its name, dtype (torch name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)

    @property
    def itemsize(self) -> int:
        return int(dtype_of(self.dtype).itemsize)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@attrs.frozen
class Piece:
    """``nbytes`` bytes of tensor ``tensor`` (an index into ``Manifest.tensors``), from byte
    ``offset`` of the tensor, stored at byte ``start`` of the bucket."""

    tensor: int
    offset: int
    start: int
    nbytes: int


@attrs.frozen
class BucketSpec:
    """One bucket: its index, its size in bytes, and the pieces it holds (in byte order)."""

    index: int
    nbytes: int
    pieces: tuple[Piece, ...] = attrs.field(converter=_pieces)


@attrs.frozen
class Manifest:
    """Everything a receiver needs to rebuild the tensors from the buckets."""

    tensors: tuple[TensorSpec, ...] = attrs.field(converter=_tensors)
    buckets: tuple[BucketSpec, ...] = attrs.field(converter=_buckets)
    bucket_bytes: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def max_bucket(self) -> int:
        """Bytes of the largest bucket."""
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def bucket_total(self) -> int:
        """Bytes of all buckets (padding included): what each receiver gets."""
        return sum(b.nbytes for b in self.buckets)

    def pieces_of(self) -> list[list[tuple[int, Piece]]]:
        """For each tensor, its ``(bucket index, piece)`` pairs in byte order."""
        out: list[list[tuple[int, Piece]]] = [[] for _ in self.tensors]
        for bucket in self.buckets:
            for piece in bucket.pieces:
                out[piece.tensor].append((bucket.index, piece))
        return out

    def check(self) -> None:
        """Raise ``ManifestError`` unless the pieces cover every tensor exactly once, in range.

        Receivers run this on the manifest they are sent, so a corrupt one fails before any
        memory is allocated for it.
        """
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ManifestError("manifest names a tensor twice")
        for t in self.tensors:
            dtype_of(t.dtype)
            if any(d < 0 for d in t.shape):
                raise ManifestError(f"tensor {t.name!r} has a negative dimension {t.shape}")
        for i, bucket in enumerate(self.buckets):
            if bucket.index != i:
                raise ManifestError(f"bucket {i} is numbered {bucket.index}")
            end = 0
            for p in bucket.pieces:
                if not 0 <= p.tensor < len(self.tensors) or p.nbytes <= 0 or p.start < end:
                    raise ManifestError(f"bucket {i} has a malformed piece {p}")
                end = p.start + p.nbytes
            if end > bucket.nbytes:
                raise ManifestError(f"bucket {i} is {bucket.nbytes} bytes, its pieces need {end}")
        for index, pieces in enumerate(self.pieces_of()):
            spec, covered = self.tensors[index], 0
            for _, p in pieces:
                if p.offset != covered:
                    raise ManifestError(f"tensor {spec.name!r}: bytes from {covered} missing")
                covered += p.nbytes
            if covered != spec.nbytes:
                raise ManifestError(
                    f"tensor {spec.name!r}: pieces cover {covered} of its {spec.nbytes} bytes"
                )


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, *, split: bool = True) -> Manifest:
    """Pack ``specs`` (in order) into buckets of at most ``bucket_bytes`` (module docstring)."""
    _check_bucket_bytes(bucket_bytes)
    segments = [(index, 0, spec.nbytes) for index, spec in enumerate(specs)]
    return Manifest(tuple(specs), tuple(_pack(segments, bucket_bytes, split, [])), bucket_bytes)


def plan_segments(
    specs: Sequence[TensorSpec],
    segments: Sequence[Sequence[tuple[int, int, int]]],
    bucket_bytes: int,
) -> tuple[Manifest, tuple[int, ...]]:
    """Buckets for several senders, each holding part of the tensors (the shards of a sharded
    trainer's ranks): ``segments[s]`` lists sender *s*'s ``(tensor index, byte offset,
    nbytes)`` in order. Each sender's segments are packed as ``plan_buckets`` packs tensors
    (aligned, split where larger than a bucket) into buckets of its own, sender after sender:
    so that every tensor's pieces lie in byte order (``Manifest.check``), sender *s*'s bytes
    of a tensor must follow sender *s - 1*'s. Returns the manifest and each bucket's sender."""
    _check_bucket_bytes(bucket_bytes)
    buckets: list[BucketSpec] = []
    senders: list[int] = []
    for sender, mine in enumerate(segments):
        added = _pack(mine, bucket_bytes, True, buckets)
        senders += [sender] * len(added)
        buckets += added
    manifest = Manifest(tuple(specs), tuple(buckets), bucket_bytes)
    manifest.check()
    return manifest, tuple(senders)


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGNMENT:
        raise ManifestError(f"bucket_bytes must be an int >= {ALIGNMENT}, got {bucket_bytes!r}")


def _pack(
    segments: Iterable[tuple[int, int, int]],
    bucket_bytes: int,
    split: bool,
    before: Sequence[BucketSpec],
) -> list[BucketSpec]:
    """``(tensor, offset, nbytes)`` segments packed into buckets numbered after ``before``."""
    buckets: list[BucketSpec] = []
    pieces: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal pieces, used
        if pieces:
            buckets.append(BucketSpec(len(before) + len(buckets), used, tuple(pieces)))
        pieces, used = [], 0

    for index, base, size in segments:
        if size == 0:
            continue
        start = _align(used)
        if start + size <= bucket_bytes or (not split and not pieces):
            pieces.append(Piece(index, base, start, size))
            used = start + size
            continue
        if size <= bucket_bytes or not split:
            close()
            pieces.append(Piece(index, base, 0, size))
            used = size
            continue
        offset = 0  # larger than a bucket: fill what is left here, then whole buckets
        while offset < size:
            start = _align(used)
            if start >= bucket_bytes:
                close()
                start = 0
            n = min(size - offset, bucket_bytes - start)
            pieces.append(Piece(index, base + offset, start, n))
            used = start + n
            offset += n
    close()
    return buckets


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a flat uint8 tensor (a view when it is contiguous)."""
    import torch

    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def collect(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a state dict (or an iterable of pairs), checked: unique str names,
    dense tensors of a syncable dtype. Raises ``ManifestError`` naming the offending entry."""
    import torch

    items = weights.items() if isinstance(weights, Mapping) else weights
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for item in items:
        name, tensor = item
        if not isinstance(name, str) or not name:
            raise ManifestError(f"tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ManifestError(f"tensor {name!r} is given twice")
        if not isinstance(tensor, torch.Tensor):
            raise ManifestError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise ManifestError(f"tensor {name!r} is not dense ({tensor.layout}); densify it")
        try:
            dtype_name(tensor.dtype)
        except ManifestError as exc:
            raise ManifestError(f"tensor {name!r}: {exc}") from None
        seen.add(name)
        out.append((name, tensor))
    return out

"""Bucket bytes on both sides: the sender packs them, the receiver's host cache takes them in.

``BucketSource`` (sender) copies the pieces of bucket *k* from the named tensors into a buffer,
hashing each chunk right after writing it (it is still in cache: no second pass over the
bucket). ``HostCache`` (receiver) takes each bucket's bytes as they arrive: it keeps the bucket
itself (the tensors lying whole in it are viewed in place at the end, no copy) and copies the
pieces of split tensors into their own allocation, hashing a chunk at a time as it copies. Both
are plain synchronous code meant to run in a worker thread (``trio.to_thread``), so neither
side's event loop blocks on a copy.

The checksum is XXH3-64 (``"xxh3"``, the ``xxhash`` package: it reads memory about as fast as a
copy) or zlib's CRC-32 (``"crc32"``, three times slower); the sender names the one it used in
``SyncPrepare`` / ``SyncFused`` and a receiver that cannot compute it refuses the sync.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ._assembly import Assembly, Part
from ._copies import copy_bytes
from ._errors import ChecksumMismatch, IncompleteSync, ManifestError, UnknownChecksum
from ._manifest import Manifest, dtype_of, tensor_bytes

if TYPE_CHECKING:
    import numpy as np
    import torch

xxhash: Any
try:
    import xxhash
except ImportError:  # pragma: no cover - a core dependency; CRC-32 without it
    xxhash = None

#: Identifies this process: a receiver given a bucket by a sender with the same token shares
#: the sender's memory (a local ref, an in-process node) and must copy it before acknowledging.
PROCESS_TOKEN: Final = secrets.token_hex(8)


#: Copied and hashed a chunk at a time: the hash reads the chunk just written, from cache.
CHUNK: Final = 1 << 20

#: The checksum algorithms a sync may name, and how messages call them.
ALGORITHMS: Final = {"xxh3": "XXH3-64", "crc32": "CRC-32"}


def resolve_checksum(setting: str) -> str:
    """The algorithm a ``CheckpointConfig.checksum`` setting means in this process: ``"auto"``
    is ``"xxh3"`` when ``xxhash`` is importable, else ``"crc32"``; ``"none"`` is ``""``."""
    if setting == "auto":
        return "xxh3" if xxhash is not None else "crc32"
    return "" if setting == "none" else setting


class _Crc32:
    """zlib's CRC-32 with ``xxhash``'s streaming interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def hasher(algorithm: str) -> Any:
    """A fresh streaming hasher (``update``, ``intdigest``) of ``algorithm``; raises
    ``UnknownChecksum`` for one this process cannot compute."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3" and xxhash is not None:
        return xxhash.xxh3_64()
    known = [name for name in ALGORITHMS if name != "xxh3" or xxhash is not None]
    raise UnknownChecksum(f"checksum {algorithm!r} is not available here (known: {known})")


def checksum(data: torch.Tensor, algorithm: str = "crc32") -> int:
    """The ``algorithm`` digest of a flat uint8 tensor's bytes (copied to host memory first if
    on a device), hashed a chunk at a time."""
    digest = hasher(algorithm)
    if data.device.type != "cpu":
        data = data.cpu()
    view = data.numpy()
    for i in range(0, view.size, CHUNK):
        digest.update(view[i : i + CHUNK])
    return int(digest.intdigest())


def _span(
    src: np.ndarray[Any, Any],
    dst: np.ndarray[Any, Any] | None,
    digest: Any,
) -> None:
    """Copy ``src`` to ``dst`` (``None``: no copy) a chunk at a time, feeding ``digest`` (if
    any) each chunk just written (or read) while it is in cache."""
    n = src.size
    if digest is None:
        if dst is not None and n:
            dst[:] = src
        return
    for i in range(0, n, CHUNK):
        j = min(n, i + CHUNK)
        if dst is None:
            digest.update(src[i:j])
        else:
            dst[i:j] = src[i:j]
            digest.update(dst[i:j])


class BucketSource:
    """The sender's view of a sync's tensors: packs any bucket of ``manifest`` into a buffer.

    ``offsets``: ``tensors[i]`` holds manifest tensor *i*'s bytes from byte ``offsets[i]`` on
    (a shard of it: a sender of ``plan_segments`` packs only the buckets of its segments);
    empty: every tensor whole."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        manifest: Manifest,
        *,
        algorithm: str,
        offsets: Sequence[int] = (),
    ) -> None:
        if algorithm:
            hasher(algorithm)  # refuse an unknown one before anything is paused
        self.tensors = list(tensors)
        self.manifest = manifest
        self.algorithm = algorithm  # "" without checksums
        self.offsets = list(offsets)
        self._flat: dict[int, torch.Tensor] = {}

    @property
    def with_checksum(self) -> bool:
        return bool(self.algorithm)

    def _offset(self, index: int) -> int:
        return self.offsets[index] if self.offsets else 0

    def _bytes_of(self, index: int) -> torch.Tensor:
        flat = self._flat.get(index)
        if flat is None:
            tensor = self.tensors[index]
            flat = tensor_bytes(tensor)
            if tensor.numel() and flat.data_ptr() != tensor.data_ptr():
                self._flat[index] = flat  # made by a copy: keep it for the tensor's other pieces
        return flat

    def direct(self, index: int, device: str) -> torch.Tensor | None:
        """Bucket ``index`` as a view of its tensor's own bytes, when it holds exactly one whole
        contiguous tensor on ``device``: such a bucket is sent without packing (zero-copy)."""
        import torch

        bucket = self.manifest.buckets[index]
        if len(bucket.pieces) != 1:
            return None
        piece = bucket.pieces[0]
        tensor = self.tensors[piece.tensor]
        want = torch.device(device)
        if (
            piece.nbytes != bucket.nbytes
            or piece.offset != self._offset(piece.tensor)
            or piece.nbytes != tensor.numel() * tensor.element_size()
            or not tensor.is_contiguous()
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.device.type != want.type
            or (want.index is not None and tensor.device.index != want.index)
        ):
            return None
        return tensor_bytes(tensor)

    def pack(self, index: int, out: torch.Tensor) -> int:
        """Copy bucket ``index`` into ``out`` (flat uint8, exactly its size); return its digest
        (0 without checksums), computed a chunk at a time as it is written. Padding between
        pieces is zeroed, so a bucket's bytes and digest depend on the weights alone."""
        bucket = self.manifest.buckets[index]
        if out.numel() != bucket.nbytes:
            raise ValueError(f"bucket {index} is {bucket.nbytes} bytes, buffer {out.numel()}")
        digest = hasher(self.algorithm) if self.algorithm else None
        if out.device.type != "cpu":  # a device buffer: pack on the device, then hash it
            digest = None
        end = 0
        for piece in bucket.pieces:
            if piece.start > end:
                out[end : piece.start].zero_()
                if digest is not None:
                    _span(out[end : piece.start].numpy(), None, digest)
            at = piece.offset - self._offset(piece.tensor)
            src = self._bytes_of(piece.tensor)[at : at + piece.nbytes]
            if src.numel() != piece.nbytes or at < 0:
                raise ManifestError(
                    f"bucket {index}: tensor {piece.tensor} bytes {piece.offset}.."
                    f"{piece.offset + piece.nbytes} are not held here"
                )
            dst = out[piece.start : piece.start + piece.nbytes]
            if digest is None or src.device.type != "cpu":
                copy_bytes(dst, src)
                if digest is not None:
                    _span(dst.numpy(), None, digest)
            else:
                _span(src.numpy(), dst.numpy(), digest)
            end = piece.start + piece.nbytes
        if end < bucket.nbytes:
            out[end:].zero_()
            if digest is not None:
                _span(out[end:].numpy(), None, digest)
        if digest is not None:
            return int(digest.intdigest())
        return checksum(out, self.algorithm) if self.algorithm else 0


class HostCache:
    """A receiver's staging area for one sync: received buckets, verified, then named tensors.

    ``copy``: the bucket tensors handed in belong to someone else (same process as the sender):
    copy what is kept before acknowledging. ``algorithm``: the checksum the sender named
    (``""``: none), computed on arrival; ``UnknownChecksum`` for one this process lacks.

    A tensor split across buckets needs its pieces copied into one allocation. From a bucket
    it owns, the cache only checksums them on arrival and keeps the bucket; ``staged`` then
    returns that copy as an ``Assembly`` to run after the commit (``_assembly``). From a
    bucket it must copy before acknowledging, it copies them into place at once.
    """

    def __init__(self, manifest: Manifest, *, copy: bool, algorithm: str) -> None:
        import torch

        if algorithm:
            hasher(algorithm)  # refused before any memory is allocated
        self.manifest = manifest
        self.copy = copy
        self.algorithm = algorithm
        self.pieces = manifest.pieces_of()
        n = len(manifest.buckets)
        self.buckets: list[torch.Tensor | None] = [None] * n
        self.received: list[bool] = [False] * n
        self.crcs: list[int] = [0] * n  # each bucket's digest (``algorithm``)
        self.whole: dict[str, torch.Tensor] = {}  # tensors staged whole (the file transport)
        # tensors split across buckets, put together in their own memory, piece by piece
        self.split = {i for i, pieces in enumerate(self.pieces) if len(pieces) > 1}
        # pieces copied on arrival (from buckets that are not ours) go here at once
        self.assembled: dict[int, torch.Tensor] = {}
        if copy:
            self.assembled = {
                i: torch.empty(manifest.tensors[i].nbytes, dtype=torch.uint8) for i in self.split
            }
        self.later: list[bool] = [False] * n  # a kept bucket whose split pieces wait (staged)
        self.bytes = 0

    @property
    def with_checksum(self) -> bool:
        return bool(self.algorithm)

    def _claim(self, index: int) -> None:
        if not 0 <= index < len(self.buckets):
            raise ManifestError(f"bucket {index} is not in the manifest ({len(self.buckets)})")
        if self.received[index]:
            raise ManifestError(f"bucket {index} received twice")

    def take(self, index: int, data: torch.Tensor) -> None:
        """Claim bucket ``index`` for ``data`` (flat uint8), checking index and size; cheap.
        ``digest`` must follow. Raises ``ManifestError`` for a bucket of the wrong size or
        index, or one received twice."""
        import torch

        self._claim(index)
        spec = self.manifest.buckets[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != spec.nbytes:
            raise ManifestError(
                f"bucket {index}: expected {spec.nbytes} bytes as a flat uint8 tensor, got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        self.received[index] = True
        self.bytes += spec.nbytes

    def digest(self, index: int, data: torch.Tensor, owned: bool = False) -> int:
        """Checksum a taken bucket while copying its split pieces out and keeping it (a copy of
        it when it is not ours: ``owned`` says it is, whatever ``copy`` says; from a device,
        the host copy), a chunk at a time in byte order, each chunk hashed where it was just
        written; return its size. Thread-safe for distinct buckets."""
        import torch

        spec = self.manifest.buckets[index]
        ours = not self.copy or owned
        if data.device.type != "cpu":
            data, ours = data.cpu(), True
        later = ours and any(p.tensor in self.split for p in spec.pieces)
        keep = later or any(p.tensor not in self.split for p in spec.pieces)
        kept = data if ours or not keep else torch.empty_like(data)
        digest = hasher(self.algorithm) if self.algorithm else None
        src = data.numpy()
        dst = None if kept is data else kept.numpy()
        end = 0
        for piece in spec.pieces:
            if piece.start > end:  # padding
                _span(
                    src[end : piece.start], None if dst is None else dst[end : piece.start], digest
                )
            whole = src[piece.start : piece.start + piece.nbytes]
            out: np.ndarray[Any, Any] | None
            if piece.tensor not in self.split:  # a whole tensor: kept in the bucket, viewed later
                out = None if dst is None else dst[piece.start : piece.start + piece.nbytes]
            elif later:  # a split tensor's piece in a bucket we keep: copied after the commit
                out = None
            else:  # a split tensor's piece, not ours: into its own memory now
                dest = self.assembled[piece.tensor]
                out = dest.numpy()[piece.offset : piece.offset + piece.nbytes]
            _span(whole, out, digest)
            end = piece.start + piece.nbytes
        if end < spec.nbytes:
            _span(src[end:], None if dst is None else dst[end:], digest)
        self.crcs[index] = int(digest.intdigest()) if digest is not None else 0
        self.buckets[index] = kept if keep else None
        self.later[index] = later
        return spec.nbytes

    def stage_bucket(self, index: int, data: torch.Tensor) -> int:
        """``take`` then ``digest``."""
        self.take(index, data)
        return self.digest(index, data)

    def stage_tensors(self, index: int, tensors: dict[str, torch.Tensor], digest: int) -> int:
        """Take bucket ``index`` as whole tensors (a file shard), after checking that they are
        exactly the ones the manifest puts there, with their dtypes and shapes."""
        self._claim(index)
        spec = self.manifest.buckets[index]
        expected = {self.manifest.tensors[p.tensor].name: p.tensor for p in spec.pieces}
        if set(tensors) != set(expected):
            raise ManifestError(
                f"shard {index}: holds {sorted(tensors)}, the manifest says {sorted(expected)}"
            )
        for name, i in expected.items():
            want, got = self.manifest.tensors[i], tensors[name]
            if got.dtype != dtype_of(want.dtype) or tuple(got.shape) != want.shape:
                raise ManifestError(
                    f"shard {index}: {name!r} is {got.dtype} {tuple(got.shape)}, the manifest "
                    f"says {want.dtype} {want.shape}"
                )
        self.whole.update(tensors)
        self.crcs[index] = digest
        self.received[index] = True
        self.bytes += sum(t.nbytes for t in tensors.values())
        return spec.nbytes

    def missing(self) -> list[int]:
        return [i for i, got in enumerate(self.received) if not got]

    def verify(self, checksums: Sequence[int]) -> None:
        """Raise unless every bucket arrived and (with checksums) matches the sender's digest."""
        missing = self.missing()
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            raise IncompleteSync(
                f"{len(missing)} of {len(self.received)} buckets never arrived: {shown}"
            )
        if not self.with_checksum:
            return
        if len(checksums) != len(self.crcs):
            raise ChecksumMismatch(
                f"sender sent {len(checksums)} checksums for {len(self.crcs)} buckets"
            )
        for index, (want, got) in enumerate(zip(checksums, self.crcs, strict=True)):
            if want != got:
                names = sorted(
                    {
                        self.manifest.tensors[p.tensor].name
                        for p in self.manifest.buckets[index].pieces
                    }
                )
                raise ChecksumMismatch(
                    f"bucket {index} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}): "
                    f"{ALGORITHMS[self.algorithm]} {got:#x} received, {want:#x} sent"
                )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors (call after ``verify``): views into kept buckets where aligned,
        split tensors put together here (``staged`` leaves that to the caller)."""
        tensors, assembly = self.staged()
        if assembly is None:
            return tensors
        tensors.update(assembly.run())
        return {spec.name: tensors[spec.name] for spec in self.manifest.tensors}

    def staged(self) -> tuple[dict[str, torch.Tensor], Assembly | None]:
        """The named tensors that need no more copying (call after ``verify``), and the
        ``Assembly`` of the split tensors whose pieces wait in kept buckets (None if none)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        parts: list[Part] = []
        for i, spec in enumerate(self.manifest.tensors):
            dtype = dtype_of(spec.dtype)
            if spec.name in self.whole:
                out[spec.name] = self.whole[spec.name]
                continue
            pieces = self.pieces[i]
            if not pieces:
                out[spec.name] = torch.empty(spec.shape, dtype=dtype)
                continue
            if i in self.split:
                copies = []
                for bucket_index, piece in pieces:
                    bucket = self.buckets[bucket_index]
                    if self.later[bucket_index] and bucket is not None:
                        copies.append(
                            (bucket[piece.start : piece.start + piece.nbytes], piece.offset)
                        )
                dest = self.assembled.get(i)
                if copies or dest is None:
                    parts.append(Part(spec, dest, copies))
                    continue
                raw = dest
            else:
                bucket_index, piece = pieces[0]
                bucket = self.buckets[bucket_index]
                assert bucket is not None
                raw = bucket[piece.start : piece.start + piece.nbytes]
                if raw.data_ptr() % dtype.itemsize:
                    raw = raw.clone()  # a misaligned frame: torch kernels want aligned data
            out[spec.name] = raw.view(dtype).reshape(spec.shape)
        return out, Assembly(parts) if parts else None

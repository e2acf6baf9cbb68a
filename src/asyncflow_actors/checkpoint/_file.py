"""The file transport: each version as safetensors shards in a directory.

For syncs across clusters (a shared file system), debugging, and resuming a run. The sender
writes bucket *k* as ``model-0000k-of-0000n.safetensors`` (whole tensors: this transport never
splits one) in a hidden ``.v<version>-<sync>.partial`` directory and asks every receiver to read
it (``ReadShard``) while it writes the next one (two shards in flight). Once every receiver
verified the sync, the sender adds ``manifest.json`` (our manifest with each shard's digest and
its algorithm) and a
Hugging Face style ``model.safetensors.index.json``, renames the directory to ``v<version>``
(atomic publish) and removes all but the newest ``keep_versions`` versions. A failed sync removes
its partial directory. ``read_weights`` loads a published version back (verifying checksums).

The files are standard safetensors (``asyncflow_actors.models``' reader and writer), readable by
the ``safetensors`` package; dtypes it cannot store (complex) are refused before the sync starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

# models is a leaf (pure torch, no library imports): its safetensors codec is shared here.
from ..models import deserialize_safetensors, serialize_safetensors
from ._buckets import ALGORITHMS, CHUNK, hasher, resolve_checksum
from ._copies import run_sync
from ._errors import ChecksumMismatch, ManifestError
from ._manifest import Manifest, dtype_of
from ._messages import ReadShard
from ._transport import SyncSession, ask_all

if TYPE_CHECKING:
    import torch

FORMAT = "asyncflow_actors.weights/1"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")
_UNSTORABLE = frozenset({"complex64", "complex128"})  # safetensors has no complex dtypes


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _digest(data: bytes, algorithm: str) -> int:
    """The ``algorithm`` digest of ``data`` (0 for ``""``: no checksum)."""
    if not algorithm:
        return 0
    digest = hasher(algorithm)
    view = memoryview(data)
    for i in range(0, len(view), CHUNK):
        digest.update(view[i : i + CHUNK])
    return int(digest.intdigest())


def read_shard(path: str, algorithm: str) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a shard file and the ``algorithm`` digest of its bytes (0 for ``""``)."""
    data = Path(path).read_bytes()
    return deserialize_safetensors(data).tensors, _digest(data, algorithm)


class FileTransport:
    """Safetensors shards in ``directory`` (module docstring)."""

    kind = "file"
    split = False

    def __init__(self, directory: str | os.PathLike[str], *, keep_versions: int = 2) -> None:
        self.directory = Path(directory)
        self.keep_versions = keep_versions
        self._partial: dict[str, Path] = {}

    def check(self, manifest: Manifest) -> None:
        for spec in manifest.tensors:
            if spec.dtype in _UNSTORABLE:
                raise ManifestError(
                    f"tensor {spec.name!r} is {spec.dtype}, which safetensors cannot store "
                    "(use another transport)"
                )

    async def open(self, session: SyncSession) -> None:
        partial = self.directory / f".v{session.version:08d}-{session.sync_id}.partial"
        await trio.to_thread.run_sync(lambda: partial.mkdir(parents=True, exist_ok=False))
        self._partial[session.sync_id] = partial

    def _write(self, session: SyncSession, index: int, path: Path) -> int:
        manifest = session.manifest
        pieces = manifest.buckets[index].pieces
        tensors = {
            manifest.tensors[p.tensor].name: session.source.tensors[p.tensor] for p in pieces
        }
        metadata = {"format": FORMAT, "version": str(session.version), "shard": str(index)}
        data = serialize_safetensors(tensors, metadata=metadata)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return _digest(data, session.source.algorithm)

    async def broadcast(self, session: SyncSession) -> None:
        partial = self._partial[session.sync_id]
        count = len(session.manifest.buckets)
        slots = trio.Semaphore(2)  # two shards in flight: write k+1 while k is being read

        async def deliver(index: int, path: str) -> None:
            try:
                await ask_all(session.receivers, lambda _: ReadShard(session.sync_id, index, path))
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            for bucket in session.manifest.buckets:
                await slots.acquire()
                path = partial / _shard_name(bucket.index, count)
                crc = await run_sync(
                    session.config.offload, self._write, session, bucket.index, path
                )
                session.checksums[bucket.index] = crc
                nursery.start_soon(deliver, bucket.index, str(path))

    async def close(self, session: SyncSession, *, failed: bool) -> None:
        partial = self._partial.pop(session.sync_id, None)
        if partial is None:
            await trio.lowlevel.checkpoint()
            return
        if failed:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(partial, ignore_errors=True))
        else:
            await trio.to_thread.run_sync(self._publish, session, partial)

    def _publish(self, session: SyncSession, partial: Path) -> None:
        manifest = session.manifest
        count = len(manifest.buckets)
        shards = []
        weight_map: dict[str, str] = {}
        for bucket in manifest.buckets:
            name = _shard_name(bucket.index, count)
            names = [manifest.tensors[p.tensor].name for p in bucket.pieces]
            weight_map.update(dict.fromkeys(names, name))
            shards.append(
                {"file": name, "digest": session.checksums[bucket.index], "tensors": names}
            )
        record = {
            "format": FORMAT,
            "version": session.version,
            "sync_id": session.sync_id,
            "checksum": session.source.algorithm or "none",
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in manifest.tensors
            ],
            "shards": shards,
        }
        index = {"metadata": {"total_size": manifest.payload_bytes}, "weight_map": weight_map}
        (partial / "manifest.json").write_text(json.dumps(record, indent=1))
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        final = self.directory / f"v{session.version:08d}"
        if final.exists():  # the same version synced again: replace it
            trash = self.directory / f".{final.name}-{session.sync_id}.old"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(partial, final)
        for old in _versions(self.directory)[: -self.keep_versions]:
            shutil.rmtree(self.directory / f"v{old:08d}", ignore_errors=True)


def _versions(directory: Path) -> list[int]:
    found = []
    for entry in directory.iterdir() if directory.is_dir() else ():
        match = _VERSION_DIR.match(entry.name)
        if match and (entry / "manifest.json").is_file():
            found.append(int(match.group(1)))
    return sorted(found)


def read_weights(
    directory: str | os.PathLike[str], version: int | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Load a version published by the file transport (the newest when ``version`` is None):
    ``(version, tensors)``. Shards are checked against the manifest's digests and specs.

    Raises ``FileNotFoundError`` when there is no such version, ``ChecksumMismatch`` or
    ``ManifestError`` when the files do not match their manifest.
    """
    import torch

    root = Path(directory)
    versions = _versions(root)
    if version is None:
        if not versions:
            raise FileNotFoundError(f"no published version in {root}")
        version = versions[-1]
    folder = root / f"v{version:08d}"
    record: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    if record.get("format") != FORMAT:
        raise ManifestError(f"{folder}: unknown format {record.get('format')!r}")
    out: dict[str, torch.Tensor] = {}
    algorithm = resolve_checksum(record["checksum"])
    for shard in record["shards"]:
        tensors, digest = read_shard(str(folder / shard["file"]), algorithm)
        want = shard.get("digest", shard.get("crc32"))  # "crc32": written before XXH3-64
        if algorithm and digest != want:
            raise ChecksumMismatch(
                f"{folder / shard['file']}: {ALGORITHMS[algorithm]} {digest:#x} on disk, "
                f"{want:#x} in the manifest"
            )
        out.update(tensors)
    for spec in record["tensors"]:
        name, dtype, shape = spec["name"], dtype_of(spec["dtype"]), tuple(spec["shape"])
        tensor = out.setdefault(name, torch.empty(shape, dtype=dtype))  # empty ones: no bytes
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ManifestError(f"{folder}: {name!r} on disk differs from the manifest")
    return version, out

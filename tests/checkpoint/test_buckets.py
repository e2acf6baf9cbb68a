"""Bucket packing: plan, pack, stage and unpack round-trip exactly (hypothesis properties)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncflow_actors.checkpoint import (
    BucketSource,
    CheckpointConfig,
    ChecksumMismatch,
    HostCache,
    IncompleteSync,
    Manifest,
    ManifestError,
    Piece,
    TensorSpec,
    UnknownChecksum,
    _buckets,
    plan_buckets,
)
from asyncflow_actors.checkpoint._buckets import (
    ALGORITHMS,
    CHUNK,
    checksum,
    hasher,
    resolve_checksum,
)
from asyncflow_actors.checkpoint._manifest import (
    ALIGNMENT,
    DTYPE_NAMES,
    collect,
    spec_of,
    tensor_bytes,
)

DTYPES = [
    getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(
        st.one_of(
            st.just(()),  # 0-d
            st.lists(st.integers(0, 6), min_size=1, max_size=3),  # may be empty
            st.tuples(st.integers(1, 300)),  # long: split across small buckets
        )
    )
    n = math.prod(shape) * dtype.itemsize
    raw = (
        torch.tensor(list(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
        if n
        else None
    )
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    tensor = raw.view(dtype).reshape(shape)
    if draw(st.booleans()) and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # non-contiguous: packed from a contiguous copy
    return tensor


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t).numpy())


def roundtrip(
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    copy: bool,
    algorithm: str = "xxh3",
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    manifest = plan_buckets([spec_of(n, t) for n, t in named], bucket_bytes)
    manifest.check()
    source = BucketSource([t for _, t in named], manifest, algorithm=algorithm)
    cache = HostCache(manifest, copy=copy, algorithm=algorithm)
    sums = []
    for bucket in reversed(manifest.buckets):  # arrival order does not matter
        out = source.direct(bucket.index, "cpu")
        if out is None:
            out = torch.full((bucket.nbytes,), 0xAB, dtype=torch.uint8)
            sums.append(source.pack(bucket.index, out))
        else:
            sums.append(checksum(out, algorithm) if algorithm else 0)
        cache.stage_bucket(bucket.index, out)
    cache.verify(list(reversed(sums)))
    return manifest, cache.tensors()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(tensors(), max_size=8),
    st.integers(ALIGNMENT, 2048),
    st.booleans(),
    st.sampled_from(["xxh3", "crc32", ""]),
)
def test_pack_unpack_round_trips_exactly(
    values: list[torch.Tensor], bucket_bytes: int, copy: bool, algorithm: str
) -> None:
    named = [(f"t{i}.weight", t) for i, t in enumerate(values)]
    manifest, got = roundtrip(named, bucket_bytes, copy=copy, algorithm=algorithm)
    assert list(got) == [n for n, _ in named]
    for name, tensor in named:
        out = got[name]
        assert out.dtype == tensor.dtype and out.shape == tensor.shape
        assert as_bytes(out) == as_bytes(tensor), name
        assert out.is_contiguous()
    for bucket in manifest.buckets:
        assert bucket.nbytes <= bucket_bytes
        for piece in bucket.pieces:
            if piece.offset == 0 and piece.nbytes == manifest.tensors[piece.tensor].nbytes:
                assert piece.start % ALIGNMENT == 0  # whole tensors are viewable in place


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.integers(ALIGNMENT, 4096))
def test_plan_fills_buckets_and_splits_only_large_tensors(
    sizes: list[int], bucket_bytes: int
) -> None:
    specs = [TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    manifest = plan_buckets(specs, bucket_bytes)
    manifest.check()
    pieces = manifest.pieces_of()
    for i, n in enumerate(sizes):
        if n <= bucket_bytes:
            assert len(pieces[i]) == 1  # small tensors are never split
    # a new bucket starts only when the next tensor does not fit in the current one
    for a, b in zip(manifest.buckets, manifest.buckets[1:], strict=False):
        first = b.pieces[0]
        if first.offset == 0:
            need = manifest.tensors[first.tensor].nbytes
            aligned = -(-a.nbytes // ALIGNMENT) * ALIGNMENT
            assert aligned + min(need, bucket_bytes) > bucket_bytes


def test_a_bucket_of_one_whole_contiguous_tensor_is_sent_from_the_tensor() -> None:
    big, small = torch.arange(64, dtype=torch.float32), torch.arange(3, dtype=torch.int16)
    named = [("small", small), ("big", big), ("t", big.reshape(8, 8).t())]
    manifest = plan_buckets([spec_of(n, t) for n, t in named], 256)
    source = BucketSource([t for _, t in named], manifest, algorithm="xxh3")
    assert [len(b.pieces) for b in manifest.buckets] == [1, 1, 1]
    assert source.direct(0, "cpu") is not None  # "small" alone (the next does not fit)
    view = source.direct(1, "cpu")
    assert view is not None and view.data_ptr() == big.data_ptr()  # no copy
    assert source.direct(2, "cpu") is None  # not contiguous: packed
    assert source.direct(1, "cuda") is None  # another device: packed there
    split = plan_buckets([spec_of("big", big)], 128)
    assert BucketSource([big], split, algorithm="").direct(0, "cpu") is None


def test_unsplit_plan_keeps_every_tensor_whole() -> None:
    specs = [TensorSpec("a", "float32", (100,)), TensorSpec("b", "float32", (3,))]
    manifest = plan_buckets(specs, 64, split=False)
    manifest.check()
    assert [len(p) for p in manifest.pieces_of()] == [1, 1]
    assert manifest.buckets[0].nbytes == 400  # a single tensor may exceed the bucket


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
def test_checksums_catch_a_flipped_bit_and_missing_buckets(algorithm: str) -> None:
    named = [("a", torch.arange(64, dtype=torch.float32)), ("b", torch.ones(40, dtype=torch.int64))]
    manifest = plan_buckets([spec_of(n, t) for n, t in named], 256)
    source = BucketSource([t for _, t in named], manifest, algorithm=algorithm)
    cache = HostCache(manifest, copy=True, algorithm=algorithm)
    sums = []
    for bucket in manifest.buckets:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8)
        sums.append(source.pack(bucket.index, out))
        if bucket.index == 0:
            with pytest.raises(IncompleteSync, match="never arrived"):
                cache.verify(sums)
        if bucket.index == 1:
            out[3] ^= 1
        cache.stage_bucket(bucket.index, out)
    with pytest.raises(ChecksumMismatch, match=f"bucket 1 .*{ALGORITHMS[algorithm]}"):
        cache.verify(sums)
    with pytest.raises(ManifestError, match="twice"):
        cache.stage_bucket(0, torch.zeros(manifest.buckets[0].nbytes, dtype=torch.uint8))


def test_cache_refuses_wrong_sizes_and_shards() -> None:
    manifest = plan_buckets([TensorSpec("a", "float32", (4,))], 64, split=False)
    cache = HostCache(manifest, copy=False, algorithm="")
    with pytest.raises(ManifestError, match="expected 16 bytes"):
        cache.stage_bucket(0, torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(ManifestError, match="not in the manifest"):
        cache.stage_bucket(1, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ManifestError, match="manifest says"):
        cache.stage_tensors(0, {"a": torch.zeros(4, dtype=torch.float64)}, 0)
    with pytest.raises(ManifestError, match="holds"):
        cache.stage_tensors(0, {"b": torch.zeros(4)}, 0)


def test_corrupt_manifests_are_refused() -> None:
    good = plan_buckets([TensorSpec("a", "int32", (10,)), TensorSpec("b", "int32", (10,))], 48)
    good.check()
    b0 = good.buckets[0]
    gap = Manifest(good.tensors, (b0.__class__(0, b0.nbytes, ()), *good.buckets[1:]), 48)
    with pytest.raises(ManifestError, match=r"missing|cover"):
        gap.check()
    overflow = Manifest(good.tensors, (b0.__class__(0, 8, b0.pieces), *good.buckets[1:]), 48)
    with pytest.raises(ManifestError, match="pieces need"):
        overflow.check()
    bad_piece = Manifest(good.tensors, (b0.__class__(0, 48, (Piece(7, 0, 0, 4),)),), 48)
    with pytest.raises(ManifestError, match="malformed"):
        bad_piece.check()
    with pytest.raises(ManifestError, match="dtype"):
        Manifest((TensorSpec("x", "float128", (1,)),), (), 48).check()


def test_collect_refuses_bad_weights() -> None:
    with pytest.raises(ManifestError, match="twice"):
        collect([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ManifestError, match=r"not a torch\.Tensor"):
        collect({"a": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(ManifestError, match="not dense"):
        collect({"s": torch.zeros(3, 3).to_sparse()})
    with pytest.raises(ManifestError, match="names"):
        collect({"": torch.zeros(1)})
    with pytest.raises(ManifestError, match=r"tensor .h.: dtype torch\.float8_e4m3fnuz"):
        collect({"h": torch.zeros(2, dtype=torch.float8_e4m3fnuz)})
    with pytest.raises(ManifestError, match="bucket_bytes"):
        plan_buckets([], 4)


@pytest.mark.parametrize("n", [0, 1, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 3])
def test_copy_bytes_copies_exactly_below_and_above_the_small_copy_size(n: int) -> None:
    import warnings

    from asyncflow_actors.checkpoint._copies import copy_bytes

    raw = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).tolist())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only frame, as a received one may be
        src = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    dst = torch.full((n + 8,), 7, dtype=torch.uint8)
    copy_bytes(dst[4 : 4 + n], src)
    assert bytes(dst[4 : 4 + n].tolist()) == raw
    assert dst[:4].tolist() == [7] * 4 and dst[4 + n :].tolist() == [7] * 4


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
@pytest.mark.parametrize("copy", [True, False])
def test_buckets_of_many_chunks_hash_as_one_pass_and_refuse_a_flipped_byte(
    algorithm: str, copy: bool
) -> None:
    """Hashed a chunk at a time while packing and while staging (buckets of several ``CHUNK``s,
    a tensor split across them, padding between pieces): the digests are those of the whole
    bucket, the tensors arrive bit-exact, and one flipped byte anywhere is refused."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (5 * CHUNK + 3,), dtype=torch.uint8, generator=gen)
    named = [("small", torch.arange(7, dtype=torch.int16)), ("big", big)]
    named.append(("tail", torch.randn(CHUNK // 4 + 1, generator=gen)))
    manifest = plan_buckets([spec_of(n, t) for n, t in named], 2 * CHUNK)
    source = BucketSource([t for _, t in named], manifest, algorithm=algorithm)
    for flip in (None, 0, len(manifest.buckets) - 1):
        cache = HostCache(manifest, copy=copy, algorithm=algorithm)
        sums = []
        for bucket in manifest.buckets:
            out = torch.empty(bucket.nbytes, dtype=torch.uint8)
            sums.append(source.pack(bucket.index, out))
            assert sums[-1] == checksum(out, algorithm)  # a chunked pass hashes the whole bucket
            if bucket.index == flip:
                out[bucket.nbytes - 2] ^= 0x10
            cache.stage_bucket(bucket.index, out)
        if flip is not None:
            with pytest.raises(ChecksumMismatch, match=f"bucket {flip}"):
                cache.verify(sums)
            continue
        cache.verify(sums)
        got = cache.tensors()
        for name, tensor in named:
            assert as_bytes(got[name]) == as_bytes(tensor), name


def test_an_unknown_algorithm_is_refused_on_both_sides() -> None:
    manifest = plan_buckets([TensorSpec("a", "float32", (4,))], 64)
    with pytest.raises(UnknownChecksum, match="md5"):
        HostCache(manifest, copy=False, algorithm="md5")
    with pytest.raises(UnknownChecksum, match="md5"):
        BucketSource([torch.zeros(4)], manifest, algorithm="md5")
    assert issubclass(UnknownChecksum, ManifestError)


def test_auto_picks_xxh3_when_xxhash_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xxhash")
    assert resolve_checksum("auto") == "xxh3"
    assert CheckpointConfig().checksum == "auto"
    assert resolve_checksum("crc32") == "crc32" and resolve_checksum("none") == ""
    monkeypatch.setattr(_buckets, "xxhash", None)
    assert resolve_checksum("auto") == "crc32"
    with pytest.raises(UnknownChecksum):
        hasher("xxh3")

"""The wire format: round trips of every supported type, zero copy, and defensive decoding."""

from __future__ import annotations

import enum
import gc
import math
import random
import sys
import warnings
from typing import Any

import attrs
import msgspec
import numpy as np
import pytest
import torch
import trio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow_actors.actors.remote._address import ActorAddress
from asyncflow_actors.actors.remote._wire import (
    MAX_DEPTH,
    TORCH_DTYPES,
    WIRE_VERSION,
    MalformedMessage,
    MessageRegistry,
    MessageTooLarge,
    RegistrationError,
    UnknownType,
    UnsupportedValue,
    WireError,
    decode,
    encode,
)
from asyncflow_actors.actors.remote._zmq import open_zmq_socket

LIMIT = 1 << 30


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Perm(enum.Flag):
    R = 1
    W = 2


@attrs.frozen
class Sample:
    tokens: Any
    mask: Any
    _version: int = 0


@attrs.frozen(kw_only=True)
class Batch:
    samples: list[Sample]
    extras: dict[Any, Any] = attrs.field(factory=dict)
    color: Color = Color.RED


@attrs.frozen
class Positive:
    n: int = attrs.field(validator=attrs.validators.gt(0))


def make_registry() -> MessageRegistry:
    reg = MessageRegistry()
    for cls in (Sample, Batch, Positive, Color, Level, Perm):
        reg.register(cls)
    return reg


REG = make_registry()


def roundtrip(payload: object, *, meta: dict[str, Any] | None = None, **kw: Any) -> object:
    frames = encode(meta or {}, payload, registry=REG, **kw)
    got_meta, out = decode(frames, registry=REG, max_message_bytes=LIMIT)
    assert got_meta == (meta or {})
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Every bit pattern (NaNs, infinities, subnormals) except for bool, which must be 0/1."""
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    u8 = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return u8.view(dtype).reshape(shape)


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(TORCH_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (64, 33)])
@pytest.mark.parametrize("inline_threshold", [0, 1 << 20])
def test_every_tensor_dtype_roundtrips_bit_exactly(
    name: str, shape: tuple[int, ...], inline_threshold: int
) -> None:
    t = random_tensor(TORCH_DTYPES[name], shape)
    out = roundtrip(t, inline_threshold=inline_threshold)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == t.dtype
    assert out.shape == t.shape
    assert raw_bytes(out) == raw_bytes(t)


def test_expected_dtypes_are_supported() -> None:
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16"):
        assert name in TORCH_DTYPES
    for name in ("float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"):
        assert name in TORCH_DTYPES


@pytest.mark.parametrize("inline_threshold", [0, 1 << 20])
def test_non_contiguous_conj_and_grad_tensors_are_sent_as_their_values(
    inline_threshold: int,
) -> None:
    # inline_threshold 1 << 20: every body inline, through the small-tensor fast path
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = [
        base.t(),
        base[:, ::2],
        base[1:3, 2:],
        base[2],  # contiguous at a storage offset
        base[1, 3],  # 0-d at a storage offset
        base.reshape(-1)[5:11],
        (torch.arange(8.0) * (1 + 2j)).to(torch.complex64).conj(),
        torch._neg_view(torch.arange(6.0)),  # the negative bit, resolved on the way
        torch.ones(3, requires_grad=True) * 2,
        torch.nn.Parameter(torch.ones(2, 2)),
        torch.tensor(7.5, dtype=torch.bfloat16).expand(3, 2),
        torch.tensor([True, False, True])[1:],
    ]
    for t in cases:
        out = roundtrip(t, inline_threshold=inline_threshold)
        assert isinstance(out, torch.Tensor)
        assert type(out) is torch.Tensor
        assert not out.requires_grad
        assert out.is_contiguous()
        assert torch.equal(out, t.detach().resolve_conj().resolve_neg())
        assert out.shape == t.shape and out.dtype == t.dtype


@pytest.mark.parametrize(
    "dtype",
    ["?", "u1", "i1", "<i2", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8", ">f8", "<c8", "<c16"],
)
@pytest.mark.parametrize("shape", [(), (0,), (7, 3)])
def test_numpy_arrays_roundtrip(dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
    arr = (raw % 2).astype(bool) if dt.kind == "b" else raw.view(dt)
    arr = arr.reshape(shape)
    for threshold in (0, 1 << 20):
        out = roundtrip(arr, inline_threshold=threshold)
        assert type(out) is np.ndarray
        assert out.dtype == arr.dtype
        assert out.shape == arr.shape
        assert out.tobytes() == arr.tobytes()


def test_non_contiguous_numpy_array() -> None:
    arr = np.arange(30.0).reshape(5, 6)[::2, 1::2]
    out = roundtrip(arr, inline_threshold=0)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, arr)


def test_nested_attrs_payload_roundtrips() -> None:
    samples = [
        Sample(torch.arange(5000), torch.ones(5000, dtype=torch.bool), version=3),
        Sample([1, 2.5, "x", None, True], np.arange(4, dtype=np.int16)),
    ]
    batch = Batch(
        samples=samples,
        extras={
            1: "int key",
            "t": (Level.HIGH, Perm.R | Perm.W, b"small", b"x" * 10_000),
            "nested": [[{"a": (1, (2, [3]))}]],
            "bytes_like": [bytearray(b"ba"), memoryview(b"mv" * 3000)],
        },
        color=Color.BLUE,
    )
    out = roundtrip(batch, meta={"kind": "tell", "corr": 7, "path": ["a", 1]})
    assert isinstance(out, Batch)
    assert out.color is Color.BLUE
    assert out.samples[0]._version == 3
    assert torch.equal(out.samples[0].tokens, samples[0].tokens)
    assert torch.equal(out.samples[0].mask, samples[0].mask)
    assert out.samples[1].tokens == [1, 2.5, "x", None, True]
    np.testing.assert_array_equal(out.samples[1].mask, samples[1].mask)
    assert out.extras[1] == "int key"
    level, perm, small, big = out.extras["t"]
    assert level is Level.HIGH
    assert perm == Perm.R | Perm.W
    assert (small, big) == (b"small", b"x" * 10_000)
    assert type(big) is bytes
    assert out.extras["nested"] == [[{"a": (1, (2, [3]))}]]
    assert out.extras["bytes_like"] == [b"ba", b"mv" * 3000]


@given(
    rows=st.lists(st.integers(0, 9), min_size=0, max_size=40),
    dtype=st.sampled_from([torch.int64, torch.float32, torch.bool, torch.bfloat16, torch.uint8]),
    trailing=st.sampled_from([(), (3,)]),
)
@settings(max_examples=100, deadline=None)
def test_lists_of_small_tensors_travel_packed_and_round_trip(
    rows: list[int], dtype: torch.dtype, trailing: tuple[int, ...]
) -> None:
    """The rows of a variable-length column: one body and one node for the whole list (a
    node per tensor made a fetch of a few hundred rows cost milliseconds), decoded as a list of
    tensors equal to what was sent, in order, with their shapes."""
    gen = torch.Generator().manual_seed(len(rows))
    values = [(torch.rand((n, *trailing), generator=gen) * 3).to(dtype) for n in rows]
    frames = encode({}, {"rows": values}, registry=REG)
    got = decode(frames, registry=REG, max_message_bytes=LIMIT)[1]["rows"]
    assert type(got) is list and len(got) == len(values)
    for a, b in zip(values, got, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    header = msgspec.msgpack.decode(frames[0])
    node = header[2]["rows"]
    packed = len(values) >= 4
    tag = node[0] if node else None
    assert (type(tag) is msgspec.msgpack.Ext and tag.code == 10) is packed, node[:2]


def test_encoding_while_another_thread_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node imports torch in a worker thread while its links already talk: a half-imported
    module (no ``Tensor`` yet) must read as "no torch", not fail the message (it failed one
    connect in four to a hand-started node once lists were checked for tensors)."""
    import types

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "numpy", types.ModuleType("numpy"))
    address = ActorAddress("n", "/a", ("tcp://127.0.0.1:1",), 1, "t")
    value = {"items": [1, 2, 3, 4, 5], "names": ["a", "b", "c", "d"], "ref": address}
    got = decode(encode({}, value, registry=REG), registry=REG, max_message_bytes=LIMIT)[1]
    assert got == value


def test_mixed_lists_and_large_tensors_are_not_packed() -> None:
    """Packing is for lists of small tensors of one dtype only: a large tensor keeps its own
    zero-copy frame, and mixed lists are sent item by item (both still round-trip)."""
    small = [torch.arange(3) for _ in range(5)]
    cases = {
        "mixed_dtype": [*small, torch.ones(2)],
        "mixed_type": [*small, 7],
        "large": [*small, torch.zeros(4096, dtype=torch.uint8)],
        "strided": [*small, torch.arange(10)[::2]],
    }
    frames = encode({}, cases, registry=REG)
    header = msgspec.msgpack.decode(frames[0])
    for name, node in header[2].items():
        assert not (type(node[0]) is msgspec.msgpack.Ext and node[0].code == 10), name
    got = decode(frames, registry=REG, max_message_bytes=LIMIT)[1]
    for name, values in cases.items():
        for a, b in zip(values, got[name], strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_large_packed_list_travels_in_one_frame() -> None:
    values = [torch.full((100,), k, dtype=torch.int64) for k in range(40)]  # 32 KB in all
    frames = encode({}, values, registry=REG)
    assert len(frames) == 2, "one data frame for the list"
    got = decode(frames, registry=REG, max_message_bytes=LIMIT)[1]
    assert [int(t[0]) for t in got] == list(range(40))


def test_small_bodies_are_inline_and_large_ones_are_frames() -> None:
    big = torch.zeros(10_000)
    payload = [torch.zeros(10), big, b"s" * 100, b"b" * 100_000, np.zeros(4)]
    frames = encode({}, payload, registry=REG, inline_threshold=4096)
    assert len(frames) == 3
    assert [memoryview(f).nbytes for f in frames[1:]] == [40_000, 100_000]
    # Data frames are views of the payload's memory, not copies.
    assert np.frombuffer(frames[1], np.uint8).ctypes.data == big.data_ptr()


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text()
        | st.binary(max_size=64),
        lambda children: (
            st.lists(children, max_size=5)
            | st.lists(children, max_size=5).map(tuple)
            | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=5)
        ),
        max_leaves=30,
    )
)
@settings(max_examples=150, deadline=None)
def test_plain_data_roundtrips(value: object) -> None:
    assert roundtrip(value, inline_threshold=16) == value


# -------------------------------------------------------------------------------- zero copy


def frame_range(frame: zmq.Frame) -> tuple[int, int]:
    start = np.frombuffer(frame.buffer, np.uint8).ctypes.data
    return start, start + len(frame)


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_received_tensor_storage_lies_in_the_frame(transport: str) -> None:
    ctx = zmq.Context()
    try:
        bind = "tcp://127.0.0.1:*" if transport == "tcp" else "inproc://wire-zero-copy"
        sent = {
            "w": random_tensor(torch.bfloat16, (256, 512)),
            "b": random_tensor(torch.int64, (4096,)),
        }
        async with (
            open_zmq_socket(ctx, zmq.PAIR, bind=bind) as a,
            open_zmq_socket(ctx, zmq.PAIR, connect=a.bound_endpoints[0]) as b,
        ):
            await b.send_multipart(encode({}, sent, registry=REG))
            with trio.fail_after(10):
                frames = await a.recv_multipart()
        _, got = decode(frames, registry=REG, max_message_bytes=LIMIT)
        assert isinstance(got, dict)
        for key, frame in zip(["w", "b"], frames[1:], strict=True):
            lo, hi = frame_range(frame)
            t = got[key]
            assert lo <= t.data_ptr()
            assert t.data_ptr() + t.nbytes <= hi
            assert raw_bytes(t) == raw_bytes(sent[key])
        # The tensor keeps its frame alive.
        del frames
        gc.collect()
        assert raw_bytes(got["w"]) == raw_bytes(sent["w"])
    finally:
        ctx.destroy(linger=0)


def test_frames_from_read_only_buffers_decode_without_warnings() -> None:
    t = random_tensor(torch.float32, (1000,))
    frames = [bytes(memoryview(f)) for f in encode({}, t, registry=REG, inline_threshold=0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, out = decode(frames, registry=REG, max_message_bytes=LIMIT)
    assert isinstance(out, torch.Tensor)
    assert raw_bytes(out) == raw_bytes(t)


def test_misaligned_frames_are_copied_to_aligned_memory() -> None:
    t = random_tensor(torch.complex128, (100,))
    header, body = encode({}, t, registry=REG, inline_threshold=0)
    shifted = bytearray(len(memoryview(body)) + 1)
    shifted[1:] = memoryview(body)
    _, out = decode([header, memoryview(shifted)[1:]], registry=REG, max_message_bytes=LIMIT)
    assert isinstance(out, torch.Tensor)
    assert out.data_ptr() % 16 == 0
    assert raw_bytes(out) == raw_bytes(t)


# ------------------------------------------------------------------------------ encode errors


@attrs.frozen
class Unregistered:
    x: int


class Plain:
    pass


def test_sets_and_read_only_maps_round_trip() -> None:
    import types

    payload = {
        "set": {1, "a", (2, 3)},
        "frozen": frozenset({"x", "y"}),
        "empty": frozenset(),
        "proxy": types.MappingProxyType({"k": [1, 2]}),
    }
    _, back = decode(encode({}, payload, registry=REG), registry=REG, max_message_bytes=1 << 20)
    assert back == {
        "set": {1, "a", (2, 3)},
        "frozen": frozenset({"x", "y"}),
        "empty": frozenset(),
        "proxy": {"k": [1, 2]},
    }
    assert type(back["set"]) is set and type(back["frozen"]) is frozenset


@pytest.mark.parametrize(
    ("payload", "path", "needle"),
    [
        (
            Batch(samples=[Sample(1, 2), Sample(3, Unregistered(1))]),
            "payload.samples[1].mask",
            "not registered",
        ),
        ({"a": [1, (2, lambda: 3)]}, "payload['a'][1][1]", "function"),
        ([torch.empty(3, device="meta")], "payload[0]", "device meta"),
        ({"s": torch.eye(3).to_sparse()}, "payload['s']", "sparse"),
        ({5: np.array(["a"])}, "payload[5]", "numpy dtype"),
        ([np.float32(1.0)], "payload[0]", "numpy scalar"),
        ([{1.5: 2}], "payload[0]", "dict key 1.5"),
        ({"set": {print}}, "payload['set'][0]", "builtin_function"),
        (Plain(), "payload", "Plain"),
        (enum.Enum("Other", "A").A, "payload", "not registered"),  # type: ignore[attr-defined]
        ([2**70], "payload", "msgpack"),
    ],
)
def test_encode_rejects_unsupported_values_naming_type_and_path(
    payload: object, path: str, needle: str
) -> None:
    with pytest.raises(UnsupportedValue) as info:
        encode({}, payload, registry=REG)
    assert info.value.path == path
    assert needle in str(info.value)
    assert isinstance(info.value, WireError)
    assert isinstance(info.value, TypeError)


def test_encode_rejects_cycles_and_deep_nesting() -> None:
    cyclic: list[object] = []
    cyclic.append(cyclic)
    deep: list[object] = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    for payload in (cyclic, deep):
        with pytest.raises(UnsupportedValue, match="deeper than"):
            encode({}, payload, registry=REG)


def test_encode_rejects_bad_meta() -> None:
    with pytest.raises(UnsupportedValue) as info:
        encode({"kind": "x", "obj": [Sample(1, 2)]}, None, registry=REG)
    assert info.value.path == "meta['obj'][0]"
    with pytest.raises(UnsupportedValue):
        encode({1: "x"}, None, registry=REG)  # type: ignore[dict-item]


# ---------------------------------------------------------------------------------- registry


def test_registry_names_and_conflicts() -> None:
    reg = MessageRegistry()

    @reg.register
    @attrs.frozen
    class A:
        x: int

    @reg.register(name="b")
    @attrs.frozen
    class B:
        x: int

    assert A in reg
    assert B in reg
    assert "b" in reg
    assert reg.name_of(A) == f"{A.__module__}:{A.__qualname__}"
    assert reg.lookup("b") is B
    assert reg.register(B, name="b") is B  # idempotent
    with pytest.raises(RegistrationError, match="already registered"):
        reg.register(A, name="b")
    with pytest.raises(RegistrationError, match="already registered as"):
        reg.register(A, name="other")
    with pytest.raises(RegistrationError, match="neither an attrs class nor an Enum"):
        reg.register(Plain)
    with pytest.raises(UnknownType):
        reg.lookup("nope")
    assert sorted(reg) == sorted([reg.name_of(A), "b"])
    assert len(reg) == 2


def test_sender_and_receiver_registries_must_agree() -> None:
    frames = encode({"corr": 1}, Positive(3), registry=REG)
    with pytest.raises(UnknownType) as info:
        decode(frames, registry=MessageRegistry(), max_message_bytes=LIMIT)
    assert info.value.name.endswith(":Positive")
    assert info.value.meta == {"corr": 1}  # the envelope survives for an error reply


# ------------------------------------------------------------------------------ decode errors

ENC = msgspec.msgpack.Encoder()
Ext = msgspec.msgpack.Ext


def header(
    body: object, nframes: int = 0, meta: object = None, version: object = WIRE_VERSION
) -> bytes:
    return ENC.encode([version, {} if meta is None else meta, body, nframes])


T_OBJ, T_ENUM, T_TENSOR, T_ARRAY = Ext(2, b""), Ext(3, b""), Ext(4, b""), Ext(5, b"")
POSITIVE = REG.name_of(Positive)


@pytest.mark.parametrize(
    ("frames", "error", "needle"),
    [
        ([], MalformedMessage, "empty"),
        ([b""], MalformedMessage, "msgpack"),
        ([b"\xff\x00garbage"], MalformedMessage, "msgpack"),
        ([header(None)[:-1]], MalformedMessage, "msgpack"),
        ([ENC.encode([1, {}, None])], MalformedMessage, "4-element"),
        ([header(None, version=WIRE_VERSION + 1)], MalformedMessage, "version"),
        ([header(None, version=True)], MalformedMessage, "version"),
        ([header(None, meta=[1])], MalformedMessage, "meta"),
        ([header(None, meta={1: 2})], MalformedMessage, "meta key"),
        ([header(None, nframes=1)], MalformedMessage, "announces"),
        ([header(None), b"extra"], MalformedMessage, "announces"),
        ([header(None, nframes=1), b"extra"], MalformedMessage, "not referenced"),
        ([header([T_OBJ, "nope:X", {}])], UnknownType, "nope:X"),
        ([header([T_OBJ, POSITIVE, {}])], MalformedMessage, "missing ['n']"),
        ([header([T_OBJ, POSITIVE, {"n": 1, "m": 2}])], MalformedMessage, "unexpected ['m']"),
        ([header([T_OBJ, POSITIVE, {"n": -1}])], MalformedMessage, "constructing"),
        ([header([T_OBJ, POSITIVE, [1]])], MalformedMessage, "not a map"),
        ([header([T_OBJ, 5, {}])], MalformedMessage, "not a str"),
        ([header([T_OBJ, REG.name_of(Color), {}])], MalformedMessage, "enum"),
        ([header([T_ENUM, REG.name_of(Color), "green"])], MalformedMessage, "not a member"),
        ([header([T_ENUM, POSITIVE, 1])], MalformedMessage, "not an enum"),
        ([header([T_TENSOR, "float32", [2], b"\x00" * 7])], MalformedMessage, "need 8"),
        ([header([T_TENSOR, "float33", [2], b"\x00" * 8])], MalformedMessage, "dtype"),
        ([header([T_TENSOR, "float32", [2**60, 2**60], b""])], MalformedMessage, "shape"),
        ([header([T_TENSOR, "float32", [-1], b""])], MalformedMessage, "shape"),
        ([header([T_TENSOR, "float32", [1.0], b""])], MalformedMessage, "shape"),
        ([header([T_TENSOR, "float32", [1] * 33, b""])], MalformedMessage, "shape"),
        ([header([T_TENSOR, "float32", [2**40, 2**40], 1], 1), b""], MalformedMessage, "bytes"),
        ([header([T_TENSOR, "float32", [1], 2], 1), b"\x00" * 4], MalformedMessage, "out of range"),
        ([header([T_TENSOR, "float32", [1], 0], 1), b"\x00" * 4], MalformedMessage, "out of range"),
        ([header([T_TENSOR, "float32", [1], True], 1), b"\x00" * 4], MalformedMessage, "neither"),
        (
            [header([[T_TENSOR, "uint8", [1], 1], [T_TENSOR, "uint8", [1], 1]], 1), b"\x00"],
            MalformedMessage,
            "twice",
        ),
        ([header([T_TENSOR, "bool", [2], b"\x01\x02"])], MalformedMessage, "bool"),
        ([header([T_ARRAY, "|b1", [2], b"\x01\x02"])], MalformedMessage, "bool"),
        ([header([T_ARRAY, "|O", [1], b"\x00" * 8])], MalformedMessage, "dtype"),
        ([header([T_ARRAY, "<U1", [1], b"\x00" * 4])], MalformedMessage, "dtype"),
        ([header([T_ARRAY, "(2,)<f4", [1], b"\x00" * 8])], MalformedMessage, "dtype"),
        ([header([T_TENSOR, "float32", [1]])], MalformedMessage, "arguments"),
        ([header([1, T_OBJ])], MalformedMessage, "outside"),
        ([header({(1, 2): 3})], MalformedMessage, "map key"),
        ([header([Ext(99, b"")])], MalformedMessage, "ext code"),
        ([header([Ext(1, b"x")])], MalformedMessage, "ext code"),
        (
            [ENC.encode([WIRE_VERSION, {}, msgspec.msgpack.Ext(-1, b"\x00" * 4), 0])],
            MalformedMessage,
            "datetime",
        ),
        ([b"\x94\x02\x80" + b"\x91" * 100 + b"\xc0\x00"], MalformedMessage, "deeper"),
        ([b"\xdd\xff\xff\xff\xff"], MalformedMessage, "truncated"),
        ([header(None, nframes=2), b"", b""], MessageTooLarge, "data frames"),
        ([header(None, nframes=1), b"x" * 2000], MessageTooLarge, "max_message_bytes"),
        ([header(None), 12], MalformedMessage, "not a byte buffer"),
    ],
)
def test_decode_rejects_malformed_messages(
    frames: list[Any], error: type[WireError], needle: str
) -> None:
    with pytest.raises(error) as info:
        decode(frames, registry=REG, max_message_bytes=1024, max_frames=1)
    assert needle in str(info.value)


def test_decode_rejects_headers_nested_beyond_the_recursion_limit() -> None:
    frames = [b"\x94\x02\x80" + b"\x91" * 100_000 + b"\xc0\x00"]
    with pytest.raises(MalformedMessage, match="recursion limit"):
        decode(frames, registry=REG, max_message_bytes=LIMIT)


# ------------------------------------------------------------------------------------- fuzz


def valid_messages() -> list[list[bytes]]:
    payloads: list[object] = [
        Batch(samples=[Sample(torch.arange(600), torch.ones(3, dtype=torch.bool), version=1)]),
        [np.arange(20.0), (1, "x", b"y" * 300), {"k": Level.LOW}],
        {"t": random_tensor(torch.bfloat16, (40, 3)), "e": torch.zeros(0), "p": Positive(2)},
    ]
    return [
        [
            bytes(memoryview(f))
            for f in encode({"kind": "tell", "n": i}, p, registry=REG, inline_threshold=64)
        ]
        for i, p in enumerate(payloads)
    ]


VALID = valid_messages()


def check_decode(frames: list[Any]) -> None:
    try:
        decode(frames, registry=REG, max_message_bytes=1 << 20, max_frames=16)
    except WireError:
        pass


@given(st.lists(st.binary(max_size=200), max_size=5))
@settings(max_examples=300, deadline=None)
def test_fuzz_random_frames_raise_only_wire_errors(frames: list[bytes]) -> None:
    check_decode(frames)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers().filter(lambda i: -(2**63) <= i < 2**64)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.builds(Ext, st.integers(-128, 127), st.binary(max_size=3)),
    lambda c: (
        st.lists(c, max_size=5)
        | st.dictionaries(st.text(max_size=5) | st.integers(), c, max_size=4)
    ),
    max_leaves=25,
)


@given(
    body=msgpack_values,
    head=st.sampled_from([T_OBJ, T_ENUM, T_TENSOR, T_ARRAY, Ext(1, b""), Ext(6, b"")]),
    name=st.sampled_from([POSITIVE, REG.name_of(Color), REG.name_of(Batch), "float32", "<f4", "x"]),
    frames=st.lists(st.binary(max_size=64), max_size=3),
)
@settings(max_examples=400, deadline=None)
def test_fuzz_structured_headers_raise_only_wire_errors(
    body: object, head: Ext, name: str, frames: list[bytes]
) -> None:
    for candidate in (
        body,
        [head, body],
        [head, name, body],
        [head, name, body, 1],
        [head, name, [2, 2], body],
    ):
        try:
            h = header(candidate, nframes=len(frames))
        except (OverflowError, msgspec.EncodeError):
            return
        check_decode([h, *frames])


@given(
    index=st.integers(0, len(VALID) - 1),
    mutation=st.sampled_from(["truncate", "flip", "swap", "drop", "dup", "cut_frame", "splice"]),
    data=st.data(),
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_mutated_valid_messages_raise_only_wire_errors(
    index: int, mutation: str, data: st.DataObject
) -> None:
    frames = list(VALID[index])
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    i = rng.randrange(len(frames))
    if mutation == "truncate":
        frames[0] = frames[0][: rng.randrange(len(frames[0]))]
    elif mutation == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            buf = bytearray(frames[0])
            pos = rng.randrange(len(buf))
            buf[pos] ^= 1 << rng.randrange(8)
            frames[0] = bytes(buf)
    elif mutation == "swap":
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    elif mutation == "drop":
        del frames[i]
    elif mutation == "dup":
        frames.insert(i, frames[i])
    elif mutation == "cut_frame":
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    else:
        other = VALID[rng.randrange(len(VALID))]
        frames[0] = (
            frames[0][: rng.randrange(len(frames[0]))] + other[0][rng.randrange(len(other[0])) :]
        )
    check_decode(frames)


def test_valid_fuzz_seeds_decode() -> None:
    for frames in VALID:
        meta, _ = decode(frames, registry=REG, max_message_bytes=1 << 20, max_frames=16)
        assert meta["kind"] == "tell"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_raw_tensors_pass_through_without_torch_bit_exactly(dtype: torch.dtype) -> None:
    from asyncflow_actors.actors.remote._wire import RawTensor

    reg = MessageRegistry()
    t = (torch.randn(300, 7) * 50).to(dtype)
    frames = encode({"k": "x"}, {"t": t}, registry=reg, inline_threshold=64)
    _, raw = decode(
        frames, registry=reg, max_message_bytes=1 << 30, raw_tensors=lambda m: m["k"] == "x"
    )
    assert isinstance(raw["t"], RawTensor)
    assert raw["t"].shape == (300, 7)
    # rows slice without copies; concatenation joins row blocks
    parts = [raw["t"].rows(0, 100), raw["t"].rows(100, 300)]
    assert parts[0].data.obj is raw["t"].data.obj
    joined = RawTensor.concat_rows(parts)
    again = encode({}, {"t": joined, "head": parts[0]}, registry=reg, inline_threshold=64)
    _, back = decode(again, registry=reg, max_message_bytes=1 << 30)
    assert torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))
    assert torch.equal(back["head"].view(torch.uint8), t[:100].view(torch.uint8))
    assert torch.equal(joined.to_torch().view(torch.uint8), t.view(torch.uint8))


def test_the_node_entry_point_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, asyncflow_actors.node; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)

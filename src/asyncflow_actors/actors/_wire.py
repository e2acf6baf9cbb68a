"""The wire format of remote actor messages: a msgpack header frame plus raw data frames.

A message is a list of ZMQ frames ``[header, *data]``. ``header`` is msgpack (msgspec) of the
array ``[WIRE_VERSION, meta, body, len(data)]``: ``meta`` is a small str-keyed map of msgpack
primitives (the envelope: kind, target, correlation id, ...), ``body`` is the encoded payload.
Each data frame is the raw bytes of one tensor, array or large ``bytes`` value, and is referenced
exactly once from the body. **No pickle**: only the types below can be sent.

Encoding of payload values (``body``)
-------------------------------------
None, bool, int, float, str, ``bytes`` (below the inline threshold), lists and dicts with str or
int keys are msgpack's own types. Every other value is a *tagged array*: a msgpack array whose
first element is a zero-length ext (``msgspec.msgpack.Ext(code, b"")``) naming the node kind,
followed by its arguments. User data never contains an ext, so tagged arrays cannot be confused
with lists::

    tuple               [TUPLE, *items]
    attrs instance      [OBJECT, registered_name, {field_name: value, ...}]
    enum member         [ENUM, registered_name, member.value]
    torch CPU tensor    [TENSOR, dtype_name, shape, data]      dtype_name e.g. "bfloat16"
    numpy array         [NDARRAY, dtype_str, shape, data]      dtype_str e.g. "<f4"
    large bytes         [BYTES, frame_index]

``data`` is ``bin`` (the body inline in the header, when smaller than ``inline_threshold``) or an
int, the index of a data frame in the message (1 = the first frame after the header).

Types round-trip as themselves except: ``bytearray`` and ``memoryview`` decode as ``bytes``;
tensors decode detached, contiguous and without autograd state; tensor subclasses (e.g.
``nn.Parameter``) decode as plain tensors. attrs classes and enums must be registered (by name) in
a :class:`MessageRegistry` on both sides; fields are sent by name, every ``init`` field exactly
once, and the class is rebuilt with its constructor, so validators run on the receiving side.

Zero copy
---------
On send, tensor and array bodies at or above ``inline_threshold`` are memoryviews of the tensor's
own storage (contiguous tensors are not copied). On receive, such a tensor is a view of the
received frame (``torch.frombuffer``): it keeps the frame alive and writes to it write to the
frame. Over ``inproc://`` libzmq hands the receiver the *sender's* buffer, so received tensors
must be treated as read-only unless cloned. A frame given as a read-only buffer (e.g. ``bytes``)
yields a tensor torch cannot protect (its non-writable warning is suppressed deliberately): it
must not be written. Frames whose address is not aligned to the dtype's item size (libzmq can
deliver small frames at odd offsets) are copied once, so every decoded tensor is aligned.
Large ``bytes`` are copied out of their frame (``bytes`` is immutable); use a uint8 tensor or
numpy array for zero-copy bulk bytes.

Decoding is defensive: anything wrong with a message raises a :class:`WireError` subclass, never
another exception, and nothing is allocated beyond the declared, size-checked frames.
"""

from __future__ import annotations

import enum
import math
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import msgspec

from ._raw_tensor import _ITEMSIZE, _NUMPY_KINDS, RawTensor, _numpy_dtype, _torch_dtypes
from ._raw_tensor import __getattr__ as __getattr__
from ._wire_registry import MalformedMessage as MalformedMessage
from ._wire_registry import MessageRegistry as MessageRegistry
from ._wire_registry import MessageTooLarge as MessageTooLarge
from ._wire_registry import RegistrationError as RegistrationError
from ._wire_registry import UnknownType as UnknownType
from ._wire_registry import UnsupportedValue as UnsupportedValue
from ._wire_registry import WireError as WireError
from ._wire_registry import _EnumSpec, _ObjSpec

if TYPE_CHECKING:  # imported lazily: a node that only moves bytes never loads torch or numpy
    import numpy as np
    import torch

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_FRAMES",
    "MAX_DEPTH",
    "WIRE_VERSION",
    "MalformedMessage",
    "MessageRegistry",
    "MessageTooLarge",
    "RawTensor",
    "RegistrationError",
    "UnknownType",
    "UnsupportedValue",
    "WireError",
    "decode",
    "encode",
]

WIRE_VERSION: Final = 1
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

_T = TypeVar("_T")


# -------------------------------------------------------------------------------------- encoding


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
_TAGS: Final = {t.code: t for t in (_TUPLE, _OBJECT, _ENUM, _TENSOR, _NDARRAY, _BYTES)}

_SCALARS: Final = frozenset({type(None), bool, int, float, str})
_INLINE: Final = frozenset({type(None), bool, int, float, str, bytes})
_BYTES_LIKE: Final = (bytes, bytearray, memoryview)
_ENCODER: Final = msgspec.msgpack.Encoder()


class _PathError(Exception):
    """Internal: an unsupported value; ``path`` collects segments while unwinding (innermost first)."""

    def __init__(self, message: str, value: object) -> None:
        super().__init__(message)
        self.message = message
        self.value_type = type(value)
        self.path: list[str] = []


class _Encoder:
    __slots__ = ("frames", "registry", "threshold")

    def __init__(self, registry: MessageRegistry, threshold: int) -> None:
        self.registry = registry
        self.threshold = threshold
        self.frames: list[bytes | memoryview] = []

    def data(self, view: memoryview) -> memoryview | int:
        if view.nbytes < self.threshold:
            return view
        self.frames.append(view)
        return len(self.frames)

    def walk(self, obj: object, depth: int) -> object:
        t = type(obj)
        if t in _SCALARS:
            return obj
        if depth >= MAX_DEPTH:
            raise _PathError(f"nesting deeper than {MAX_DEPTH} levels (or a cycle)", obj)
        if t is list:
            return self.seq(obj, depth)  # type: ignore[arg-type]
        if t is dict:
            return self.mapping(obj, depth)  # type: ignore[arg-type]
        if t is tuple:
            return [_TUPLE.ext, *self.seq(obj, depth)]  # type: ignore[arg-type]
        if t in _BYTES_LIKE:
            return self.raw_bytes(obj)  # type: ignore[arg-type]
        spec = self.registry._by_type.get(t)
        if type(spec) is _ObjSpec:
            fields = {}
            name = ""
            try:
                for name, _ in spec.fields:
                    v = getattr(obj, name)
                    fields[name] = v if type(v) in _SCALARS else self.walk(v, depth + 1)
            except _PathError as e:
                e.path.append(f".{name}")
                raise
            return [_OBJECT.ext, spec.name, fields]
        if type(spec) is _EnumSpec:
            try:
                value = self.walk(obj.value, depth + 1)  # type: ignore[attr-defined]
            except _PathError as e:
                e.path.append(".value")
                raise
            return [_ENUM.ext, spec.name, value]
        if t is RawTensor:
            raw: RawTensor = obj  # type: ignore[assignment]
            return [_TENSOR.ext, raw.dtype, list(raw.shape), self.data(raw.data)]
        torch_mod = sys.modules.get("torch")  # no torch loaded: obj cannot be a tensor
        if torch_mod is not None and isinstance(obj, torch_mod.Tensor):
            return self.tensor(obj)
        np_mod = sys.modules.get("numpy")
        if np_mod is not None and t is np_mod.ndarray:
            return self.ndarray(obj)  # type: ignore[arg-type]
        raise _PathError(_unsupported_reason(obj), obj)

    def seq(self, seq: list[object] | tuple[object, ...], depth: int) -> list[object]:
        for x in seq:
            if type(x) not in _SCALARS:
                break
        else:
            return seq if type(seq) is list else list(seq)
        out = []
        for i, x in enumerate(seq):
            try:
                out.append(x if type(x) in _SCALARS else self.walk(x, depth + 1))
            except _PathError as e:
                e.path.append(f"[{i}]")
                raise
        return out

    def mapping(self, d: dict[object, object], depth: int) -> dict[object, object]:
        out: dict[object, object] = {}
        for k, v in d.items():
            tk = type(k)
            if tk is not str and tk is not int:
                raise _PathError(
                    f"dict key {k!r} has type {tk.__qualname__}; expected str or int", k
                )
            try:
                out[k] = v if type(v) in _SCALARS else self.walk(v, depth + 1)
            except _PathError as e:
                e.path.append(f"[{k!r}]")
                raise
        return out

    def raw_bytes(self, b: bytes | bytearray | memoryview) -> object:
        view = memoryview(b)
        if view.format != "B" or view.ndim != 1:
            view = memoryview(view.tobytes())
        ref = self.data(view)
        return ref if type(ref) is memoryview else [_BYTES.ext, ref]

    def tensor(self, t: torch.Tensor) -> object:
        import torch

        if t.device.type != "cpu":
            raise _PathError(
                f"tensor on device {t.device}: only CPU tensors can be sent (call .cpu())", t
            )
        if t.layout != torch.strided or t.is_quantized:
            raise _PathError(
                f"{t.layout} tensor{' (quantized)' if t.is_quantized else ''}: only dense "
                "strided tensors can be sent",
                t,
            )
        name = _torch_dtypes()[1].get(t.dtype)
        if name is None:
            raise _PathError(f"tensor dtype {t.dtype} cannot be sent", t)
        try:
            t = t.detach()
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            shape = list(t.shape)
            view = t.contiguous().reshape(-1).view(torch.uint8).numpy().data
        except Exception as exc:
            raise _PathError(f"tensor cannot be viewed as bytes: {exc}", t) from exc
        return [_TENSOR.ext, name, shape, self.data(view)]

    def ndarray(self, a: np.ndarray[Any, Any]) -> object:
        import numpy as np

        dt = a.dtype
        if dt.kind not in _NUMPY_KINDS or dt.shape != ():
            raise _PathError(
                f"numpy dtype {dt} cannot be sent: only bool, int, uint, float, complex", a
            )
        shape = list(a.shape)
        view = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
        return [_NDARRAY.ext, dt.str, shape, self.data(view)]


def _unsupported_reason(obj: object) -> str:
    t = type(obj)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return f"numpy array subclass {t.__qualname__} cannot be sent: pass a plain ndarray"
    if np is not None and isinstance(obj, np.generic):
        return f"numpy scalar {t.__qualname__} cannot be sent: use a Python number or 0-d array"
    if attrs.has(t) or isinstance(obj, enum.Enum):
        return (
            f"{t.__module__}.{t.__qualname__} is not registered: register it in the "
            "MessageRegistry on both sides"
        )
    return (
        f"values of type {t.__module__}.{t.__qualname__} cannot be sent: expected None, bool, "
        "int, float, str, bytes, list, tuple, dict, a registered attrs class or enum, a CPU "
        "tensor or a numpy array"
    )


def _check_meta(obj: object, depth: int) -> None:
    t = type(obj)
    if t in _INLINE:
        return
    if depth >= MAX_DEPTH:
        raise _PathError(f"nesting deeper than {MAX_DEPTH} levels (or a cycle)", obj)
    if t is list or t is tuple:
        items: list[object] | tuple[object, ...] = obj  # type: ignore[assignment]
        for i, x in enumerate(items):
            try:
                _check_meta(x, depth + 1)
            except _PathError as e:
                e.path.append(f"[{i}]")
                raise
        return
    if t is dict:
        for k, v in obj.items():  # type: ignore[attr-defined]
            if type(k) is not str:
                raise _PathError(f"meta key {k!r} has type {type(k).__qualname__}; expected str", k)
            try:
                _check_meta(v, depth + 1)
            except _PathError as e:
                e.path.append(f"[{k!r}]")
                raise
        return
    raise _PathError(
        f"meta values must be msgpack primitives (None, bool, int, float, str, bytes, list, "
        f"dict); got {t.__qualname__}",
        obj,
    )


def encode(
    meta: Mapping[str, Any],
    payload: object,
    *,
    registry: MessageRegistry,
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
) -> list[bytes | memoryview]:
    """Encode one message as ZMQ frames: ``[header, *data]``.

    Data frames are memoryviews of the payload's tensors, arrays and large bytes, not copies:
    they must stay unmodified until the transport is done with them (see ``SendTracker``).
    Raises :class:`UnsupportedValue` naming the offending value's type and path
    (``payload.batch[3].mask``, ``meta['x']``) for anything that cannot be sent.
    """
    enc = _Encoder(registry, inline_threshold)
    root = "meta"
    try:
        meta_dict = dict(meta)
        _check_meta(meta_dict, 0)
        root = "payload"
        body = enc.walk(payload, 0)
    except _PathError as e:
        path = root + "".join(reversed(e.path))
        raise UnsupportedValue(e.message, path=path, value_type=e.value_type) from None
    try:
        header = _ENCODER.encode([WIRE_VERSION, meta_dict, body, len(enc.frames)])
    except Exception as exc:  # ints beyond 64 bits, lone surrogates in str, ...
        raise UnsupportedValue(
            f"not representable in msgpack: {exc}", path=root, value_type=type(exc)
        ) from exc
    return [header, *enc.frames]


# -------------------------------------------------------------------------------------- decoding


def _ext_hook(code: int, data: memoryview) -> object:
    tag = _TAGS.get(code)
    if tag is None or data.nbytes:
        raise MalformedMessage(f"unknown ext code {code} (length {data.nbytes}) in header")
    return tag


_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


class _Decoder:
    __slots__ = ("raw", "registry", "used", "views")

    def __init__(self, registry: MessageRegistry, views: list[memoryview], raw: bool) -> None:
        self.registry = registry
        self.views = views
        self.used = [False] * len(views)
        self.raw = raw

    def walk(self, obj: object, depth: int) -> object:
        t = type(obj)
        if t in _INLINE:
            return obj
        if depth >= MAX_DEPTH:
            raise MalformedMessage(f"payload nested deeper than {MAX_DEPTH} levels")
        if t is list:
            lst: list[object] = obj  # type: ignore[assignment]
            if lst and type(lst[0]) is _Tag:
                return self.typed(lst, depth)
            for i, x in enumerate(lst):
                if type(x) not in _INLINE:
                    lst[i] = self.walk(x, depth + 1)
            return lst
        if t is dict:
            d: dict[object, object] = obj  # type: ignore[assignment]
            for k, v in d.items():
                if type(k) is not str and type(k) is not int:
                    raise MalformedMessage(
                        f"map key {k!r} has type {type(k).__qualname__}; expected str or int"
                    )
                if type(v) not in _INLINE:
                    d[k] = self.walk(v, depth + 1)
            return d
        if t is _Tag:
            raise MalformedMessage(f"{obj!r} outside the head of a tagged array")
        raise MalformedMessage(f"unexpected {t.__qualname__} in message body")

    def typed(self, node: list[object], depth: int) -> object:
        tag: _Tag = node[0]  # type: ignore[assignment]
        if tag is _TUPLE:
            return tuple(x if type(x) in _INLINE else self.walk(x, depth + 1) for x in node[1:])
        if tag is _OBJECT:
            return self.obj(node, depth)
        _expect_len(node, 2 if tag is _BYTES else 3 if tag is _ENUM else 4)
        if tag is _ENUM:
            name = node[1]
            if type(name) is not str:
                raise MalformedMessage(f"enum type name {name!r} is not a str")
            spec = self.registry._by_name.get(name)
            if spec is None:
                raise UnknownType(name)
            if type(spec) is not _EnumSpec:
                raise MalformedMessage(f"{name!r} is registered as an attrs class, not an enum")
            value = self.walk(node[2], depth + 1)
            try:
                return spec.cls(value)
            except Exception as exc:
                raise MalformedMessage(f"{value!r} is not a member of {name!r}") from exc
        if tag is _BYTES:
            view, _ = self.data(node[1], None)
            return bytes(view)
        if tag is _TENSOR:
            if self.raw:
                return self.raw_tensor(node[1], node[2], node[3])
            return self.tensor(node[1], node[2], node[3])
        if tag is _NDARRAY:
            return self.ndarray(node[1], node[2], node[3])
        raise MalformedMessage(f"unknown tag {tag!r}")  # unreachable: _ext_hook filters codes

    def obj(self, node: list[object], depth: int) -> object:
        _expect_len(node, 3)
        name, fields = node[1], node[2]
        if type(name) is not str:
            raise MalformedMessage(f"object type name {name!r} is not a str")
        spec = self.registry._by_name.get(name)
        if spec is None:
            raise UnknownType(name)
        if type(spec) is not _ObjSpec:
            raise MalformedMessage(f"{name!r} is registered as an enum, not an attrs class")
        if type(fields) is not dict:
            raise MalformedMessage(f"fields of {name!r} are not a map")
        if fields.keys() != spec.field_names:
            missing = sorted(spec.field_names - fields.keys())
            extra = sorted(map(repr, fields.keys() - spec.field_names))
            raise MalformedMessage(
                f"fields of {name!r} do not match its definition: missing {missing}, "
                f"unexpected [{', '.join(extra)}]"
            )
        kwargs = {}
        for fname, alias in spec.fields:
            v = fields[fname]
            kwargs[alias] = v if type(v) in _INLINE else self.walk(v, depth + 1)
        try:
            return spec.cls(**kwargs)
        except Exception as exc:
            raise MalformedMessage(f"constructing {name!r} failed: {exc!r}") from exc

    def data(self, ref: object, nbytes: int | None) -> tuple[memoryview | bytes, bool]:
        """Resolve a data reference; returns (buffer, is_frame)."""
        if type(ref) is bytes:
            buf: memoryview | bytes = ref
            in_frame = False
        elif type(ref) is int:
            if not 1 <= ref < len(self.views):
                raise MalformedMessage(
                    f"data frame {ref} out of range: message has {len(self.views) - 1}"
                )
            if self.used[ref]:
                raise MalformedMessage(f"data frame {ref} referenced twice")
            self.used[ref] = True
            buf = self.views[ref]
            in_frame = True
        else:
            raise MalformedMessage(f"data reference {ref!r} is neither bin nor a frame index")
        if nbytes is not None and len(buf) != nbytes:
            raise MalformedMessage(f"data is {len(buf)} bytes; dtype and shape need {nbytes}")
        return buf, in_frame

    def raw_tensor(self, dtype_name: object, shape: object, ref: object) -> RawTensor:
        itemsize = _ITEMSIZE.get(dtype_name) if type(dtype_name) is str else None
        if itemsize is None:
            raise MalformedMessage(f"unknown tensor dtype {dtype_name!r}")
        dims = _shape(shape)
        buf, in_frame = self.data(ref, math.prod(dims) * itemsize)
        view = buf if in_frame and isinstance(buf, memoryview) else memoryview(bytes(buf))
        return RawTensor(dtype_name, dims, view)  # type: ignore[arg-type]

    def tensor(self, dtype_name: object, shape: object, ref: object) -> torch.Tensor:
        import torch

        dtype = _torch_dtypes()[0].get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise MalformedMessage(f"unknown tensor dtype {dtype_name!r}")
        dims = _shape(shape)
        itemsize = dtype.itemsize
        buf, in_frame = self.data(ref, math.prod(dims) * itemsize)
        if len(buf) == 0:
            return torch.empty(0, dtype=torch.uint8).view(dtype).reshape(dims)
        if not in_frame:
            u8 = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        elif isinstance(buf, memoryview) and buf.readonly:
            with warnings.catch_warnings():
                # Deliberate: the contract says such tensors are read-only (module docstring).
                warnings.filterwarnings(
                    "ignore", message="The given buffer is not writable", category=UserWarning
                )
                u8 = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            u8 = torch.frombuffer(buf, dtype=torch.uint8)
        if itemsize > 1 and u8.data_ptr() % itemsize:
            u8 = u8.clone()
        if dtype is torch.bool and bool((u8 > 1).any()):
            raise MalformedMessage("bool tensor data holds bytes other than 0 and 1")
        return u8.view(dtype).reshape(dims)

    def ndarray(self, dtype_str: object, shape: object, ref: object) -> np.ndarray[Any, Any]:
        import numpy as np

        dt = _numpy_dtype(dtype_str)
        dims = _shape(shape)
        buf, in_frame = self.data(ref, math.prod(dims) * dt.itemsize)
        if len(buf) == 0:
            return np.empty(dims, dtype=dt)
        arr = np.frombuffer(buf if in_frame else bytearray(buf), dtype=dt)
        if dt.kind == "b" and int(arr.view(np.uint8).max()) > 1:
            raise MalformedMessage("bool array data holds bytes other than 0 and 1")
        return arr.reshape(dims)


def _expect_len(node: list[object], n: int) -> None:
    if len(node) != n:
        tag: _Tag = node[0]  # type: ignore[assignment]
        raise MalformedMessage(f"{tag.label} node has {len(node) - 1} arguments; expected {n - 1}")


def _shape(shape: object) -> tuple[int, ...]:
    if (
        type(shape) is list
        and len(shape) <= _MAX_DIMS
        and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
    ):
        return tuple(shape)
    raise MalformedMessage(
        f"invalid shape {shape!r}: expected at most {_MAX_DIMS} non-negative int dimensions"
    )


def _check_meta_decoded(obj: object, depth: int) -> None:
    t = type(obj)
    if t in _INLINE:
        return
    if depth >= MAX_DEPTH:
        raise MalformedMessage(f"meta nested deeper than {MAX_DEPTH} levels")
    if t is list:
        for x in obj:  # type: ignore[attr-defined]
            _check_meta_decoded(x, depth + 1)
    elif t is dict:
        for k, v in obj.items():  # type: ignore[attr-defined]
            if type(k) is not str:
                raise MalformedMessage(f"meta key {k!r} is not a str")
            _check_meta_decoded(v, depth + 1)
    else:
        raise MalformedMessage(f"unexpected {t.__qualname__} in meta")


def decode(
    frames: Sequence[Any],
    *,
    registry: MessageRegistry,
    max_message_bytes: int,
    max_frames: int = DEFAULT_MAX_FRAMES,
    raw_tensors: bool | Callable[[dict[str, Any]], bool] = False,
) -> tuple[dict[str, Any], object]:
    """Decode the frames of one message into ``(meta, payload)``.

    ``frames`` are ``zmq.Frame``, ``bytes``, ``bytearray`` or ``memoryview``. Tensors and arrays
    whose bodies travelled as data frames are views of those frames (see the module docstring).
    With ``raw_tensors`` (or when it returns true for the message's meta), tensors decode as
    :class:`RawTensor` (bytes, no torch) instead.
    Raises :class:`MessageTooLarge` past ``max_message_bytes`` (all frames together) or
    ``max_frames`` data frames, :class:`UnknownType` for an unregistered type name and
    :class:`MalformedMessage` for anything else wrong; never any other exception.
    """
    meta: dict[str, Any] | None = None
    try:
        n = len(frames)
        if n == 0:
            raise MalformedMessage("empty message: expected a header frame")
        if n - 1 > max_frames:
            raise MessageTooLarge(f"message has {n - 1} data frames; the limit is {max_frames}")
        views: list[memoryview] = []
        total = 0
        for i, f in enumerate(frames):
            try:
                v = memoryview(f)
                if v.format != "B" or v.ndim != 1:
                    v = v.cast("B")
            except (TypeError, ValueError) as exc:
                raise MalformedMessage(
                    f"frame {i} ({type(f).__qualname__}) is not a byte buffer"
                ) from exc
            total += v.nbytes
            views.append(v)
        if total > max_message_bytes:
            raise MessageTooLarge(
                f"message is {total} bytes; the limit is max_message_bytes={max_message_bytes}"
            )
        try:
            header = _DECODER.decode(views[0])
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad utf-8 in a str
            raise MalformedMessage(f"header is not valid msgpack: {exc}") from None
        except RecursionError:
            raise MalformedMessage("header nested beyond the recursion limit") from None
        if type(header) is not list or len(header) != 4:
            raise MalformedMessage("header is not a 4-element array [version, meta, body, frames]")
        version, meta_obj, body, nframes = header
        if type(version) is not int or version != WIRE_VERSION:
            raise MalformedMessage(f"wire version {version!r}; this side speaks {WIRE_VERSION}")
        if type(meta_obj) is not dict:
            raise MalformedMessage("meta is not a map")
        _check_meta_decoded(meta_obj, 0)
        meta = meta_obj
        if type(nframes) is not int or nframes != n - 1:
            raise MalformedMessage(f"header announces {nframes!r} data frames; got {n - 1}")
        raw = raw_tensors(meta_obj) if callable(raw_tensors) else raw_tensors
        dec = _Decoder(registry, views, raw)
        payload = dec.walk(body, 0)
        if not all(dec.used[1:]):
            unused = [i for i, u in enumerate(dec.used) if i and not u]
            raise MalformedMessage(f"data frames {unused} are not referenced by the body")
        return meta_obj, payload
    except WireError as exc:
        exc.meta = meta
        raise
    except Exception as exc:  # safety net: a crafted message must never escape as another type
        err = MalformedMessage(f"undecodable message: {type(exc).__qualname__}: {exc}")
        err.meta = meta
        raise err from exc

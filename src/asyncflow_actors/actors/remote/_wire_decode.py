"""Decoding wire messages (see ``_wire`` for the format); defensive: only ``WireError``s."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ._address import ActorAddress
from ._raw_tensor import _ITEMSIZE, RawTensor, _numpy_dtype, _torch_dtypes
from ._wire_format import (
    _BYTES,
    _ENUM,
    _FROZENSET,
    _INLINE,
    _MAX_DIM,
    _MAX_DIMS,
    _NDARRAY,
    _OBJECT,
    _REF,
    _SET,
    _TAGS,
    _TENSOR,
    _TENSORS,
    _TUPLE,
    DEFAULT_MAX_FRAMES,
    MAX_DEPTH,
    WIRE_VERSION,
    _Tag,
)
from ._wire_registry import (
    MalformedMessage,
    MessageRegistry,
    MessageTooLarge,
    UnknownType,
    WireError,
    _EnumSpec,
    _ObjSpec,
)

if TYPE_CHECKING:
    import numpy as np
    import torch


# -------------------------------------------------------------------------------------- decoding


def _ext_hook(code: int, data: memoryview) -> object:
    tag = _TAGS.get(code)
    if tag is None or data.nbytes:
        raise MalformedMessage(f"unknown ext code {code} (length {data.nbytes}) in header")
    return tag


_DECODER: Final = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


ResolveRef = Callable[[ActorAddress], object]
"""How a receiving system turns an address into a ref that works there (``Mesh.resolve``)."""


class _Decoder:
    __slots__ = ("meta", "raw", "registry", "resolve", "used", "views")

    def __init__(
        self,
        registry: MessageRegistry,
        views: list[memoryview],
        raw: bool | Callable[[dict[str, Any]], bool],
        resolve: ResolveRef | None,
        meta: dict[str, Any],
    ) -> None:
        self.registry = registry
        self.views = views
        self.used = [False] * len(views)
        self.raw = raw  # a callable is asked at the first tensor: most messages have none
        self.meta = meta
        self.resolve = resolve

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
        if tag is _SET or tag is _FROZENSET:
            items = [x if type(x) in _INLINE else self.walk(x, depth + 1) for x in node[1:]]
            try:
                return frozenset(items) if tag is _FROZENSET else set(items)
            except TypeError as exc:
                raise MalformedMessage(f"{tag.label} of unhashable items: {exc}") from None
        if tag is _OBJECT:
            return self.obj(node, depth)
        if tag is _REF:
            return self.ref(node)
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
            raw = self.raw
            if raw is not True and raw is not False:
                raw = self.raw = bool(raw(self.meta))
            if raw:
                return self.raw_tensor(node[1], node[2], node[3])
            return self.tensor(node[1], node[2], node[3])
        if tag is _NDARRAY:
            return self.ndarray(node[1], node[2], node[3])
        if tag is _TENSORS:
            raw = self.raw
            if raw is not True and raw is not False:
                raw = self.raw = bool(raw(self.meta))
            return self.tensors(node[1], node[2], node[3], raw)
        raise MalformedMessage(f"unknown tag {tag!r}")  # unreachable: _ext_hook filters codes

    def ref(self, node: list[object]) -> object:
        _expect_len(node, 6)
        _, name, path, endpoints, incarnation, token = node
        if (
            type(name) is not str
            or type(path) is not str
            or type(endpoints) is not list
            or not all(type(e) is str for e in endpoints)
            or type(incarnation) is not int
            or type(token) is not str
        ):
            raise MalformedMessage("a ref is [node: str, path: str, [str...], int, str]")
        address = ActorAddress(name, path, tuple(endpoints), incarnation, token)
        if self.resolve is None:
            return address
        try:
            return self.resolve(address)
        except Exception as exc:
            raise MalformedMessage(f"cannot resolve the ref {address}: {exc}") from exc

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
        for alias, expected, check in spec.checks:  # a class registered checked=True
            if not check(kwargs[alias]):
                raise MalformedMessage(
                    f"field {alias!r} of {name!r} holds a {type(kwargs[alias]).__qualname__}; "
                    f"expected {expected}"
                )
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
        if not in_frame and dtype is not torch.bool:
            # Inline in the header (a small tensor): one copy, typed at once.
            t = torch.frombuffer(bytearray(buf), dtype=dtype)
            if itemsize > 1 and t.data_ptr() % itemsize:
                t = t.clone()
            return t if len(dims) == 1 else t.reshape(dims)
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

    def tensors(self, dtype_name: object, shapes: object, ref: object, raw: bool) -> list[Any]:
        """A packed list of tensors: views of one body (one copy if it came inline)."""
        if type(shapes) is not list or not shapes:
            raise MalformedMessage("packed tensors need a non-empty list of shapes")
        dims = [_shape(shape) for shape in shapes]
        counts = [math.prod(d) for d in dims]
        if raw:
            itemsize = _ITEMSIZE.get(dtype_name) if type(dtype_name) is str else None
            if itemsize is None:
                raise MalformedMessage(f"unknown tensor dtype {dtype_name!r}")
            buf, in_frame = self.data(ref, sum(counts) * itemsize)
            view = buf if in_frame and isinstance(buf, memoryview) else memoryview(bytes(buf))
            out: list[Any] = []
            at = 0
            for d, n in zip(dims, counts, strict=True):
                out.append(RawTensor(dtype_name, d, view[at : at + n * itemsize]))  # type: ignore[arg-type]
                at += n * itemsize
            return out
        flat = self.tensor(dtype_name, [sum(counts)], ref)
        return [
            t if t.shape == d else t.reshape(d)
            for t, d in zip(flat.split(counts), dims, strict=True)  # type: ignore[no-untyped-call]
        ]

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
            if type(x) not in _INLINE:
                _check_meta_decoded(x, depth + 1)
    elif t is dict:
        for k, v in obj.items():  # type: ignore[attr-defined]
            if type(k) is not str:
                raise MalformedMessage(f"meta key {k!r} is not a str")
            if type(v) not in _INLINE:
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
    resolve: ResolveRef | None = None,
) -> tuple[dict[str, Any], object]:
    """Decode the frames of one message into ``(meta, payload)``.

    ``frames`` are ``zmq.Frame``, ``bytes``, ``bytearray`` or ``memoryview``. Tensors and arrays
    whose bodies travelled as data frames are views of those frames (see the module docstring).
    With ``raw_tensors`` (or when it returns true for the message's meta), tensors decode as
    :class:`RawTensor` (bytes, no torch) instead. ``resolve`` turns the addresses of refs into
    refs (without it they decode as ``ActorAddress``).
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
        if type(body) in _INLINE:  # a scalar payload (a small reply): nothing to walk
            if n > 1:
                raise MalformedMessage(
                    f"data frames {list(range(1, n))} are not referenced by the body"
                )
            return meta_obj, body
        dec = _Decoder(registry, views, raw_tensors, resolve, meta_obj)
        payload = dec.walk(body, 0)
        if n > 1 and not all(dec.used[1:]):
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

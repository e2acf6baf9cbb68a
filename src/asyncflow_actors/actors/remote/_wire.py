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
    set, frozenset      [SET, *items], [FROZENSET, *items]
    attrs instance      [OBJECT, registered_name, {field_name: value, ...}]
    enum member         [ENUM, registered_name, member.value]
    torch CPU tensor    [TENSOR, dtype_name, shape, data]      dtype_name e.g. "bfloat16"
    list of tensors     [TENSORS, dtype_name, [shape, ...], data]   packed: see below
    numpy array         [NDARRAY, dtype_str, shape, data]      dtype_str e.g. "<f4"
    large bytes         [BYTES, frame_index]
    actor ref           [REF, node, path, [endpoint, ...], incarnation, token]

``data`` is ``bin`` (the body inline in the header, when smaller than ``inline_threshold``) or an
int, the index of a data frame in the message (1 = the first frame after the header).

An ``ActorRef`` travels as its ``ActorAddress`` (the encoder asks the sending system for it);
the receiving system turns it back into a ref that works there (``docs/remote.md``). Without a
system on either side (plain ``encode``/``decode``), refs cannot be sent and addresses decode as
``ActorAddress`` values.

A ``list`` of at least ``PACK_MIN`` plain, contiguous CPU tensors of one dtype, each smaller
than ``inline_threshold`` (the rows of a variable-length column), travels as one ``TENSORS``
node: their bytes joined in one body (inline or one frame), their shapes listed. It decodes as a
list of tensors again, each a view of that one body: encoding and decoding it costs one tensor's
overhead instead of one per row.

Types round-trip as themselves except: ``bytearray`` and ``memoryview`` decode as ``bytes``;
``types.MappingProxyType`` (a frozen attrs class's dict field) as ``dict``;
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

import ctypes
import enum
import sys
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs
import msgspec

from .._ref import ActorRef
from ._address import ActorAddress
from ._raw_tensor import _NUMPY_KINDS, RawTensor, _torch_dtypes
from ._raw_tensor import __getattr__ as __getattr__
from ._wire_decode import decode as decode
from ._wire_format import (
    _BYTES,
    _BYTES_LIKE,
    _ENUM,
    _FROZENSET,
    _INLINE,
    _NDARRAY,
    _OBJECT,
    _REF,
    _SCALARS,
    _SET,
    _TENSOR,
    _TENSORS,
    _TUPLE,
    PACK_MIN,
)
from ._wire_format import DEFAULT_INLINE_THRESHOLD as DEFAULT_INLINE_THRESHOLD
from ._wire_format import DEFAULT_MAX_FRAMES as DEFAULT_MAX_FRAMES
from ._wire_format import MAX_DEPTH as MAX_DEPTH
from ._wire_format import WIRE_VERSION as WIRE_VERSION
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


# -------------------------------------------------------------------------------------- encoding


_ENCODER: Final = msgspec.msgpack.Encoder()


class _PathError(Exception):
    """Internal: an unsupported value; ``path`` collects segments while unwinding (innermost first)."""

    def __init__(self, message: str, value: object) -> None:
        super().__init__(message)
        self.message = message
        self.value_type = type(value)
        self.path: list[str] = []


AddressOf = Callable[[ActorRef[Any]], ActorAddress]
"""How a sending system names a ref on the wire (its ``Mesh.address_of``)."""


class _Encoder:
    __slots__ = ("address_of", "auto_register", "frames", "registry", "threshold")

    def __init__(
        self,
        registry: MessageRegistry,
        threshold: int,
        address_of: AddressOf | None,
        auto_register: bool,
    ) -> None:
        self.registry = registry
        self.threshold = threshold
        self.address_of = address_of
        self.auto_register = auto_register
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
        if t is bytes and len(obj) < self.threshold:  # type: ignore[arg-type]
            return obj  # small bytes travel inline (raw_bytes without its views)
        if depth >= MAX_DEPTH:
            raise _PathError(f"nesting deeper than {MAX_DEPTH} levels (or a cycle)", obj)
        if t is list:
            lst: list[object] = obj  # type: ignore[assignment]
            if len(lst) >= PACK_MIN and (packed := self.packed(lst)) is not None:
                return packed
            return self.seq(lst, depth)
        if t is dict or t is types.MappingProxyType:  # a frozen attrs field's dict: a map
            return self.mapping(obj, depth)  # type: ignore[arg-type]
        if t is tuple:
            return [_TUPLE.ext, *self.seq(obj, depth)]  # type: ignore[arg-type]
        if t is frozenset or t is set:
            tag = _FROZENSET if t is frozenset else _SET
            return [tag.ext, *self.seq(tuple(obj), depth)]  # type: ignore[arg-type]
        if t in _BYTES_LIKE:
            return self.raw_bytes(obj)  # type: ignore[arg-type]
        spec = self.registry._by_type.get(t)
        if spec is None and self.auto_register and (attrs.has(t) or issubclass(t, enum.Enum)):
            self.registry.register(t)  # naming what we send is ours to do; the receiver decides
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
        tensor = _loaded("torch", "Tensor")
        if tensor is not None and isinstance(obj, tensor):
            return self.tensor(obj)
        if t is _loaded("numpy", "ndarray"):
            return self.ndarray(obj)  # type: ignore[arg-type]
        if isinstance(obj, ActorRef):
            return self.ref(obj)
        if t is ActorAddress:
            a: ActorAddress = obj  # type: ignore[assignment]
            return [_REF.ext, a.node, a.path, list(a.endpoints), a.incarnation, a.token]
        raise _PathError(_unsupported_reason(obj), obj)

    def packed(self, items: list[object]) -> object | None:
        """``items`` as one ``TENSORS`` node, or ``None`` if they are not all small, plain,
        contiguous CPU tensors of one sendable dtype."""
        tensor = _loaded("torch", "Tensor")
        if tensor is None or type(items[0]) is not tensor:
            return None
        import torch

        first: Any = items[0]
        dtype = first.dtype
        name = _torch_dtypes()[1].get(dtype)
        if name is None:
            return None
        threshold = self.threshold
        strided = torch.strided
        shapes = []
        for t in items:
            if (
                type(t) is not tensor
                or t.dtype is not dtype  # type: ignore[attr-defined]
                or not t.is_cpu  # type: ignore[attr-defined]
                or t.layout is not strided  # type: ignore[attr-defined]
                or t.nbytes >= threshold  # type: ignore[attr-defined]
                or not t.is_contiguous()  # type: ignore[attr-defined]
                or t.is_conj()  # type: ignore[attr-defined]
                or t.is_neg()  # type: ignore[attr-defined]
            ):
                return None
            shapes.append(list(t.shape))  # type: ignore[attr-defined]
        body = b"".join(
            [ctypes.string_at(t.data_ptr(), t.nbytes) for t in items]  # type: ignore[attr-defined]
        )
        return [_TENSORS.ext, name, shapes, self.data(memoryview(body))]

    def ref(self, ref: ActorRef[Any]) -> object:
        if self.address_of is None:
            raise _PathError(
                "an ActorRef can only be sent by an actor system (over a node link): plain "
                "encode() has no address for it",
                ref,
            )
        try:
            a = self.address_of(ref)
        except Exception as exc:
            raise _PathError(f"{ref!r} has no address: {exc}", ref) from exc
        return [_REF.ext, a.node, a.path, list(a.endpoints), a.incarnation, a.token]

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

        if (
            type(t) is torch.Tensor
            and t.is_cpu
            and t.layout is torch.strided
            and t.nbytes < self.threshold
            and t.is_contiguous()
            and not t.is_quantized
            and not t.is_conj()
            and not t.is_neg()
        ):
            # The fast path of the many small tensors of a message: their bytes travel inline
            # (in the header) anyway, so copy them at once instead of building a zero-copy
            # numpy view first (a few microseconds per tensor). ``data_ptr`` already counts the
            # storage offset; a contiguous tensor's elements are its next ``nbytes`` bytes.
            name = _torch_dtypes()[1].get(t.dtype)
            if name is not None:
                data = ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b""
                return [_TENSOR.ext, name, list(t.shape), data]
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


def _loaded(module: str, name: str) -> Any:
    """``module.name`` if ``module`` is loaded, else ``None``: no module loaded means no value
    of its types to meet, and a module another thread is still importing may lack ``name``
    yet (a node preloads torch in a worker thread while its links already talk)."""
    return getattr(sys.modules.get(module), name, None)


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
            if type(x) in _INLINE:
                continue
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
            if type(v) in _INLINE:
                continue
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
    address_of: AddressOf | None = None,
    auto_register: bool = False,
) -> list[bytes | memoryview]:
    """Encode one message as ZMQ frames: ``[header, *data]``.

    ``address_of`` names the ``ActorRef``s found in the payload (a system passes its own).
    ``auto_register``: register the attrs classes and enums met on the way (a system's links do:
    what a field typed ``Any`` holds is known only at send time; the receiver still decodes
    only the types it knows or may learn).

    Data frames are memoryviews of the payload's tensors, arrays and large bytes, not copies:
    they must stay unmodified until the transport is done with them (see ``SendTracker``).
    Raises :class:`UnsupportedValue` naming the offending value's type and path
    (``payload.batch[3].mask``, ``meta['x']``) for anything that cannot be sent.
    """
    enc = _Encoder(registry, inline_threshold, address_of, auto_register)
    root = "meta"
    try:
        meta_dict = meta if type(meta) is dict else dict(meta)  # only read, never kept
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

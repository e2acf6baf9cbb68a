"""Field checks of the TransferQueue's messages: every field against its annotation.

A message is built from the wire by calling its class, so checking in ``__attrs_post_init__``
checks it at decode: a malformed message (a string where an index goes, a list where a count
does) is refused there (the wire decoder turns the error into a ``MalformedMessage`` for the
sender) and never reaches the controller or a unit. Locally built messages are checked the same
way. Nested attrs values of classes without checks of their own (``Lease``, ``TopicSpec``'s
columns, samplers) are checked field by field too.
"""

from __future__ import annotations

import numbers
import sys
import types
import typing
from collections.abc import Callable, Hashable
from typing import Any, Literal, Union

import attrs

from ._errors import InvalidArgument

_MAX_SHOWN = 60


class Checked:
    """Mixin of the message classes: checks every field against its annotation when an
    instance is built (``InvalidArgument`` naming the class, the field and the value)."""

    __slots__ = ()

    def __attrs_post_init__(self) -> None:
        check_fields(self)


Check = Callable[[Any], bool]
_fields: dict[type, tuple[tuple[str, Any, Check], ...]] = {}
_checks: dict[Any, Check] = {}


def _fields_of(cls: type) -> tuple[tuple[str, Any, Check], ...]:
    """``cls``'s fields: name, annotation and its check (built once per class)."""
    known = _fields.get(cls)
    if known is None:
        module = sys.modules[cls.__module__]
        hints = typing.get_type_hints(cls, vars(module))
        known = tuple((f.name, hints[f.name], _check(hints[f.name])) for f in attrs.fields(cls))
        _fields[cls] = known
    return known


def check_fields(obj: Any) -> None:
    """Raise ``InvalidArgument`` if a field of the attrs instance ``obj`` does not match its
    annotation (recursively: items of containers, nested attrs values)."""
    for name, hint, ok in _fields_of(type(obj)):
        value = getattr(obj, name)
        if not ok(value):
            shown = repr(value)
            if len(shown) > _MAX_SHOWN:
                shown = shown[:_MAX_SHOWN] + "..."
            raise InvalidArgument(
                f"{type(obj).__name__}.{name}: expected {_name(hint)}, got "
                f"{type(value).__name__} {shown}"
            )


def _check(hint: Any) -> Check:
    """The check of values annotated ``hint`` (built once per annotation)."""
    try:
        known = _checks.get(hint)
    except TypeError:  # an unhashable annotation (``Literal`` of a list...): not cached
        return _build(hint)
    if known is None:
        known = _checks[hint] = _build(hint)
    return known


def _is_int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _build(hint: Any) -> Check:
    if hint is Any:
        return lambda v: True
    if hint is None or hint is type(None):
        return lambda v: v is None
    if hint is bool:
        return lambda v: type(v) is bool
    if hint is int:
        return _is_int
    if hint is float:
        return lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
    if hint is str:
        return lambda v: type(v) is str
    if hint is bytes:
        return lambda v: type(v) is bytes
    if hint is Hashable:
        return _hashable
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        options = tuple(_check(a) for a in args)
        return lambda v: any(ok(v) for ok in options)
    if origin is Literal:
        return lambda v: v in args
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            each = _each(args[0])
            return lambda v: type(v) is tuple and each(v)
        items = tuple(_check(a) for a in args)
        return lambda v: (
            type(v) is tuple
            and len(v) == len(items)
            and all(ok(x) for ok, x in zip(items, v, strict=True))
        )
    if origin is list:
        each = _each(args[0])
        return lambda v: type(v) is list and each(v)
    if origin is frozenset or origin is set:
        each, kind = _each(args[0]), origin
        return lambda v: isinstance(v, kind) and each(v)
    if origin is dict:
        keys, values = _each(args[0]), _each(args[1])
        return lambda v: type(v) is dict and keys(v.keys()) and values(v.values())
    if origin is not None:  # a generic class (``ActorRef[Any]``): its class is what we can see
        return lambda v: isinstance(v, origin)
    if isinstance(hint, type):
        if attrs.has(hint) and not issubclass(hint, Checked):
            return lambda v: isinstance(v, hint) and _nested_ok(v)
        return lambda v: isinstance(v, hint)
    return lambda v: True  # a form this checker does not know (a TypeVar): not checked


def _nested_ok(value: Any) -> bool:
    try:
        check_fields(value)
    except InvalidArgument:
        return False
    return True


def _each(hint: Any) -> Check:
    """The check of every item of a container of ``hint`` values."""
    if hint is Any:
        return lambda values: True
    if hint is int:  # the common case (indexes): one pass, exact ints first
        return lambda values: all(type(x) is int or _is_int(x) for x in values)
    ok = _check(hint)
    return lambda values: all(ok(x) for x in values)


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")

"""Checking a message's fields against their annotations: the one mechanism for the wire and
the TransferQueue.

The decoder rebuilds an attrs class from whatever values the wire held; a class registered with
``checked=True`` (``MessageRegistry.register``) has every field's value checked against its
annotation first, so that a peer sending ``"3"`` where an ``int`` belongs gets a
``MalformedMessage`` naming the field instead of a handler meeting a value of the wrong type.
The node protocol's own messages are checked. The TransferQueue checks its messages with the
same predicates when they are built (``transfer_queue._checks``: at decode and locally), adding
the fields of nested attrs values (``nested``).

Checked: ``Any``/``object`` (anything), ``None``, ``bool``, ``int`` (any integral number but a
bool: numpy's too), ``float`` (any real number but a bool), ``str``, ``bytes``, ``Hashable``,
unions and ``Optional``, ``Literal`` (the same type and value), ``tuple[X, ...]`` and fixed
tuples, ``list[X]``, ``Sequence[X]`` (a list or a tuple), ``set[X]``, ``frozenset[X]``,
``AbstractSet[X]`` (either), ``dict[K, V]``, ``Mapping[K, V]`` (any mapping), and any other class by ``isinstance`` (attrs classes, enums,
tensors, ``ActorRef``). An annotation it cannot read (a type variable, a string it cannot
resolve) is not checked.
"""

from __future__ import annotations

import collections.abc
import numbers
import types
import typing
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs

Check = Callable[[object], bool]
# a caller's extra check of values of a class (``None``: only ``isinstance``)
Nested = Callable[[type], Check | None]


def _anything(value: object) -> bool:
    return True


def _is(cls: type | tuple[type, ...]) -> Check:
    return lambda value: isinstance(value, cls)


def _int(value: object) -> bool:
    return type(value) is int or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool)
    )


def _float(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _of(item: object, cls: type | tuple[type, ...], nested: Nested | None) -> Check:
    """Values of ``cls`` whose every item is an ``item``."""
    if item is Any or item is object:
        return _is(cls)
    if item is int:  # the common case (indexes): one pass, exact ints first
        return lambda value: (
            isinstance(value, cls)
            and all(
                type(x) is int or _int(x)
                for x in value  # type: ignore[attr-defined]
            )
        )
    items = compile_check(item, nested)
    return lambda value: (
        isinstance(value, cls)
        and all(
            items(x)
            for x in value  # type: ignore[attr-defined]
        )
    )


_cache: dict[tuple[object, Nested | None], Check] = {}


def compile_check(hint: object, nested: Nested | None = None) -> Check:
    """A predicate for values of the annotation ``hint`` (see the module docstring), built once
    per annotation. ``nested(cls)`` may add a check of a class's values to ``isinstance``."""
    try:
        known = _cache.get((hint, nested))
    except TypeError:  # an unhashable annotation (a Literal of a list...): not cached
        return _compile(hint, nested)
    if known is None:
        known = _cache[(hint, nested)] = _compile(hint, nested)
    return known


def _compile(hint: object, nested: Nested | None) -> Check:
    if hint is Any or hint is object:
        return _anything
    if hint is None or hint is type(None):
        return lambda value: value is None
    if hint is bool:
        return _is(bool)
    if hint is int:
        return _int
    if hint is float:
        return _float
    if hint is Hashable:
        return _hashable
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [compile_check(a, nested) for a in args]
        return lambda value: any(check(value) for check in options)
    if origin is typing.Literal:
        allowed = args
        return lambda value: any(type(value) is type(a) and value == a for a in allowed)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _of(args[0], tuple, nested)
        if not args:
            return _is(tuple)
        each = [compile_check(a, nested) for a in args]
        return lambda value: (
            isinstance(value, tuple)
            and len(value) == len(each)
            and all(check(x) for check, x in zip(each, value, strict=True))
        )
    if origin is list:
        return _of(args[0] if args else Any, list, nested)
    if origin in (collections.abc.Sequence, collections.abc.Iterable):
        return _of(args[0] if args else Any, (list, tuple), nested)
    if origin is set or origin is collections.abc.MutableSet:
        return _of(args[0] if args else Any, set, nested)
    if origin is collections.abc.Set:
        return _of(args[0] if args else Any, (set, frozenset), nested)
    if origin is frozenset:
        return _of(args[0] if args else Any, frozenset, nested)
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        kind = Mapping if origin is collections.abc.Mapping else dict
        keys = compile_check(args[0], nested) if args else _anything
        values = compile_check(args[1], nested) if len(args) > 1 else _anything
        return lambda value: (
            isinstance(value, kind) and all(keys(k) and values(v) for k, v in value.items())
        )
    if isinstance(origin, type):  # a generic class (ActorRef[M]): its class
        return _is(origin)
    if isinstance(hint, type):
        extra = nested(hint) if nested is not None else None
        if extra is not None:
            cls = hint
            return lambda value: isinstance(value, cls) and extra(value)
        return _is(hint)
    return _anything


def field_checks(cls: type) -> tuple[tuple[str, str, Check], ...]:
    """(wire name, annotation as text, predicate) for each init field of the attrs class."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve here: check the others by name
        hints = {}
    checks = []
    for field in attrs.fields(cls):
        if not field.init:
            continue
        hint = hints.get(field.name, field.type)
        if hint is None or isinstance(hint, str):
            continue
        check = compile_check(hint)
        if check is not _anything:
            checks.append((field.name, _describe(hint), check))
    return tuple(checks)


def _describe(hint: object) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")

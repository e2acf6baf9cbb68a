"""Checking a decoded message's fields against their annotations (opt-in per class).

The decoder rebuilds an attrs class from whatever values the wire held; a class registered with
``checked=True`` (``MessageRegistry.register``) has every field's value checked against its
annotation first, so that a peer sending ``"3"`` where an ``int`` belongs gets a
``MalformedMessage`` naming the field instead of a handler meeting a value of the wrong type.
The node protocol's own messages are checked; a layer above (the TransferQueue) registers its
messages the same way.

Checked: ``Any``/``object`` (anything), ``None``, ``bool``, ``int`` (not a bool), ``float`` (an
int too), ``str``, ``bytes``, unions and ``Optional``, ``Literal``, ``tuple[X, ...]`` and fixed
tuples, ``list[X]``, ``Sequence[X]`` (a list or a tuple), ``set[X]``, ``frozenset[X]``, ``dict[K, V]`` / ``Mapping[K, V]``, and any
other class by ``isinstance`` (attrs classes, enums, tensors, ``ActorRef``). An annotation it
cannot read (a type variable, a string it cannot resolve) is not checked.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

Check = Callable[[object], bool]


def _anything(value: object) -> bool:
    return True


def _is(cls: type) -> Check:
    return lambda value: isinstance(value, cls)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _float(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _of(items: Check, cls: type | tuple[type, ...]) -> Check:
    return lambda value: (
        isinstance(value, cls)
        and all(
            items(x)
            for x in value  # type: ignore[attr-defined]
        )
    )


def compile_check(hint: object) -> Check:
    """A predicate for values of the annotation ``hint`` (see the module docstring)."""
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
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [compile_check(a) for a in args]
        return lambda value: any(check(value) for check in options)
    if origin is typing.Literal:
        allowed = args
        return lambda value: any(type(value) is type(a) and value == a for a in allowed)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _of(compile_check(args[0]), tuple)
        if not args:
            return _is(tuple)
        each = [compile_check(a) for a in args]
        return lambda value: (
            isinstance(value, tuple)
            and len(value) == len(each)
            and all(check(x) for check, x in zip(each, value, strict=True))
        )
    if origin is list:
        return _of(compile_check(args[0]) if args else _anything, list)
    if origin in (collections.abc.Sequence, collections.abc.Iterable):
        return _of(compile_check(args[0]) if args else _anything, (list, tuple))
    if origin in (set, collections.abc.Set, collections.abc.MutableSet):
        return _of(compile_check(args[0]) if args else _anything, (set, frozenset))
    if origin is frozenset:
        return _of(compile_check(args[0]) if args else _anything, frozenset)
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        keys = compile_check(args[0]) if args else _anything
        values = compile_check(args[1]) if len(args) > 1 else _anything
        return lambda value: (
            isinstance(value, Mapping) and all(keys(k) and values(v) for k, v in value.items())
        )
    if isinstance(origin, type):  # a generic class (ActorRef[M]): its class
        return _is(origin)
    if isinstance(hint, type):
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

"""Which classes may cross the wire: derived from the types actors declare.

A remote actor's ``Actor[M]`` names its message classes; each ``Request[R]`` names its reply
type; attrs fields name their own types. Walking these annotations registers every attrs class
and enum reachable from them, so users rarely register anything by hand. A type reachable only at
run time (a field annotated ``object`` holding an attrs instance) must be registered explicitly.
"""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs

from .._actor import Actor, accepted_message_types
from .._message import Request
from ._wire import MessageRegistry


def reply_type(request_cls: type) -> object | None:
    """``R`` for a subclass of ``Request[R]``; ``None`` if it does not say."""
    for klass in request_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (arg,) = typing.get_args(base)
                return arg  # type: ignore[no-any-return]
    return None


def register_types(registry: MessageRegistry, *annotations: object) -> None:
    """Register every attrs class and enum reachable from ``annotations`` (idempotent)."""
    seen: set[int] = set()
    for annotation in annotations:
        _visit(registry, annotation, seen)


def register_actor_types(registry: MessageRegistry, actor_cls: type[Actor[Any]]) -> tuple[str, ...]:
    """Register an actor class's message types (and replies); return their wire names.

    An empty tuple means the actor accepts anything (``Actor[Any]``).
    """
    accepts = accepted_message_types(actor_cls)
    if accepts is None:
        return ()
    register_types(registry, *accepts)
    return tuple(registry.name_of(t) for t in accepts if t in registry)


def _visit(registry: MessageRegistry, tp: object, seen: set[int]) -> None:
    if id(tp) in seen:
        return
    seen.add(id(tp))
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return
    if origin is not None:
        if isinstance(origin, type) and (attrs.has(origin) or issubclass(origin, enum.Enum)):
            _visit(registry, origin, seen)
        for arg in typing.get_args(tp):
            _visit(registry, arg, seen)
        return
    if not isinstance(tp, type):
        return
    if issubclass(tp, enum.Enum):
        if tp not in registry:
            registry.register(tp)
        return
    if not attrs.has(tp):
        return
    if tp not in registry:
        registry.register(tp)
    if issubclass(tp, Request):
        _visit(registry, reply_type(tp), seen)
    try:
        hints: dict[str, object] = typing.get_type_hints(tp)
    except Exception:  # unresolvable forward references: use what attrs resolved itself
        hints = {f.name: f.type for f in attrs.fields(tp) if not isinstance(f.type, str)}
    for hint in hints.values():
        _visit(registry, hint, seen)


def register_value_types(registry: MessageRegistry, value: object, depth: int = 0) -> None:
    """Register the attrs classes and enums found *in a value* (walking containers and fields)."""
    if depth > 32:
        return
    cls = type(value)
    if isinstance(value, enum.Enum) or attrs.has(cls):
        register_types(registry, cls)
        if attrs.has(cls):
            for field in attrs.fields(cls):
                register_value_types(registry, getattr(value, field.name), depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            register_value_types(registry, item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            register_value_types(registry, item, depth + 1)

"""Wire errors and the registry of the classes that may cross the wire (see ``_wire``)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import attrs

from ._wire_check import field_checks

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------- errors


class WireError(Exception):
    """A message could not be encoded or decoded.

    ``meta`` holds the decoded envelope when the header was readable but the body was not, so the
    caller can still address an error reply to the sender; it is ``None`` otherwise.
    """

    meta: dict[str, Any] | None = None


class UnsupportedValue(WireError, TypeError):
    """``encode`` met a value it cannot send; ``path`` locates it (``payload.batch[3].mask``)."""

    def __init__(self, message: str, *, path: str, value_type: type) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.value_type = value_type


class MalformedMessage(WireError):
    """A received message is not a valid encoding (bad header, frames, shapes, fields...)."""


class UnknownType(WireError):
    """A received message names a type that is not in the receiver's registry."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown message type {name!r}: not registered on the receiving side")
        self.name = name


class MessageTooLarge(WireError):
    """A received message exceeds ``max_message_bytes`` or ``max_frames``."""


class RegistrationError(ValueError):
    """A class cannot be registered (not attrs/enum, or a name or class already taken)."""


# ------------------------------------------------------------------------------------- registry


@attrs.frozen
class _ObjSpec:
    name: str
    cls: type
    # (field name on the wire, constructor keyword) for each init field
    fields: tuple[tuple[str, str], ...]
    field_names: frozenset[str]
    # checked=True: (constructor keyword, annotation text, predicate) per checkable field
    checks: tuple[tuple[str, str, Callable[[object], bool]], ...] = ()


@attrs.frozen
class _EnumSpec:
    name: str
    cls: type[enum.Enum]


class MessageRegistry:
    """Names the attrs classes and enums that may cross the wire, in both directions.

    ``register`` is usable as ``@registry.register`` or ``@registry.register(name="x")``. The
    default name is ``f"{cls.__module__}:{cls.__qualname__}"``; sender and receiver must agree on
    it. Registering the same class under the same name again is a no-op; a name taken by another
    class, or a class already registered under another name, raises :class:`RegistrationError`.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, _ObjSpec | _EnumSpec] = {}
        self._by_type: dict[type, _ObjSpec | _EnumSpec] = {}

    @overload
    def register(
        self, cls: type[_T], *, name: str | None = None, checked: bool = False
    ) -> type[_T]: ...
    @overload
    def register(
        self, cls: None = None, *, name: str | None = None, checked: bool = False
    ) -> Callable[[type[_T]], type[_T]]: ...
    def register(
        self, cls: type[_T] | None = None, *, name: str | None = None, checked: bool = False
    ) -> type[_T] | Callable[[type[_T]], type[_T]]:
        """Register ``cls``; ``checked``: a received instance has every field's value checked
        against the field's annotation before the class is built (``_wire_check``)."""
        if cls is None:

            def decorator(c: type[_T]) -> type[_T]:
                return self.register(c, name=name, checked=checked)

            return decorator
        registered: type[_T] = cls
        if not isinstance(cls, type):
            raise RegistrationError(f"can only register classes, got {cls!r}")
        key = f"{cls.__module__}:{cls.__qualname__}" if name is None else name
        if not isinstance(key, str) or not key:
            raise RegistrationError(f"message type name must be a non-empty str, got {key!r}")
        spec: _ObjSpec | _EnumSpec
        if issubclass(cls, enum.Enum):
            spec = _EnumSpec(key, cls)
        elif attrs.has(cls):
            init = tuple((f.name, f.alias or f.name) for f in attrs.fields(cls) if f.init)
            checks: tuple[tuple[str, str, Callable[[object], bool]], ...] = ()
            if checked:
                alias = dict(init)
                checks = tuple((alias[n], text, c) for n, text, c in field_checks(cls))
            spec = _ObjSpec(key, cls, init, frozenset(n for n, _ in init), checks)
        else:
            raise RegistrationError(
                f"{cls.__qualname__} is neither an attrs class nor an Enum: only those can be sent"
            )
        taken = self._by_name.get(key)
        if taken is not None and taken.cls is not cls:
            raise RegistrationError(
                f"message type name {key!r} is already registered for {taken.cls!r}"
            )
        known = self._by_type.get(cls)
        if known is not None and known.name != key:
            raise RegistrationError(f"{cls!r} is already registered as {known.name!r}")
        self._by_name[key] = spec
        self._by_type[cls] = spec
        return registered

    def lookup(self, name: str) -> type:
        """Return the class registered as ``name``; raise :class:`UnknownType` if none is."""
        spec = self._by_name.get(name)
        if spec is None:
            raise UnknownType(name)
        return spec.cls

    def name_of(self, cls: type) -> str:
        """Return the name ``cls`` is registered under; raise ``KeyError`` if it is not."""
        return self._by_type[cls].name

    def __contains__(self, item: object) -> bool:
        """True for a registered class or a registered name."""
        if isinstance(item, str):
            return item in self._by_name
        return item in self._by_type

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_name))

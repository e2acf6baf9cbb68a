"""Field checks of the TransferQueue's messages: every field against its annotation.

A message is built from the wire by calling its class, so checking in ``__attrs_post_init__``
checks it at decode: a malformed message (a string where an index goes, a list where a count
does) is refused there (the wire decoder turns the error into a ``MalformedMessage`` for the
sender) and never reaches the controller or a unit. Locally built messages are checked the same
way. The predicates are the wire's own (``actors.remote.compile_check``: one mechanism for the
node protocol and the queue); nested attrs values of classes without checks of their own
(``Lease``, ``TopicSpec``'s columns, samplers) are checked field by field too.
"""

from __future__ import annotations

import sys
import typing
from typing import Any

import attrs

from ..actors.remote import Check, compile_check
from ._errors import InvalidArgument

_MAX_SHOWN = 60


class Checked:
    """Mixin of the message classes: checks every field against its annotation when an
    instance is built (``InvalidArgument`` naming the class, the field and the value)."""

    __slots__ = ()

    def __attrs_post_init__(self) -> None:
        check_fields(self)


_fields: dict[type, tuple[tuple[str, Any, Check], ...]] = {}


def _fields_of(cls: type) -> tuple[tuple[str, Any, Check], ...]:
    """``cls``'s fields: name, annotation and its check (built once per class)."""
    known = _fields.get(cls)
    if known is None:
        module = sys.modules[cls.__module__]
        hints = typing.get_type_hints(cls, vars(module))
        known = tuple(
            (f.name, hints[f.name], compile_check(hints[f.name], _nested))
            for f in attrs.fields(cls)
        )
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


def _nested(cls: type) -> Check | None:
    """The fields of a nested attrs value are checked too, unless its class checks itself
    when built (``Checked``)."""
    if attrs.has(cls) and not issubclass(cls, Checked):
        return _nested_ok
    return None


def _nested_ok(value: Any) -> bool:
    try:
        check_fields(value)
    except InvalidArgument:
        return False
    return True


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")

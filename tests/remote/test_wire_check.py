"""Fields checked against their annotations at decode (``register(cls, checked=True)``)."""

from __future__ import annotations

import enum
import types
from collections.abc import Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Literal

import attrs
import numpy as np
import pytest

from asyncflow_actors.actors.remote import (
    MalformedMessage,
    MessageRegistry,
    compile_check,
    decode,
    encode,
)


class Color(enum.Enum):
    RED = 1


CASES: list[tuple[object, object, bool]] = [
    (int, 1, True),
    (int, True, False),  # a bool is not an int on the wire
    (float, 1, True),
    (str, 1, False),
    (int | None, None, True),
    (int | None, "x", False),
    (tuple[str, ...], ("a",), True),
    (tuple[str, ...], ["a"], False),
    (tuple[int, str], (1, 2), False),
    (Sequence[str], ("a",), True),
    (Sequence[str], ["a", 1], False),
    (dict[str, Any], {"a": 1}, True),
    (dict[str, Any], {1: 1}, False),
    (Mapping[str, int], {"a": "b"}, False),
    (Literal["a", "b"], "a", True),
    (Literal["a"], "c", False),
    (Color, Color.RED, True),
    (Color, 1, False),
    (Any, object(), True),
    (frozenset[int], frozenset({1}), True),
    (list[int], (1,), False),
    # the TransferQueue's checks are these too (one mechanism): its cases
    (int, np.int64(3), True),  # an index taken from a numpy array
    (float, np.float32(0.5), True),
    (list[int], [1, np.int64(2)], True),
    (list[int], [1, 2.0], False),
    (Literal[1], True, False),  # the same type and value
    (Hashable, (1, "a"), True),
    (Hashable, [1], False),
    (set[int], {1}, True),
    (set[int], frozenset({1}), False),  # a handler may add to it
    (AbstractSet[int], frozenset({1}), True),
    (dict[str, int], types.MappingProxyType({"a": 1}), False),
    (Mapping[str, int], types.MappingProxyType({"a": 1}), True),
]


@pytest.mark.parametrize(("hint", "value", "ok"), CASES)
def test_a_value_is_checked_against_its_annotation(hint: object, value: object, ok: bool) -> None:
    assert compile_check(hint)(value) is ok


@attrs.frozen
class Typed:
    count: int
    names: tuple[str, ...] = ()


@attrs.frozen
class Loose:
    count: Any
    names: Any = ()


def test_a_checked_class_refuses_a_field_of_the_wrong_type_naming_it() -> None:
    checked, loose = MessageRegistry(), MessageRegistry()
    checked.register(Typed, name="t", checked=True)
    loose.register(Loose, name="t")
    frames = encode({}, Loose("3", ("a",)), registry=loose)
    with pytest.raises(MalformedMessage, match=r"'count'.*expected int"):
        decode(frames, registry=checked, max_message_bytes=1 << 20)
    unchecked = MessageRegistry()
    unchecked.register(Typed, name="t")  # opt-in: without it the value passes as sent
    assert decode(frames, registry=unchecked, max_message_bytes=1 << 20)[1] == Typed("3", ("a",))  # type: ignore[arg-type]
    good = encode({}, Loose(3, ("a",)), registry=loose)
    assert decode(good, registry=checked, max_message_bytes=1 << 20)[1] == Typed(3, ("a",))

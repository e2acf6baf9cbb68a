"""What a node may load for its peers: actor classes by import path, and message types.

A node imports only modules under its allowlist (``--allow``), and builds only attrs classes and
enums it has registered: those reachable from the types of the actors it hosts, from the
constructors of actors being spawned, and — for actors that declare no types (``Actor[Any]``) —
attrs classes and enums of modules it has imported already or may import.
"""

from __future__ import annotations

import enum
import importlib
import sys
import typing
from collections.abc import Sequence
from typing import Any

import attrs

from .._actor import Actor
from .._errors import ActorError
from . import _protocol as P
from ._typeinfo import register_types
from ._wire import MessageRegistry, UnknownType


class SpawnRefused(ActorError):
    """A spawn request named a class outside the node's allowlist, or not an ``Actor``."""


class NotAuthorized(ActorError):
    """A peer asked for what only an actor's spawner, a ref holder or the node's owner may do."""


def allowed(target: str, allow: Sequence[str]) -> bool:
    module = target.partition(":")[0]
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allow)


def import_actor(target: str, allow: Sequence[str], node: str) -> type[Actor[Any]]:
    """The actor class ``target`` names, if the allowlist lets this node import it."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise SpawnRefused(f"spawn target must be 'package.module:Class', got {target!r}")
    if not allowed(target, allow):
        raise SpawnRefused(f"{target!r} is not in node {node!r}'s allowlist {list(allow)}")
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SpawnRefused(f"cannot import {target!r}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise SpawnRefused(f"{target!r} is not an Actor subclass")
    return obj


def learn_type(
    registry: MessageRegistry, exc: UnknownType, allow: Sequence[str], node: str
) -> bool:
    """Register the type a message named, if this node may import it; True if it did.

    A spawn's kwargs may use the classes of the actor's own module (its constructor's
    types); any message may name an attrs class or enum of a module that this process has
    imported already or that the allowlist lets it import (an ``Actor[Any]`` declares no
    types). Nothing else is ever imported.
    """
    meta = exc.meta if isinstance(exc.meta, dict) else {}
    target = meta.get("cls")
    if meta.get("k") == P.SPAWN and isinstance(target, str):
        try:
            register_types(registry, *init_hints(import_actor(target, allow, node)))
        except SpawnRefused:
            return False
        if exc.name in registry._by_name:
            return True
    module, _, qualname = exc.name.partition(":")
    if not qualname or "<" in qualname:
        return False
    if module not in sys.modules and not allowed(exc.name, allow):
        return False
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return False
    if not isinstance(obj, type) or not (attrs.has(obj) or issubclass(obj, enum.Enum)):
        return False
    register_types(registry, obj)
    return exc.name in registry._by_name


def init_hints(cls: type) -> list[object]:
    try:
        init = vars(cls).get("__init__") or next(
            (vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None
        )
        return list(typing.get_type_hints(init).values()) if init is not None else []
    except Exception:
        return []

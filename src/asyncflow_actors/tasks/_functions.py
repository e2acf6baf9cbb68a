"""Reward functions by import path: what crosses the wire and lands in ``config.json``.

A function is named ``"package.module:function"`` (imported from the path of the process) or
``"path/to/file.py:function"`` (loaded from that file; the path is made absolute when the
setting is built, so every process finds it). A function object given from Python becomes its
path (``function_path``); the process that gave it keeps using the object itself, every other
process imports it. Nothing is pickled: a lambda or a nested function has no path and is
refused with a message saying so.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "RewardImportError",
    "function_name",
    "function_path",
    "import_roots",
    "load_function",
    "module_prefixes",
]

_LOCAL: dict[str, Callable[..., Any]] = {}  # path -> the object given in this process


class RewardImportError(ValueError):
    """A reward function's path is malformed, or does not import to a callable."""


def function_path(value: object) -> str:
    """The import path of a function object, or a path string checked and normalised (a
    file path made absolute). Raises ``RewardImportError``."""
    if isinstance(value, str):
        return _normalise(value)
    if not callable(value):
        raise RewardImportError(f"a reward must be a function or 'module:function', got {value!r}")
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise RewardImportError(
            f"reward {value!r} has no import path (a lambda or nested function): define it at "
            "the top level of a module"
        )
    if module == "__main__":
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if not main:
            raise RewardImportError(
                f"reward {qualname!r} is defined in an interactive session: define it in a "
                "module or a file"
            )
        path = f"{os.path.abspath(main)}:{qualname}"
    else:
        path = f"{module}:{qualname}"
    _LOCAL[path] = value
    return path


def _normalise(path: str) -> str:
    where, sep, name = path.rpartition(":")
    if not sep or not where or not name or not all(p.isidentifier() for p in name.split(".")):
        raise RewardImportError(
            f"reward {path!r}: expected 'module:function' or 'file.py:function'"
        )
    if _is_file(where):
        return f"{os.path.abspath(where)}:{name}"
    if not all(p.isidentifier() for p in where.split(".")):
        raise RewardImportError(f"reward {path!r}: {where!r} is not a module name")
    return path


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def function_name(path: str) -> str:
    """The short name of a reward in metrics (``reward/<name>``): its function's name."""
    return path.rpartition(":")[2].rpartition(".")[2]


def load_function(path: str) -> Callable[..., Any]:
    """The callable ``path`` names (see the module docstring). Raises ``RewardImportError``
    with the import's own error."""
    given = _LOCAL.get(path)
    if given is not None:
        return given
    where, _, name = path.rpartition(":")
    try:
        module = _load_file(where) if _is_file(where) else importlib.import_module(where)
        obj: Any = module
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise RewardImportError(f"cannot import reward {path!r}: {exc!r}") from exc
    if not callable(obj):
        raise RewardImportError(f"reward {path!r} is a {type(obj).__name__}, not a function")
    fn: Callable[..., Any] = obj
    return fn


def _load_file(file: str) -> Any:
    """Load a file as a module of its own name (``__name__`` is not ``"__main__"``: a script's
    ``if __name__ == "__main__":`` block does not run), once per process."""
    digest = hashlib.sha1(file.encode()).hexdigest()[:12]
    name = f"_afa_rewards_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python file: {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def module_prefixes(paths: Sequence[str]) -> tuple[str, ...]:
    """The top-level packages of the module paths (file paths have none): what a node's
    allowlist must grant for these rewards."""
    out: list[str] = []
    for path in paths:
        where = path.rpartition(":")[0]
        if not _is_file(where):
            top = where.partition(".")[0]
            if top not in out:
                out.append(top)
    return tuple(out)


def import_roots(paths: Sequence[str]) -> tuple[str, ...]:
    """The folders this process imports the rewards' modules from (``sys.path`` entries), so
    that node processes started from elsewhere import them too."""
    roots: list[str] = []
    for top in module_prefixes(paths):
        spec = importlib.util.find_spec(top)
        origin = None if spec is None else spec.origin
        if not origin or origin in ("built-in", "frozen"):
            continue
        folder = os.path.dirname(origin)
        if spec is not None and spec.submodule_search_locations:  # a package
            folder = os.path.dirname(folder)
        if folder not in roots:
            roots.append(folder)
    return tuple(roots)

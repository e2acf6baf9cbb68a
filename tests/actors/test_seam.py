"""The seam between the local runtime and the remote half, as the import graph shows it.

grimp reads every import statement, those inside functions included, so an import that only
a function-level ``import`` hid at run time shows here. Imports under ``TYPE_CHECKING`` are
left out of the cycle check: they never run.
"""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")

ACTORS = "asyncflow_actors.actors"
REMOTE = "asyncflow_actors.actors.remote"


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _graph(*, type_checking: bool) -> dict[str, set[str]]:
    """The imports among the modules of ``asyncflow_actors.actors``."""
    graph = grimp.build_graph(
        "asyncflow_actors", exclude_type_checking_imports=not type_checking, cache_dir=None
    )
    modules = {m for m in graph.modules if _inside(m, ACTORS)}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for module in graph[todo.pop()]:
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def test_the_local_runtime_imports_nothing_from_the_remote_half() -> None:
    graph = _graph(type_checking=True)
    for module in sorted(m for m in graph if not _inside(m, REMOTE)):
        reached = {m for m in _reachable(graph, module) if _inside(m, REMOTE)}
        assert not reached, f"{module} imports {sorted(reached)}"


def test_no_import_cycle_in_the_actor_runtime() -> None:
    graph = _graph(type_checking=False)
    for module in sorted(graph):
        assert module not in _reachable(graph, module), f"{module} is on an import cycle"

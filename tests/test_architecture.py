"""The package's import graph has no circles (DESIGN.md §2: imports point down).

The layer contracts themselves are import-linter's (``[tool.importlinter]`` in pyproject.toml,
run by ``nox -s lint``); this test walks the whole graph with grimp (imports inside functions
included: a cycle broken only at run time is a cycle) and fails on any cycle, naming its
modules. Imports under ``TYPE_CHECKING`` (annotations, never run) are left out.
"""

from __future__ import annotations

import grimp


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    known = set(modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & known) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c", "p.d"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.c", imported="p.d")
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycle_in_the_package() -> None:
    graph = grimp.build_graph(
        "asyncflow_actors", cache_dir=None, exclude_type_checking_imports=True
    )
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)

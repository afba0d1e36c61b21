"""No two llmopt modules import each other, directly or around a circle.

A circle makes the import order matter (a name missing while its module is half run) and is what
deferred imports inside functions usually hide, so those count here as edges too (`ast.walk` sees
them). Imports under `if TYPE_CHECKING:` are left out: they never run. `from pkg import name` points
at `pkg.name` when that is a module and at `pkg` (its `__init__.py`) otherwise, so a package that
re-exports its submodules' names while one of them imports the package is a circle too. The import
extraction is tests/test_architecture.py's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.test_architecture import PACKAGE, ROOT, import_statements


def module_name(relative: Path) -> str:
    """"llmopt/model/decoder.py" -> "llmopt.model.decoder"; a package's __init__.py is the package."""
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the statements inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) bodies."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING":
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def import_graph(files: Iterable[tuple[Path, str]]) -> dict[str, dict[str, str]]:
    """module -> {imported llmopt module: "path:line" of the first import of it}."""
    parsed = {module_name(relative): (relative, ast.parse(source)) for relative, source in files}
    graph: dict[str, dict[str, str]] = {}
    for here, (relative, tree) in parsed.items():
        skipped = type_checking_only(tree)
        edges = graph.setdefault(here, {})
        for node, module, names in import_statements(relative, tree):
            if id(node) in skipped:
                continue
            targets = [f"{module}.{n}" if f"{module}.{n}" in parsed else module for n in names] or [module]
            for target in targets:
                while target not in parsed and "." in target:  # `import a.b.attr` style: the module part
                    target = target.rsplit(".", 1)[0]
                if target in parsed and target != here:
                    edges.setdefault(target, f"{relative}:{node.lineno}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(graph: dict[str, dict[str, str]], component: list[str]) -> str:
    """One circle and the imports inside it."""
    edges = [f"    {where}: {a} -> {b}" for a in component for b, where in sorted(graph[a].items()) if b in component]
    return f"circle of {len(component)}: {', '.join(component)}\n" + "\n".join(edges)


def test_no_import_cycles() -> None:
    graph = import_graph((p.relative_to(ROOT), p.read_text()) for p in sorted(PACKAGE.rglob("*.py")))
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(describe(graph, c) for c in found)


def test_the_checker_sees_deferred_and_package_circles() -> None:
    files = [(Path("llmopt/model/a.py"), "from llmopt.model import b\nfrom llmopt.model import c\n"),
             (Path("llmopt/model/b.py"), "def f():\n    from .a import x\n"),
             (Path("llmopt/model/c.py"), "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import llmopt.model.a\n"),
             (Path("llmopt/model/__init__.py"), "\"\"\"Lazy.\"\"\"\n"),
             (Path("llmopt/p/__init__.py"), "from llmopt.p.q import Q\n"),
             (Path("llmopt/p/q.py"), "from llmopt.p import helper\nimport llmopt.model.c.name\n")]
    graph = import_graph(files)
    assert graph["llmopt.p.q"] == {"llmopt.p": "llmopt/p/q.py:1", "llmopt.model.c": "llmopt/p/q.py:2"}
    assert cycles(graph) == [["llmopt.model.a", "llmopt.model.b"], ["llmopt.p", "llmopt.p.q"]]

"""No import cycle in the library: the graph of every import (at module level and inside
functions, where cycles used to hide) over ``domino_jax/`` and ``converters/`` is acyclic.

Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so those are edges too.
Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("domino_jax", "converters")


def _modules(root: str, packages) -> dict[str, str]:
    """``{dotted module name: file}`` of every ``.py`` under ``packages``."""
    out = {}
    for package in packages:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported(module: str, path: str, known: dict[str, str]) -> set[str]:
    """The library modules ``module`` imports (and the packages whose ``__init__`` that runs)."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node):
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    with open(path) as f:
        visit(ast.parse(f.read(), path))
    edges = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):        # the module and the packages above it
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != module:
                edges.add(prefix)
    return edges


def import_cycles(root: str, packages=PACKAGES) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-import), sorted."""
    known = _modules(root, packages)
    graph = {m: _imported(m, p, known) for m, p in known.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strongconnect(v):                         # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(cycles)


def test_library_has_no_import_cycle():
    assert import_cycles(REPO) == []


def test_the_check_finds_cycles(tmp_path):
    """A lazy import inside a function closing a cycle, and a relative one, are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import c\n")
    assert import_cycles(str(tmp_path), ("pkg",)) == [["pkg.a", "pkg.sub.b"]]

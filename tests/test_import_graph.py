"""The import graph: no cycle and no upward import, against the layer order docs/DESIGN.md states.

Every ``import`` / ``from ... import`` in workbench/ counts, wherever it is written: at the top of a
module or inside a function (a deferred import is still a dependency). Imports under
``if TYPE_CHECKING:`` are type-only: they count for the layer order (a type-only upward import
is still a seam crossed the wrong way) but not for cycles (nothing runs them).

The layer order is the table under "Layer order" in docs/DESIGN.md, read here, so the document
and the rule cannot drift: a module may import modules of its own layer or a lower one, never a
higher one; a top-level module or package missing from the table fails too. The packages
themselves (units) form no cycle either: the application floor is layered package by package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"
DESIGN = ROOT / "docs" / "DESIGN.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def _owner(name: str) -> str | None:
    """The module ``name`` refers to: itself, or the nearest package or module above it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(current: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        found = [_owner(a.name) for a in node.names if a.name.split(".")[0] == "workbench"]
        return [f for f in found if f]
    base = node.module or ""
    if node.level:  # relative: from the current package
        pkg = current if MODULES[current].name == "__init__.py" else current.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    if base.split(".")[0] != "workbench":
        return []
    out = []
    for a in node.names:
        full = f"{base}.{a.name}"  # `from pkg import submodule` imports the submodule
        target = full if full in MODULES else _owner(base)
        if target:
            out.append(target)
    return out


class _Imports(ast.NodeVisitor):
    """(target module, type_only, line) for every import of a workbench module in one file."""

    def __init__(self, current: str) -> None:
        self.current = current
        self.type_only = 0
        self.found: list[tuple[str, bool, int]] = []

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
            self.type_only += 1
            for n in node.body:
                self.visit(n)
            self.type_only -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for t in _targets(self.current, node):
            if t != self.current:
                self.found.append((t, self.type_only > 0, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for t in _targets(self.current, node):
            if t != self.current:
                self.found.append((t, self.type_only > 0, node.lineno))


def import_graph() -> dict[str, list[tuple[str, bool, int]]]:
    graph = {}
    for name, path in MODULES.items():
        v = _Imports(name)
        v.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = v.found
    return graph


def unit(module: str) -> str:
    """The layer-order unit of a module: its top-level module or package under workbench/
    (``engine``, ``config``...), ``workbench`` for the package's own ``__init__`` (the flat
    API) and ``__main__`` for the CLI."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "workbench"


def layer_order(text: str) -> dict[str, int]:
    """unit → layer, from the markdown table under the "Layer order" heading."""
    m = re.search(r"^#+ .*Layer order.*$", text, re.MULTILINE)
    assert m, "docs/DESIGN.md: no 'Layer order' heading"
    layers: dict[str, int] = {}
    for line in text[m.end():].splitlines()[1:]:
        if not line.strip():
            if layers:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue  # the header and its rule
        for u in re.findall(r"`([^`]+)`", cells[1]):
            assert u not in layers, f"docs/DESIGN.md layer order: {u} listed twice"
            layers[u] = int(cells[0])
    assert layers, "docs/DESIGN.md: the layer order table is empty"
    return layers


def cycles(graph: dict[str, list[tuple[str, bool, int]]]) -> list[list[str]]:
    """Strongly connected components (> 1 module) of the runtime imports (Tarjan)."""
    edges = {m: sorted({t for t, type_only, _ in found if not type_only})
             for m, found in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth ≤ the longest import chain (tens)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_every_unit_has_a_layer() -> None:
    layers = layer_order(DESIGN.read_text())
    missing = sorted({unit(m) for m in MODULES} - set(layers))
    assert not missing, f"{missing}: place each in the layer order table of docs/DESIGN.md"
    stale = sorted(set(layers) - {unit(m) for m in MODULES})
    assert not stale, f"docs/DESIGN.md layer order names {stale}, which do not exist"


def test_no_upward_import() -> None:
    layers = layer_order(DESIGN.read_text())
    bad = []
    for m, found in import_graph().items():
        a = unit(m)
        for t, type_only, line in found:
            b = unit(t)
            if a in layers and b in layers and layers[b] > layers[a]:
                kind = " (type-only)" if type_only else ""
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}{kind}: "
                           f"{a} (layer {layers[a]}) -> {b} (layer {layers[b]})")
    assert not bad, "imports against the layer order of docs/DESIGN.md:\n" + "\n".join(bad)


def unit_graph(graph: dict[str, list[tuple[str, bool, int]]]
               ) -> dict[str, list[tuple[str, bool, int]]]:
    """The same imports between units (packages and top-level modules): ``bench`` imports
    ``lab`` when any module of bench imports any module of lab."""
    out: dict[str, list[tuple[str, bool, int]]] = {}
    for m, found in graph.items():
        out.setdefault(unit(m), [])
        for t, type_only, line in found:
            if unit(t) != unit(m):
                out[unit(m)].append((unit(t), type_only, line))
                out.setdefault(unit(t), [])
    return out


def test_no_package_cycle() -> None:
    """Units of one layer may import each other (the application floor's packages, the
    foundations), never in a loop: each package can be read, tested and moved below the
    ones that use it."""
    graph = import_graph()
    found = cycles(unit_graph(graph))
    where = []
    for c in found:
        for m, imports in graph.items():
            for t, type_only, line in imports:
                if not type_only and unit(m) in c and unit(t) in c and unit(m) != unit(t):
                    where.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}")
    assert not found, "package cycles: " + "; ".join(" <-> ".join(c) for c in found) + \
        "\n" + "\n".join(where)


def test_the_checker_sees_deferred_and_relative_imports() -> None:
    """The rule's own parts: an import inside a function counts, TYPE_CHECKING ones are marked
    type-only, relative imports resolve, and a two-module loop is reported."""
    src = ("from typing import TYPE_CHECKING\n"
           "from . import costmodel\n"
           "if TYPE_CHECKING:\n    from workbench.engine.engine import Engine\n"
           "def f():\n    from workbench.config import SpecConfig\n")
    v = _Imports("workbench.policy.goodput")
    v.visit(ast.parse(src))
    assert [(t, tc) for t, tc, _ in v.found] == [
        ("workbench.policy.costmodel", False), ("workbench.engine.engine", True),
        ("workbench.config", False)]
    loop = {"a": [("b", False, 1)], "b": [("a", False, 1)], "c": [("a", True, 1)]}
    assert cycles(loop) == [["a", "b"]]
    assert cycles({"a": [("b", True, 1)], "b": [("a", False, 1)]}) == []
    pkg = {"workbench.bench.cli": [("workbench.lab.arms", False, 3)],
           "workbench.lab.arms": [("workbench.bench.spec", False, 5)]}
    assert cycles(unit_graph(pkg)) == [["bench", "lab"]]
    assert layer_order("## 3. Layer order\n\n| layer | units |\n|---|---|\n"
                       "| 1 | `errors` `faults` |\n| 2 | `config` |\n\nafter\n") == {
        "errors": 1, "faults": 1, "config": 2}

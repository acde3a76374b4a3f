"""No import cycle between the modules of either package, TYPE_CHECKING imports included (issue 32).

A cycle makes a layer impossible to read, test or replace without the one above it; the three the engine
had (request <-> sched.output, router.llmd <-> router.policies, server.formatters <-> server.tools) were
each hidden behind a TYPE_CHECKING import, which is why this reads the source (ast) rather than sys.modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "runtime" / "chunkwise", ROOT / "operator" / "chunkwise_operator"]


def module_graph(package: Path) -> dict[str, set[str]]:
    """Each module of `package` (dotted, from its parent) -> the package's modules it imports. An import of
    an enclosing package (its __init__) or of a sub-module is no edge: Python runs those in that order anyway."""
    root = package.parent
    files = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join([*pkg, base] if base else pkg)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + ".") and not name.startswith(mod + "."):
                    edges[mod].add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(package: Path) -> None:
    found = cycles(module_graph(package))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_cycle_behind_type_checking_is_found(tmp_path: Path) -> None:
    """The check itself: a cycle hidden behind TYPE_CHECKING and a relative import, and a chain that is none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg import c\n")
    (pkg / "a.py").write_text("from pkg.sub.b import B\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\nimport pkg.c\n"
    )
    (pkg / "c.py").write_text("import os\n")
    edges = module_graph(pkg)
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.a", "pkg.c"}
    assert cycles(edges) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("import pkg.c\n")
    assert cycles(module_graph(pkg)) == []

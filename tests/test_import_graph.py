"""No import cycle between the modules of either package, and no upward edge between the engine's layers,
TYPE_CHECKING imports included (issue 32).

A cycle makes a layer impossible to read, test or replace without the one above it; the three the engine
had (request <-> sched.output, router.llmd <-> router.policies, server.formatters <-> server.tools) were
each hidden behind a TYPE_CHECKING import, which is why this reads the source (ast) rather than sys.modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "runtime" / "chunkwise", ROOT / "operator" / "chunkwise_operator"]

# runtime/chunkwise, top to bottom (chunkwise/engine/__init__.py says what each layer is). A module belongs to
# the layer of its longest listed prefix; a module may import its own layer's and the layers below.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "applications",
        [
            "chunkwise",
            "chunkwise.cli",
            "chunkwise.argtypes",
            "chunkwise.checkpoint_report",
            "chunkwise.server",
            "chunkwise.router",
            "chunkwise.sim",
            "chunkwise.fetch",
            "chunkwise.bench",
        ],
    ),
    ("engine", ["chunkwise.engine", "chunkwise.engine.args"]),
    ("loop", ["chunkwise.engine.loop"]),
    ("worker", ["chunkwise.engine.worker"]),
    ("sched", ["chunkwise.engine.sched"]),
    ("cache", ["chunkwise.engine.cache"]),
    ("sampling", ["chunkwise.engine.sampling"]),
    ("model", ["chunkwise.engine.model"]),
    # Adapters: their weights, and the per-row matmuls the model adds to its projections.
    ("lora", ["chunkwise.engine.lora"]),
    # Quantized weights: checkpoint formats, and the matmuls over them the model's Linear calls.
    ("quant", ["chunkwise.engine.quant"]),
    ("attention", ["chunkwise.engine.attention"]),
    # Above the kernels: its shared-memory all-reduce is one of them.
    ("distributed", ["chunkwise.engine.distributed"]),
    ("kernels", ["chunkwise.engine.kernels"]),
    ("tokenizer", ["chunkwise.engine.tokenizer"]),
    ("datatypes", ["chunkwise.engine.datatypes"]),
    ("hardware", ["chunkwise.engine.hardware"]),
    ("shared names", ["chunkwise.metric_names"]),
]


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


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The index of the layer whose longest prefix matches `module`, or None when no layer claims it."""
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (i, len(prefix))
    return None if best is None else best[0]


def upward_edges(edges: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Each import of a module from a layer above the importer's, and each module no layer claims."""
    found = [f"{m}: in no layer" for m in sorted(edges) if layer_of(m, layers) is None]
    for module in sorted(edges):
        here = layer_of(module, layers)
        for dep in sorted(edges[module]):
            there = layer_of(dep, layers)
            if here is not None and there is not None and there < here:
                found.append(f"{module} ({layers[here][0]}) -> {dep} ({layers[there][0]})")
    return found


def test_no_upward_edge_between_the_engine_s_layers() -> None:
    found = upward_edges(module_graph(PACKAGES[0]), LAYERS)
    assert found == [], "upward imports or unplaced modules:\n" + "\n".join(found)


def test_an_upward_edge_behind_type_checking_is_found(tmp_path: Path) -> None:
    """The check itself: a lower layer importing a higher one only for typing, and a module in no layer."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from pkg.low.base import Base\n")
    (pkg / "low" / "base.py").write_text("import os\n")
    layers = [("high", ["pkg", "pkg.high"]), ("low", ["pkg.low"])]
    assert upward_edges(module_graph(pkg), layers) == []
    (pkg / "low" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import Thing\n"
    )
    assert upward_edges(module_graph(pkg), layers) == ["pkg.low.base (low) -> pkg.high (high)"]
    (pkg / "stray.py").write_text("")
    assert upward_edges(module_graph(pkg), [("low", ["pkg.low"])])[:2] == [
        "pkg: in no layer",
        "pkg.high: in no layer",
    ]

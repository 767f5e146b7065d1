"""The import graph of the whole package follows DESIGN.md's layers and has no cycle (CPU).

Every import counts, including those inside functions (a lazy import is still a
dependency). A package may import its own modules and any lower layer, never a
higher one; the foundation modules (registry, types, rng, statefile, errors) import no
other rlpost module, nor does params (the typed algorithm parameters config is built from).
"""

from __future__ import annotations

import ast
from pathlib import Path

import rlpost

ROOT = Path(rlpost.__file__).parent
# Highest first (DESIGN.md "Layers"); one row may hold siblings of one layer.
LAYERS = [
    ("cli", "configdoc"),
    ("commands",),
    ("tinker",),
    ("api",),
    ("cluster",),
    ("pipeline",),
    ("rollout",),
    ("resolved",),
    ("envs",),
    ("train",),
    ("rewards",),
    ("sync",),
    ("data", "models"),
    ("algos",),
    ("observe",),
    ("config",),
    ("params",),
    ("registry", "types", "rng", "statefile", "errors"),
]
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """rlpost modules ``path`` imports. ``from rlpost.x import y`` is module rlpost.x.y when
    that is a module (then it needs only that module), else the attribute y of rlpost.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return {n for n in found if n.split(".")[0] == "rlpost"}


def graph() -> dict[str, set[str]]:
    return {name: {n for n in imports(p) if n in MODULES} - {name} for name, p in MODULES.items()}


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "rlpost"


def test_every_package_has_a_layer():
    tops = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
    tops = {t for t in tops if not t.startswith("__")}
    assert tops <= set(RANK), f"packages without a layer: {sorted(tops - set(RANK))}"


def test_imports_point_down():
    bad = []
    for src, targets in graph().items():
        for dst in targets:
            a, b = layer(src), layer(dst)
            if a != b and a in RANK and b in RANK and RANK[b] <= RANK[a]:
                bad.append(f"{src} imports {dst} ({a} may not import {b})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_guards_are_pure_python():
    names = imports(ROOT / "observe" / "guards.py") | {
        n.id
        for n in ast.walk(ast.parse((ROOT / "observe" / "guards.py").read_text()))
        if isinstance(n, ast.Name)
    }
    assert not {"torch", "numpy", "transformers"} & names

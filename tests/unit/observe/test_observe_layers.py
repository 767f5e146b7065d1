"""rlpost.observe imports no other rlpost package (DESIGN.md layers), and guards need no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import rlpost.observe

PACKAGE = Path(rlpost.observe.__file__).parent
ALLOWED = ("rlpost.observe", "rlpost.registry", "rlpost.types")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_observe_imports_only_allowed_rlpost_modules():
    for path in PACKAGE.glob("*.py"):
        for name in imported_modules(path):
            if name.startswith("rlpost"):
                assert name.startswith(ALLOWED), f"{path.name} imports {name}"


def test_guards_are_pure_python():
    names = imported_modules(PACKAGE / "guards.py")
    assert not any(name.split(".")[0] in ("torch", "numpy", "transformers") for name in names)

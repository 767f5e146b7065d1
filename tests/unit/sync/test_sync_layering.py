"""rlpost.sync sits below rollout and train: it imports neither, nor anything above them (CPU)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlpost.sync as sync

SYNC_DIR = Path(sync.__file__).parent
FORBIDDEN = ("rlpost.rollout", "rlpost.train", "rlpost.pipeline", "rlpost.cluster", "rlpost.cli")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted(SYNC_DIR.glob("*.py")), ids=lambda p: p.name)
def test_sync_imports_point_down(path):
    for name in _imports(path):
        assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"
        assert name.split(".")[0] != "vllm" or path.name == "transports.py", name

"""The dependency floors leave out releases whose loaders run code from a file (torch.load
with weights_only before 2.10; pyarrow 14.0.0's IPC and Parquet readers, CVE-2023-47248),
and what this environment runs is within the declared ranges."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize(
    ("name", "unsafe", "fixed"), [("torch", "2.9.1", "2.10.0"), ("pyarrow", "14.0.0", "14.0.1")]
)
def test_the_floor_refuses_a_release_with_a_loader_that_runs_code(name, unsafe, fixed):
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == name]
    assert not spec.contains(unsafe) and spec.contains(fixed), spec
    assert spec.contains(version(name)), (version(name), spec)  # 2.13.0+cpu for torch

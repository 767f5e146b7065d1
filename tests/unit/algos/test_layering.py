"""The algos layer stays pure: allowed imports only, one signature per kind (CPU)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import rlpost.algos as algos

ALGOS_DIR = Path(algos.__file__).parent
ALLOWED_ROOTS = {"__future__", "torch", "math", "typing", "dataclasses", "collections"}
ALLOWED_ROOTS |= {"functools", "inspect"}  # the outcome estimators' one signature
ALLOWED_RLPOST = ("rlpost.registry", "rlpost.algos", "rlpost.params")  # params: pydantic only


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted(ALGOS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_imports_stay_in_layer(path):
    for name in imported_modules(path):
        if name.startswith("rlpost"):
            assert name.startswith(ALLOWED_RLPOST), f"{path.name} imports {name}"
        else:
            assert name.split(".")[0] in ALLOWED_ROOTS, f"{path.name} imports {name}"


def keyword_params(fn) -> set[str]:
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("name", algos.ADVANTAGES.names())
def test_advantage_signature(name):
    fn = algos.get_advantage_estimator(name)
    positional = list(inspect.signature(fn).parameters)[:3]
    assert positional == ["token_level_rewards", "response_mask", "group"]
    assert "values" in keyword_params(fn)
    assert "arXiv" in (fn.__doc__ or "")


@pytest.mark.parametrize("name", algos.POLICY_LOSSES.names())
def test_policy_loss_signature(name):
    fn = algos.get_policy_loss(name)
    assert list(inspect.signature(fn).parameters) == ["x", "p"]  # (LossInputs, its variant)
    assert fn.__doc__


@pytest.mark.parametrize("name", algos.KL_ESTIMATORS.names())
def test_kl_signature(name):
    assert list(inspect.signature(algos.get_kl_estimator(name)).parameters) == [
        "logprobs",
        "ref_logprobs",
    ]

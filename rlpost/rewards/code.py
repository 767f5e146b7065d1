"""Code rewards: run the task's tests on the completion, only inside the sandbox.

A sandbox that cannot start raises ``SandboxUnavailable`` rather than scoring 0. Registered
with ``concurrency``: the scorer runs that many samples at once on threads.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rlpost.rewards.registry import reward_function
from rlpost.types import RewardSample

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


def extract_code(completion: str) -> str:
    """The last ```` ```python ```` block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for lang, body in blocks if lang.lower() in _PYTHON_TAGS]
    return (python or [body for _, body in blocks])[-1]


def _tests_of(metadata: dict[str, Any]) -> list[str] | None:
    tests = metadata.get("tests")
    if tests is None:
        return None
    if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
        raise ValueError("code_tests: metadata['tests'] must be a list of assert statements")
    return list(tests)


def _check_code(*, sandbox: dict[str, Any] | None = None, **_) -> None:
    from rlpost.rewards.sandbox import SandboxConfig

    if sandbox:
        SandboxConfig(**sandbox)


@reward_function("code_tests", concurrency=min(8, os.cpu_count() or 1), check=_check_code)
def code_tests(
    sample: RewardSample,
    *,
    all_pass: bool = False,
    sandbox: dict[str, Any] | None = None,
    test_timeout_s: float | None = None,
) -> float | None:
    """Fraction of ``metadata["tests"]`` that pass (1.0/0.0 with ``all_pass``); ``None``
    without tests."""
    tests = _tests_of(sample.metadata)
    if not tests:
        return None
    code = extract_code(sample.completion)
    if not code.strip():
        return 0.0
    from rlpost.rewards.sandbox import SandboxConfig, run_python_tests

    config = SandboxConfig(**sandbox) if sandbox else None
    fraction, _ = run_python_tests(code, tests, config=config, test_timeout_s=test_timeout_s)
    if all_pass:
        return 1.0 if fraction >= 1.0 else 0.0
    return float(fraction)

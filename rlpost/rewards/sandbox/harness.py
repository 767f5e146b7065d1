"""Pass fraction of candidate code against assert tests, in one sandbox run.

The trusted side of ``harness_script.py``: only ``<nonce> <index> <outcome>`` lines with a fresh
nonce count, and a test without one fails, so a cheating candidate only lowers its score.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

from rlpost.rewards.sandbox.limits import SandboxConfig, SandboxResult
from rlpost.rewards.sandbox.runner import run_code

Outcome = str  # "pass", "fail", "timeout", or "missing" when the harness never reported
# Start-up of the harness interpreter, on top of the tests' own budgets.
_HARNESS_OVERHEAD_S = 2.0


@functools.cache
def harness_source() -> str:
    return Path(__file__).with_name("harness_script.py").read_text(encoding="utf-8")


def run_python_tests(
    code: str,
    tests: list[str],
    *,
    config: SandboxConfig | None = None,
    test_timeout_s: float | None = None,
) -> tuple[float, SandboxResult]:
    """Run ``code`` followed by each test (e.g. ``"assert add(1, 2) == 3"``) in one sandbox.

    Each test gets a fresh interpreter after the code and ``test_timeout_s``; returns
    ``(passed / len(tests), result)``."""
    if not tests:
        raise ValueError("run_python_tests needs at least one test")
    config = config or SandboxConfig()
    per_test = config.timeout_s if test_timeout_s is None else test_timeout_s
    if not per_test > 0:
        raise ValueError(f"test_timeout_s={test_timeout_s!r} must be a positive number of seconds")
    budget = dataclasses.replace(config, timeout_s=per_test * len(tests) + _HARNESS_OVERHEAD_S)
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "code": code, "tests": list(tests), "timeout_s": per_test}
    result = run_code(harness_source(), stdin=json.dumps(spec), config=budget)
    outcomes = parse_outcomes(result.stdout, nonce, len(tests))
    return outcomes.count("pass") / len(tests), result


def marker_lines(stdout: str, nonce: str, count: int) -> Iterator[tuple[int, str]]:
    """``(index, value)`` of each ``<nonce> <index> <value>`` line with ``index < count``."""
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and int(parts[1]) < count:
            yield int(parts[1]), parts[2]


def parse_outcomes(stdout: str, nonce: str, num_tests: int) -> list[Outcome]:
    """Per-test outcome from the harness's marker lines; the first line per index wins."""
    outcomes: list[Outcome] = ["missing"] * num_tests
    for index, outcome in marker_lines(stdout, nonce, num_tests):
        if outcomes[index] == "missing":
            outcomes[index] = outcome
    return outcomes

"""Code rewards: run the task's tests on the completion, only inside the sandbox.

Untrusted code never runs in this process: ``code_tests`` hands the extracted
program and the assert statements to ``rlpost.rewards.sandbox``. A sandbox that
cannot start (no bubblewrap, no user namespaces) raises ``SandboxUnavailable``
instead of silently scoring every sample 0.

Throughput: each call waits on a sandbox subprocess, so the function is
registered with ``concurrency`` and the scorer runs that many samples of the
batch at once on threads (the GIL is released while waiting). This keeps the
reward a plain per-sample callable, like every other verifiable reward.
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
    """The program in a completion.

    The last ```` ```python ```` fenced block if any, else the last fenced block of
    any language, else the whole completion. An unclosed fence (a completion cut by
    the token budget) runs to the end of the text.
    """
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
    """Fraction of ``metadata["tests"]`` that pass (1.0/0.0 with ``all_pass``).

    ``sandbox``: keyword arguments for ``SandboxConfig`` (memory, processes...);
    ``test_timeout_s``: seconds per test (default: the sandbox's ``timeout_s``).
    A program that crashes, hangs or floods output passes no test.
    ``None`` when the sample carries no tests; 0.0 for an empty program.
    """
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

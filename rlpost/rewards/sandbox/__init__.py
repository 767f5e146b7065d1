"""Sandbox for untrusted code: bubblewrap namespaces, rlimits per process and a cgroup
(or, without one, a seccomp filter) per run, failing closed.

``command.py`` says what the sandbox isolates and why, ``plan.py`` how a run is bounded.
"""

from rlpost.rewards.sandbox.command import SandboxUnavailable
from rlpost.rewards.sandbox.harness import parse_outcomes, run_python_tests
from rlpost.rewards.sandbox.limits import STATUSES, SandboxConfig, SandboxResult, Status
from rlpost.rewards.sandbox.pool import SandboxPool
from rlpost.rewards.sandbox.runner import check_available, run_code

__all__ = [
    "STATUSES",
    "SandboxConfig",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailable",
    "Status",
    "check_available",
    "parse_outcomes",
    "run_code",
    "run_python_tests",
]

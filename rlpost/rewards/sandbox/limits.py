"""Limits of one sandboxed run and how its outcome is classified.

``classify`` is pure, so every branch is tested without a sandbox.
"""

from __future__ import annotations

import math
import re
import signal
from dataclasses import dataclass
from typing import Literal

RunLimits = Literal["auto", "cgroup", "seccomp", "none"]
RUN_LIMITS: tuple[RunLimits, ...] = ("auto", "cgroup", "seccomp", "none")
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "memory", "output_limit", "killed")

# bwrap reports a command killed by signal N as exit status 128 + N.
_SIGNAL_BASE = 128
_MAX_SIGNAL = 64
# Python's MemoryError, glibc/C++ allocation failures: the run hit RLIMIT_AS.
_MEMORY_HINT = re.compile(rb"MemoryError|Cannot allocate memory|out of memory|std::bad_alloc")
_HINT_WINDOW = 4096
# The least value each integer limit accepts.
_MINIMUMS = {
    "memory_mb": 64,
    "max_processes": 1,
    "max_output_bytes": 1,
    "max_file_mb": 1,
    "tmpfs_mb": 1,
    "max_tmp_files": 16,
    "max_open_files": 16,
}


@dataclass(frozen=True)
class SandboxConfig:
    """Resource limits of one run. Defaults suit a competitive-programming reward.

    ``timeout_s`` is wall time, the CPU rlimit ``ceil(timeout_s) + 1``. ``max_tmp_files``:
    the tmpfs ``nr_inodes``, bounded where the mount stage runs. ``cpu``: the CPU to pin
    (None: round-robin). ``memory_mb`` bounds each address space and, with a cgroup, the
    run. ``run_limits``: ``auto`` (cgroups where allowed, seccomp for what they miss),
    ``cgroup`` (refuse without memory and pids cgroups), ``seccomp``, or ``none`` (a
    benchmark baseline, not for untrusted code)."""

    timeout_s: float = 5.0
    memory_mb: int = 2048
    max_processes: int = 64
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16
    tmpfs_mb: int = 64
    max_tmp_files: int = 4096
    max_open_files: int = 256
    cpu: int | None = None
    run_limits: RunLimits = "auto"

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.timeout_s) and self.timeout_s > 0,
            "timeout_s",
            self.timeout_s,
            "must be a positive number of seconds",
        )
        for field, least in _MINIMUMS.items():
            value = getattr(self, field)
            _require(value >= least, field, value, f"must be >= {least}")
        _require(
            self.cpu is None or self.cpu >= 0, "cpu", self.cpu, "must be a CPU index >= 0 or None"
        )
        if self.run_limits not in RUN_LIMITS:
            raise ValueError(
                f"sandbox run_limits={self.run_limits!r} must be one of {', '.join(RUN_LIMITS)}"
            )

    @property
    def cpu_seconds(self) -> int:
        """Soft RLIMIT_CPU in whole seconds; the hard limit is one second more."""
        return math.ceil(self.timeout_s) + 1


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    # Reject bools where numbers are expected: True would pass as 1.
    if isinstance(value, bool) or not ok:
        raise ValueError(f"sandbox {field}={value!r} {rule}")


@dataclass
class SandboxResult:
    """Outcome of one run; ``exit_code`` is ``-N`` for signal N, None when killed."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def classify(
    returncode: int | None, stderr: bytes, stopped: Status | None, oom_kills: int = 0
) -> tuple[Status, int | None]:
    """Map a finished run to ``(status, exit_code)``; ``stopped``: the supervisor's reason
    to kill it, if any; ``oom_kills`` > 0 makes a failure ``memory``."""
    if stopped is not None:
        return stopped, None
    if returncode is None:
        return "killed", None
    if returncode < 0:  # bwrap itself died from a signal nobody in the supervisor sent
        return ("memory" if oom_kills > 0 else "killed"), returncode
    sig = (
        returncode - _SIGNAL_BASE if _SIGNAL_BASE < returncode <= _SIGNAL_BASE + _MAX_SIGNAL else 0
    )
    exit_code = -sig if sig else returncode
    if returncode == 0:
        return "ok", 0
    if oom_kills > 0 or _MEMORY_HINT.search(stderr[-_HINT_WINDOW:]):
        return "memory", exit_code
    if sig == signal.SIGXCPU:
        return "timeout", exit_code
    if sig:
        return "killed", exit_code
    return "error", exit_code

"""Limits of one sandboxed run and how its outcome is classified.

``SandboxConfig`` is validated when built, so a bad value fails before any
process starts. ``classify`` turns what the supervisor saw (exit status, the
tail of stderr, whether it had to kill the run) into one ``SandboxResult.status``;
it is a pure function so every branch is tested without a sandbox.
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

    ``timeout_s`` is wall-clock time; the CPU-time rlimit is derived from it
    (``ceil(timeout_s) + 1`` seconds) so a busy loop is stopped by whichever
    comes first. ``max_output_bytes`` caps stdout and stderr separately.
    ``max_file_mb`` caps one written file (RLIMIT_FSIZE), ``tmpfs_mb`` the
    private /tmp and /dev/shm each, ``max_tmp_files`` the files, links and
    directories on each (the tmpfs ``nr_inodes``: each one holds about 1 KiB of
    kernel memory that ``tmpfs_mb`` does not count; bounded where the supervisor
    mounts the tmpfs itself: as root, or in a user namespace of its own), ``max_processes`` the
    processes and threads of one run (RLIMIT_NPROC, counted per run).
    ``cpu`` pins the run to one CPU; ``None`` spreads runs round-robin over the
    CPUs this process may use.

    ``memory_mb`` bounds each process's address space (RLIMIT_AS) and, with a
    per-run cgroup, everything the run holds together (shared memory, tmpfs
    and kernel memory included). ``run_limits`` says how the run as a whole is
    bounded: ``auto`` uses a cgroup for each of memory, processes, CPU quota
    and cpuset where the host allows one, and a seccomp filter refusing what
    the missing ones would not bound (memfd, SysV IPC, ``sched_setaffinity``);
    ``cgroup`` is ``auto`` that refuses to run without memory and pids
    cgroups; ``seccomp`` skips the cgroup and refuses all of those calls;
    ``none`` keeps only the per-process rlimits and CPU pin (shared memory then
    escapes ``memory_mb``; a baseline for benchmarks, not for untrusted code).
    """

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
    """Outcome of one run.

    ``exit_code`` is the program's exit status, ``-N`` if it died from signal
    N, and ``None`` when the supervisor killed it (timeout, output limit).
    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced) and hold
    at most ``max_output_bytes`` bytes each.
    """

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
    """Map a finished run to ``(status, exit_code)``.

    ``returncode`` is bwrap's exit status (signals arrive as ``128 + N``),
    ``stopped`` is ``"timeout"`` or ``"output_limit"`` when the supervisor
    killed the run itself, else ``None``; ``oom_kills`` counts processes the
    kernel killed at the run's cgroup memory limit, which makes a failed run
    a ``memory`` verdict whatever signal or exit status reached bwrap.
    """
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

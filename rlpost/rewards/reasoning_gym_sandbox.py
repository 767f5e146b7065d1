"""reasoning-gym scorers that evaluate their input, run in the sandbox.

The trusted side of ``reasoning_gym_sandbox_script.py``: one run scores a batch's items, each
evaluation in a child confined by :data:`CHILD_CALLS`; scores come back clipped to
:data:`SCORE_RANGE`, NaN where none came. A run that ends early restarts after its item in
progress. reasoning-gym must be installed in the interpreter's own site-packages
(:func:`sandbox_problem`).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import pickle
import platform
import secrets
import sys
from pathlib import Path
from typing import Any

from rlpost.rewards.sandbox import (
    SandboxConfig,
    SandboxUnavailable,
    check_available,
    run_code,
    seccomp,
)
from rlpost.rewards.sandbox.command import SANDBOX_PYTHON, find_interpreter
from rlpost.rewards.sandbox.harness import marker_lines

Item = tuple[str, dict[str, Any], dict[str, Any], str]
"""(task, config, entry, answer) of one answer to score."""

START_S = 60.0
"""Budget of one run before its first item: importing reasoning-gym and sympy in the sandbox."""

SCORE_RANGE = (0.0, 1.0)
"""What a reasoning-gym scorer gives; a score outside is clipped into it."""

CHILD_CALLS = (
    *("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"),
    *("pidfd_open", "pidfd_send_signal", "pidfd_getfd", "ptrace"),
    *("process_vm_readv", "process_vm_writev", "clone", "clone3", "fork", "vfork"),
)
"""What the child evaluating an answer may not do: reach another process or start one."""

_CHILD_NUMBERS = {  # aarch64 has no fork or vfork (glibc forks with clone)
    machine: dict(zip(CHILD_CALLS, numbers, strict=False))
    for machine, numbers in {
        "x86_64": (62, 200, 234, 129, 297, 434, 424, 438, 101, 310, 311, 56, 435, 57, 58),
        "aarch64": (129, 130, 131, 138, 240, 434, 424, 438, 117, 270, 271, 220, 435),
    }.items()
}


@functools.cache
def _script() -> str:
    return Path(__file__).with_name("reasoning_gym_sandbox_script.py").read_text(encoding="utf-8")


def _inside(path: str) -> str | None:
    """Where the sandbox sees host directory ``path``, or None where it does not mount it."""
    real = os.path.realpath(path)
    prefix = os.path.realpath(sys.base_prefix)
    if find_interpreter().host_prefix is not None and real.startswith(prefix + os.sep):
        return f"{SANDBOX_PYTHON}/{os.path.relpath(real, prefix)}"
    if real == "/usr" or real.startswith("/usr/"):
        return real
    return None


def sandbox_paths() -> list[str]:
    """This interpreter's ``sys.path`` as the sandbox sees it (entries it cannot see dropped)."""
    seen = (_inside(entry) for entry in sys.path if entry and os.path.isdir(entry))
    return list(dict.fromkeys(path for path in seen if path is not None))


@functools.cache
def child_filter() -> bytes:
    """The seccomp program of :data:`CHILD_CALLS` for this machine."""
    calls = [c for c in CHILD_CALLS if c in _CHILD_NUMBERS.get(platform.machine(), {})]
    return seccomp.build_filter(calls, numbers=_CHILD_NUMBERS)


def sandbox_problem() -> str | None:
    """Why evaluating scorers cannot run in the sandbox here (one phrase with the fix), or None."""
    try:
        check_available()
    except SandboxUnavailable as exc:
        return f"the sandbox cannot run here: {exc}"
    if not seccomp.supported() or platform.machine() not in _CHILD_NUMBERS:
        return (
            f"an answer's evaluation is confined by a seccomp filter, which this machine "
            f"({platform.machine()}) cannot load; score on x86_64 or aarch64 Linux"
        )
    import reasoning_gym

    home = os.path.dirname(os.path.dirname(os.path.realpath(reasoning_gym.__file__)))
    if _inside(home) not in sandbox_paths():
        return (
            f"reasoning-gym is installed in {home}, which the sandbox does not mount (it mounts "
            f"the interpreter's prefix {sys.base_prefix} and /usr); install it into that "
            "interpreter"
        )
    return None


def parse_scores(stdout: str, nonce: str, count: int) -> tuple[dict[int, float], set[int]]:
    """(scores by index, clipped to :data:`SCORE_RANGE`, indices started) of a run's output."""
    scores: dict[int, float] = {}
    started: set[int] = set()
    lo, hi = SCORE_RANGE
    for index, value in marker_lines(stdout, nonce, count):
        if value == "start":
            started.add(index)
        elif index not in scores:
            try:
                scores[index] = min(max(float(value), lo), hi)  # NaN stays NaN
            except ValueError:
                scores[index] = math.nan
    return scores, started


def _one_run(items: list[Item], config: SandboxConfig, timeout_s: float) -> tuple[dict, set, str]:
    """(scores by index, indices started, stderr's last line) of one sandbox run."""
    nonce = secrets.token_hex(16)
    head = {
        "paths": sandbox_paths(),
        "timeout_s": timeout_s,
        "filter": base64.b64encode(child_filter()).decode("ascii"),
    }
    spec = {"nonce": nonce, "items": base64.b64encode(pickle.dumps(items)).decode("ascii")}
    budget = dataclasses.replace(config, timeout_s=START_S + len(items) * (timeout_s + 1.0))
    result = run_code(_script(), stdin=f"{json.dumps(head)}\n{json.dumps(spec)}", config=budget)
    tail = [line for line in result.stderr.splitlines() if line.strip()][-1:]
    return (*parse_scores(result.stdout, nonce, len(items)), "".join(tail) or result.status)


def score_in_sandbox(
    items: list[Item], config: SandboxConfig, timeout_s: float
) -> tuple[list[float], int]:
    """(each item's score in the sandbox, NaN where none came back; the runs it took);
    RuntimeError (the sandbox's last error line) when a run scores nothing."""
    scores = [math.nan] * len(items)
    pending = list(range(len(items)))
    runs = 0
    while pending:
        got, started, why = _one_run([items[i] for i in pending], config, timeout_s)
        runs += 1
        if not started:
            raise RuntimeError(f"reasoning-gym scoring in the sandbox failed to start ({why})")
        for k, value in got.items():
            scores[pending[k]] = value
        # The run ended early: the item in progress keeps NaN, those after it run again.
        pending = [i for k, i in enumerate(pending) if k not in started]
    return scores, runs

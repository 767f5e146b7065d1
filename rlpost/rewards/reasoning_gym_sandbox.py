"""reasoning-gym scorers that evaluate their input, run in the sandbox.

The trusted side of ``reasoning_gym_sandbox_script.py``: one sandbox run scores a
batch's items (task, config, entry, answer), each in a fresh process forked inside it,
so an answer a scorer ``eval``\\ s runs as the sandbox's user with no network, a
read-only root and the run's memory, process and time limits, and never sees another
item or this process. Items travel as a pickle of plain data into the sandbox; only
``<nonce> <index> <score>`` lines come back, parsed as floats. An item without a score
(its child timed out, crashed or printed nothing) is NaN, which the reward counts as a
scorer error. A child that kills the run costs its own item; the items after it run
again in a new sandbox.

The sandbox runs the interpreter's own standard library and site-packages, read-only
under ``/opt/python`` (or ``/usr``): reasoning-gym must be installed there, not in a
virtual environment elsewhere (:func:`sandbox_problem` says so at load).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import pickle
import secrets
import sys
from pathlib import Path
from typing import Any

from rlpost.rewards.sandbox import SandboxConfig, SandboxUnavailable, check_available, run_code
from rlpost.rewards.sandbox.command import SANDBOX_PYTHON, find_interpreter
from rlpost.rewards.sandbox.harness import marker_lines

Item = tuple[str, dict[str, Any], dict[str, Any], str]
"""(task, config, entry, answer) of one answer to score."""

START_S = 60.0
"""Budget of one run before its first item: importing reasoning-gym and sympy in the sandbox."""


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


def sandbox_problem() -> str | None:
    """Why evaluating scorers cannot run in the sandbox here (one phrase with the fix), or None."""
    try:
        check_available()
    except SandboxUnavailable as exc:
        return f"the sandbox cannot run here: {exc}"
    import reasoning_gym

    home = os.path.dirname(os.path.dirname(os.path.realpath(reasoning_gym.__file__)))
    if _inside(home) not in sandbox_paths():
        return (
            f"reasoning-gym is installed in {home}, which the sandbox does not mount (it mounts "
            f"the interpreter's prefix {sys.base_prefix} and /usr); install it into that "
            "interpreter"
        )
    return None


def _one_run(items: list[Item], config: SandboxConfig, timeout_s: float) -> tuple[dict, set, str]:
    """(scores by index, indices started, stderr's last line) of one sandbox run."""
    nonce = secrets.token_hex(16)
    spec = {
        "nonce": nonce,
        "paths": sandbox_paths(),
        "timeout_s": timeout_s,
        "items": base64.b64encode(pickle.dumps(items)).decode("ascii"),
    }
    budget = dataclasses.replace(config, timeout_s=START_S + len(items) * (timeout_s + 1.0))
    result = run_code(_script(), stdin=json.dumps(spec), config=budget)
    scores: dict[int, float] = {}
    started: set[int] = set()
    for index, value in marker_lines(result.stdout, nonce, len(items)):
        if value == "start":
            started.add(index)
        elif index not in scores:
            try:
                scores[index] = float(value)
            except ValueError:
                scores[index] = math.nan
    tail = [line for line in result.stderr.splitlines() if line.strip()][-1:]
    return scores, started, "".join(tail) or f"status {result.status}"


def score_in_sandbox(items: list[Item], config: SandboxConfig, timeout_s: float) -> list[float]:
    """Each item's score from its task's scorer, run in the sandbox; NaN where none came back.

    Raises ``SandboxUnavailable`` when the sandbox cannot run, and RuntimeError (one
    line, the sandbox's last error line) when a run scores nothing at all.
    """
    scores = [math.nan] * len(items)
    pending = list(range(len(items)))
    while pending:
        got, started, why = _one_run([items[i] for i in pending], config, timeout_s)
        if not started:
            raise RuntimeError(f"reasoning-gym scoring in the sandbox failed to start ({why})")
        for k, value in got.items():
            scores[pending[k]] = value
        # The run ended early: the item in progress keeps NaN, those after it run again.
        pending = [i for k, i in enumerate(pending) if k not in started]
    return scores

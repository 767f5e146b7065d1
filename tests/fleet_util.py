"""What the fleet tests share: keeping the workers a run started, and waiting for a restarted
rollout worker to serve again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def keeping(starter: Callable[..., Any]) -> tuple[list, Callable[..., Any]]:
    """``(held, start)``: ``start`` starts the workers with ``starter`` and appends them to
    ``held``, so a test's hooks can reach the fleet of a run it did not build."""
    held: list = []

    def start(*args, **kwargs):
        held.append(starter(*args, **kwargs))
        return held[-1]

    return held, start


def await_serving(fleet, index: int, timeout_s: float = 240.0) -> None:
    """Block until rollout worker ``index`` serves again (fails with the fleet's states)."""
    deadline = time.monotonic() + timeout_s
    while not fleet.members[index].health.serving:
        assert time.monotonic() < deadline, fleet.states()
        time.sleep(0.1)

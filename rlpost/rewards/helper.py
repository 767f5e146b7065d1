"""A helper process that runs one scoring call at a time within a deadline.

A thread cannot be killed, so scorers that may run long on hostile text run here, killed past the
deadline; a process pool cannot stop one running task."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Any

START_S = 60.0
"""Allowance for starting a helper: a spawned interpreter importing the scorer's modules."""


class Overran(Exception):
    """The call did not finish within its deadline; the helper was killed."""


class Helper:
    """One spawned helper process; ``call(fn, *args, timeout_s=...)`` runs ``fn(*args)`` in it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = None

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``fn(*args)`` (a module-level function) in the helper; ``Overran`` past ``timeout_s``
        (plus :data:`START_S` for a helper's first call, which imports what ``fn`` needs)."""
        import multiprocessing as mp

        with self._lock:  # one call at a time: the helper has one thread
            start = self._pool is None
            if start:
                self._pool = mp.get_context("spawn").Pool(1)
                atexit.register(self.close)  # before interpreter teardown, not in Pool.__del__
            job = self._pool.apply_async(fn, args)
            try:
                return job.get(timeout=timeout_s + (START_S if start else 0.0))
            except mp.TimeoutError:
                self._pool.terminate()
                self._pool = None
                raise Overran(f"{getattr(fn, '__name__', fn)} overran {timeout_s:g} s") from None

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None

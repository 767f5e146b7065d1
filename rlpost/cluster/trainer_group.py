"""N data-parallel trainer workers behind the one-trainer protocol.

Every call goes to all ranks at once and rank 0's result is returned. Calls running
collectives go one at a time, so every rank enters them in one order. A failed rank raises a
one-line :class:`WorkerError` without waiting for the others.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from rlpost.errors import WorkerError, kind_of, one_line

# Methods that touch no process group: they may run while a collective call is in flight.
LOCAL_CALLS = frozenset({"describe", "version", "mfu", "scale_lr"})

GRACE_S = 10.0
"""Seconds the other ranks get to finish after one fails before the group is given up."""


class TrainerGroup:
    """The trainer protocol over ``handles`` (rank order); returns rank 0's results."""

    def __init__(self, handles: list[Any], role: str = "trainer") -> None:
        if not handles:
            raise ValueError("TrainerGroup needs at least one trainer worker")
        self.handles = list(handles)
        self.role = role
        self._serial = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=2 * len(handles), thread_name_prefix="rlpost-dp"
        )
        self._failed: str | None = None
        self._closed = False

    @property
    def world(self) -> int:
        return len(self.handles)

    def _call_all(self, name: str, *args, **kwargs) -> Any:
        if self._failed is not None:
            line = f"{self.role} group unusable after {self._failed}; cannot {name}"
            raise WorkerError(self.role, "lost", line)
        futures = [self._pool.submit(getattr(h, name), *args, **kwargs) for h in self.handles]
        order: list[int] = []  # ranks in the order their calls ended (the first failure is
        for rank, fut in enumerate(futures):  # usually the cause, later ones its echoes)
            fut.add_done_callback(lambda _, rank=rank: order.append(rank))
        done, running = wait(futures, return_when=FIRST_EXCEPTION)
        if not any(f.exception() is not None for f in done):
            return futures[0].result()
        # Every rank failing alike leaves the group in step; anything else ends it.
        if running:
            _, running = wait(running, timeout=GRACE_S)
        # (a rank's done callback may not have run yet when its result is visible)
        ended = list(dict.fromkeys([*order, *range(self.world)]))
        failed = [r for r in ended if futures[r].done() and futures[r].exception() is not None]
        causes = {
            one_line(futures[r].exception(), limit=240).split(f", {name}: ", 1)[-1] for r in failed
        }
        if running or len(failed) < self.world or len(causes) > 1:
            self._failed = f"rank {failed[0]} failed in {name}"
        # every failed rank: a lost process shows in its peers as a collective error
        parts = [f"rank {r}: {one_line(futures[r].exception(), limit=240)}" for r in failed]
        raise WorkerError(
            self.role,
            kind_of(futures[failed[0]].exception()),
            f"{self.role} rank {failed[0]} of {self.world} failed in {name} ({'; '.join(parts)})",
        ) from None

    def call(self, name: str, *args, **kwargs) -> Any:
        """``name(*args, **kwargs)`` on every rank; rank 0's result."""
        if name in LOCAL_CALLS:
            return self._call_all(name, *args, **kwargs)
        with self._serial:
            return self._call_all(name, *args, **kwargs)

    def __getattr__(self, name: str):
        """The rest of the trainer protocol, through :meth:`call` (``mfu``: rank 0's peak)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def describe(self) -> dict[str, Any]:
        return self.call("describe") | {"trainer_workers": self.world}

    def close(self) -> None:
        """Close every rank; after a failure, stop them at once where the handle can
        (``kill``): the others are blocked in a collective that will not complete."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._failed is None:
                with self._serial:
                    self._call_all("close")
                return
        except WorkerError:
            pass  # a rank failed while closing: stop them all below
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for h in self.handles:
            with contextlib.suppress(WorkerError, OSError):  # a rank already gone: nothing to free
                getattr(h, "kill", lambda: None)()
                h.close()
